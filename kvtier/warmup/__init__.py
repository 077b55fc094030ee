"""Offline cache warm-up: fill a store with the KV of known prompts before traffic arrives.

    from kvtier.warmup import warmup

    report = warmup("/models/llama-3-8b", "prompts.jsonl", engine="transformers",
                    config={"path": "/nvme/kvcache"})
    print(report.prompts, report.tokens, report.chunks_stored, report.seconds)

``config`` is the very object a server passes as ``kv_connector_extra_config``, so warm-up
writes where and how the server reads. Two engines compute the KV:

* ``"vllm"`` — a vLLM engine with the connector as a ``kv_producer`` (prefill only): the KV is
  exactly what serving computes, under the namespace serving derives. ``engine_args`` go to
  ``vllm.LLM`` (use the server's dtype, block size, ...).
* ``"transformers"`` — the Hugging Face model's forward pass, no vLLM needed (CPU or GPU), for
  model families whose attention both compute alike (:mod:`kvtier.warmup.hf_engine`); the
  namespace is derived by the connector's own code with vLLM's default settings.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.warmup.prompts import Prompt, PromptError, read_prompts

ENGINES = ("transformers", "vllm")
Progress = Callable[[int, int, int], None]  # (prompts done, tokens, chunks stored)


@dataclass
class WarmupReport:
    engine: str
    prompts: int = 0  # prompts warmed up
    tokens: int = 0
    chunks_stored: int = 0  # new records in the store
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)  # bad prompt lines, failed prompts
    namespace: str | None = None  # the namespace id (hex), where the engine tells it

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "prompts": self.prompts, "tokens": self.tokens,
                "chunks_stored": self.chunks_stored, "seconds": round(self.seconds, 3),
                "tokens_per_s": round(self.tokens / self.seconds) if self.seconds else 0,
                "errors": self.errors, "namespace": self.namespace}


def warmup(model: str, prompts: str | Path | list[Prompt], *, engine: str = "transformers",
           config: dict[str, Any] | None = None, dtype: str = "auto", block_size: int = 16,
           engine_args: dict[str, Any] | None = None, progress: Progress | None = None) -> WarmupReport:
    """Store the KV of every prompt; bad prompt lines are reported in ``errors`` and skipped.

    ``block_size`` is the server's block size: a prompt's trailing partial chunk is stored
    rounded down to it, as the connector stores and looks it up (full chunks hit regardless).
    """
    from kvtier.errors import ConfigError
    from kvtier.vllm.settings import ConnectorSettings

    if engine not in ENGINES:
        raise ConfigError(f"engine: must be one of {', '.join(ENGINES)}, got {engine!r}")
    errors: list[PromptError] = []
    if not isinstance(prompts, list):
        prompts, errors = read_prompts(prompts)
    settings = ConnectorSettings.from_extra_config(config)
    if settings.cache.chunk_tokens % block_size:
        raise ConfigError(f"block_size: {block_size} must divide chunk_tokens ({settings.cache.chunk_tokens})")
    report = WarmupReport(engine, errors=[str(e) for e in errors])
    started = time.perf_counter()
    on_progress = progress or (lambda *_: None)
    if engine == "transformers":
        _run_transformers(model, prompts, settings, dtype, block_size, engine_args or {}, report, on_progress)
    else:
        _run_vllm(model, prompts, dict(config or {}), settings, dtype, block_size, engine_args or {},
                  report, on_progress)
    report.seconds = time.perf_counter() - started
    return report


def _run_transformers(model: str, prompts: list[Prompt], settings: Any, dtype: str, block_size: int,
                      engine_args: dict[str, Any], report: WarmupReport, progress: Progress) -> None:
    from kvtier.cache import KVCache
    from kvtier.keys import RequestExtras
    from kvtier.store import ChunkStore
    from kvtier.warmup import hf_engine

    if engine_args:
        raise hf_engine.WarmupRefused("engine_args apply to --engine vllm only")
    hf_engine.check_model(model)  # refuse before creating anything
    store = ChunkStore(settings.cache)  # first: the weights-fingerprint cache lives in it
    try:
        hf = hf_engine.load(model, settings, dtype, need_tokenizer=any(p.text is not None for p in prompts))
    except BaseException:
        store.close()
        raise
    report.namespace = hf.namespace.id.hex()
    with KVCache(store, hf.namespace, tail_granularity=block_size) as cache:
        for p in prompts:
            try:
                ids = list(p.token_ids) if p.token_ids is not None else hf.tokenize(p.text or "")
                extras = RequestExtras(cache_salt=p.cache_salt)
                new = [c for c in cache.chunks(ids, extras) if not cache.store.count_present_prefix([c.key])]
                if new:  # already stored in full: no forward pass
                    cache.save(ids, hf.kv(ids), extras)
            except hf_engine.WarmupRefused:
                raise
            except Exception as exc:  # one prompt's failure does not stop the others
                report.errors.append(f"line {p.line}: {type(exc).__name__}: {exc}")
                continue
            report.prompts += 1
            report.tokens += len(ids)
            report.chunks_stored += len(new)
            progress(report.prompts, report.tokens, report.chunks_stored)
        if not cache.flush(timeout=600):
            report.errors.append("the store did not finish writing within 600 s")


def _run_vllm(model: str, prompts: list[Prompt], config: dict[str, Any], settings: Any, dtype: str,
              block_size: int, engine_args: dict[str, Any], report: WarmupReport, progress: Progress) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    extra = {**config, "path": str(settings.cache.path)}  # the connector's default path, made explicit
    ktc = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_producer",
                           kv_connector_module_path="kvtier.vllm.connector", kv_connector_extra_config=extra)
    kwargs = {"dtype": dtype, "block_size": block_size, **engine_args}
    records_before = _records(settings)
    llm = LLM(model=model, kv_transfer_config=ktc, **kwargs)
    try:
        params = SamplingParams(max_tokens=1, temperature=0)
        batch = 8
        for i in range(0, len(prompts), batch):
            group = prompts[i : i + batch]
            inputs: list[Any] = []
            for p in group:
                item: dict[str, Any] = ({"prompt_token_ids": list(p.token_ids)} if p.token_ids is not None
                                        else {"prompt": p.text})
                if p.cache_salt:
                    item["cache_salt"] = p.cache_salt
                inputs.append(TokensPrompt(**item) if p.token_ids is not None else item)
            outs = llm.generate(inputs, params, use_tqdm=False)
            for o in outs:
                report.prompts += 1
                report.tokens += len(o.prompt_token_ids or [])
            progress(report.prompts, report.tokens, report.chunks_stored)
    finally:
        llm.llm_engine.engine_core.shutdown()  # flushes the connector's store
        del llm
    report.chunks_stored = _records(settings) - records_before
    progress(report.prompts, report.tokens, report.chunks_stored)


def _records(settings: Any) -> int:
    from kvtier.backends import open_backend

    backend = open_backend(settings.cache)  # only counts: no writer thread, no host tier
    try:
        return backend.usage()[0]
    finally:
        backend.close()


__all__ = ["ENGINES", "Prompt", "PromptError", "WarmupReport", "read_prompts", "warmup"]
