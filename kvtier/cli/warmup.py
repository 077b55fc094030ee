"""``kvtier warmup``: fill a store with the KV of known prompts before traffic arrives."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvtier.cli._common import (
    UsageError,
    line,
    print_json,
    progress,
    stderr_console,
    stdout_console,
)

EPILOG = """\
examples:
  kvtier warmup --model /models/llama-3-8b --prompts prompts.jsonl \\
      --config '{"path": "/nvme/kvcache"}'
  kvtier warmup --model /models/llama-3-8b --prompts prompts.jsonl --engine transformers --json

PROMPTS.jsonl holds one JSON object per line: {"prompt": "text"} (tokenized by the model's
own tokenizer, as the server would) or {"prompt_token_ids": [...]}, each with an optional
"cache_salt". --config is the JSON object the server passes as kv_connector_extra_config, so
warm-up writes exactly where and how the server reads; --model must be the server's --model.
--engine vllm (default) runs vLLM with the connector as a producer: the KV is exactly what
serving computes. --engine transformers needs no vLLM (Llama, Mistral, Qwen2/3 families).
Exit status: 0 all prompts stored; 1 some prompt lines were bad or failed, or some chunks
could not be stored (the others ran; each is reported); 2 a bad command line, an unreadable
prompts file, or a model warm-up refuses.
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("warmup", help="store the KV of known prompts (offline cache warm-up)",
                       description="Compute the KV of the prompts in a JSON Lines file and store it "
                                   "where a server with the same settings will find it.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the model, exactly as the server's --model")
    p.add_argument("--prompts", required=True, metavar="PROMPTS.jsonl", help="one JSON object per line")
    p.add_argument("--engine", choices=("vllm", "transformers"), default="vllm",
                   help="what computes the KV (default: vllm)")
    p.add_argument("--config", default="{}", metavar="JSON",
                   help="the server's kv_connector_extra_config (default: the connector's defaults)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="the server's --dtype (default: auto)")
    p.add_argument("--block-size", type=_positive_int, default=16, metavar="N",
                   help="the server's block size: a prompt's partial last chunk is stored rounded down "
                        "to it (default: 16)")
    p.add_argument("--engine-args", default="{}", metavar="JSON",
                   help="--engine vllm: more vllm.LLM arguments, e.g. '{\"max_model_len\": 8192}'")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    p.set_defaults(func=run)


def _positive_int(text: str) -> int:
    """argparse type: an integer above 0 (its error becomes a usage error, exit status 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer (the server's block size), got {value}")
    return value


def _json_object(text: str, option: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{option}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise UsageError(f"{option}: must be a JSON object")
    return value


@contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """vLLM (and its engine processes, which inherit fd 1) log to stdout: keep stdout for
    kvtier's own summary."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run(args: argparse.Namespace) -> int:
    from kvtier.warmup import PromptsFileError, read_prompts, warmup
    from kvtier.warmup.hf_engine import WarmupRefused

    config = _json_object(args.config, "--config")
    engine_args = _json_object(args.engine_args, "--engine-args")
    try:
        prompts, errors = read_prompts(args.prompts)
    except PromptsFileError as exc:
        raise UsageError(f"--prompts: {exc}") from None
    if args.engine == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise UsageError("--engine vllm: vLLM is not installed here; install it, or use "
                             "--engine transformers") from exc
    err = stderr_console()
    for e in errors:
        line(err, f"[yellow]kvtier: warning: {args.prompts}: {e} (skipped)[/]")
    if not prompts:  # (before an engine starts for nothing)
        raise UsageError(f"--prompts: {args.prompts}: no prompt to warm up"
                         + (f" ({len(errors)} line(s) skipped, above); fix the file" if errors else ""))
    with progress("warming up", enabled=not args.json, unit="prompts") as bar:
        task = bar.add_task("warmup", total=len(prompts), status="")

        def on_progress(done: int, tokens: int, chunks: int) -> None:
            bar.update(task, completed=done, status=f"  {tokens:,} tokens  {chunks:,} chunks stored")

        try:
            with _stdout_to_stderr():
                report = warmup(args.model, prompts, engine=args.engine, config=config, dtype=args.dtype,
                                block_size=args.block_size, engine_args=engine_args, progress=on_progress)
        except WarmupRefused as exc:
            raise UsageError(str(exc)) from exc
    report.errors = [str(e) for e in errors] + report.errors
    if args.json:
        print_json(report.to_json())
    else:
        con = stdout_console()
        rate = f", {report.tokens / report.seconds:,.0f} tokens/s" if report.seconds else ""
        line(con, f"warmed up {report.prompts} prompt(s): {report.tokens:,} tokens, "
                  f"{report.chunks_stored:,} new chunk(s) stored in {report.seconds:.1f}s{rate} "
                  f"(engine {report.engine})")
        for e in report.errors:
            line(con, f"[yellow]not stored: {e}[/]")
    return 1 if report.errors else 0
