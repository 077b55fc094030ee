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

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.warmup.prompts import Prompt, PromptError, PromptsFileError, read_prompts

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
    """Store the KV of every prompt; bad prompt lines, failed prompts and chunks that could
    not be stored are reported in ``errors`` (the other prompts still run).

    ``block_size`` is the server's block size: a prompt's trailing partial chunk is stored
    rounded down to it, as the connector stores and looks it up (full chunks hit regardless).
    The store settings ``config`` leaves out are those the store has recorded (see
    :func:`with_store_settings`), never defaults that would replace the servers' own.
    """
    from kvtier.config import positive_int
    from kvtier.errors import ConfigError
    from kvtier.vllm.settings import ConnectorSettings

    if engine not in ENGINES:
        raise ConfigError(f"engine: must be one of {', '.join(ENGINES)}, got {engine!r}")
    positive_int("block_size", block_size)
    for name, value in (("config", config), ("engine_args", engine_args)):
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"warmup({name}=...): expected a dict of settings, got {type(value).__name__}")
    errors: list[PromptError] = []
    if isinstance(prompts, list):
        odd = next((p for p in prompts if not isinstance(p, Prompt)), None)
        if odd is not None:
            raise TypeError(f"warmup(prompts=[...]): expected kvtier.warmup.Prompt(text=...) or "
                            f"Prompt(token_ids=[...]) items, got {type(odd).__name__}")
    elif isinstance(prompts, str | os.PathLike):
        prompts, errors = read_prompts(prompts)
    else:
        raise TypeError(f"warmup(prompts=...): expected the path of a prompts file (JSON Lines) or a list of "
                        f"kvtier.warmup.Prompt, got {type(prompts).__name__}")
    if not prompts:  # (before an engine starts, or a store is made, for nothing)
        raise ConfigError("prompts: none to warm up" + (
            f" ({len(errors)} line(s) skipped, the first: {errors[0]}); fix the prompts file" if errors else ""))
    if engine == "vllm":  # (the transformers engine checks the directory as it reads its config)
        problem = _local_model_problem(model)
        if problem:
            from kvtier.warmup.hf_engine import WarmupRefused

            raise WarmupRefused(problem)
    config = with_store_settings(config, model)
    settings = ConnectorSettings.from_extra_config(config)
    if settings.cache.chunk_tokens % block_size:
        raise ConfigError(f"block_size: {block_size} must divide chunk_tokens ({settings.cache.chunk_tokens})")
    report = WarmupReport(engine, errors=[str(e) for e in errors])
    started = time.perf_counter()
    on_progress = progress or (lambda *_: None)
    if engine == "transformers":
        _run_transformers(model, prompts, settings, dtype, block_size, engine_args or {}, report, on_progress)
    else:
        _run_vllm(model, prompts, config, settings, dtype, block_size, engine_args or {},
                  report, on_progress)
    report.seconds = time.perf_counter() - started
    return report


def _local_model_problem(model: str) -> str | None:
    """Why ``model``, named as a local path, is not what a server loads (before vLLM starts,
    which takes a missing directory for a hub id and an empty one for a bug); None where it
    may be: a directory with ``config.json`` (or Mistral's ``params.json``), a file (GGUF),
    or a hub id, which vLLM resolves."""
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file() or (path / "params.json").is_file():
            return None
        return (f"{model}: no config.json in this directory; pass the directory the server loads "
                "(with its config.json and weights)")
    if path.exists() or not (path.is_absolute() or model.startswith(("./", "../", "~"))):
        return None
    return f"{model}: no such directory; pass the directory the server loads (its --model)"


def with_store_settings(config: dict[str, Any] | None, model: str | None = None) -> dict[str, Any]:
    """``config`` (a ``kv_connector_extra_config``) completed from the store it names, if that
    store exists: how its servers write (``chunk_tokens``, ``compression``, ``durability``,
    as the newest writer recorded them) where ``config`` leaves them out. With ``model`` (the
    server's ``--model``), ``chunk_tokens`` comes from the namespaces that model's servers
    registered when they all agree on it: the newest writer may be another model's, or a
    library user who opened the store with the default.

    Warm-up must write as the servers do: the same ``chunk_tokens`` (else its keys are not
    theirs). The store's backend is followed anyway, and its shared limits (``disk_bytes``,
    ``max_record_bytes``) are left to the store, not copied: a copy would count as given, and
    put back an old budget a server changed while the warm-up's engine was starting (see
    :func:`kvtier.backends.adopt_settings`). Values given in ``config`` still win."""
    from kvtier.backends import MARKER, SHARED_LIMITS, STORED_SETTINGS, read_marker, stored_config
    from kvtier.vllm.settings import ConnectorSettings

    config = dict(config or {})
    root = ConnectorSettings.from_extra_config(config).cache.path  # checks config, resolves the default path
    if not (root / MARKER).exists():
        return config  # a new store: nothing recorded to keep
    recorded = stored_config(root, str(read_marker(root)["backend"]))
    kept = {k: getattr(recorded, k) for k in STORED_SETTINGS if k not in SHARED_LIMITS}
    served = _model_chunk_tokens(root, model) if model is not None else set()
    if len(served) == 1:
        kept["chunk_tokens"] = served.pop()
    return {**kept, **config}


def _model_chunk_tokens(root: Path, model: str) -> set[int]:
    """The chunk sizes of the namespaces ``model`` registered in the store at ``root``."""
    from kvtier.backends.index import StoreIndex

    try:
        index = StoreIndex(root, readonly=True)
    except Exception:  # no index yet: nothing registered
        return set()
    try:
        return {int(d["chunk_tokens"]) for d in index.namespaces().values()
                if d.get("model") == model and isinstance(d.get("chunk_tokens"), int)}
    finally:
        index.close()


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
        for i, p in enumerate(prompts):
            try:
                ids = list(p.token_ids) if p.token_ids is not None else hf.tokenize(p.text or "")
                extras = RequestExtras(cache_salt=p.cache_salt)
                refs = cache.chunks(ids, extras)
                before = cache.store.present_each([r.key for r in refs])
                saved = _save_waiting(cache, ids, hf.kv(ids), extras) if not all(before) else None
            except hf_engine.WarmupRefused:
                raise
            except Exception as exc:  # one prompt's failure does not stop the others
                report.errors.append(f"line {p.line}: {type(exc).__name__}: {exc}")
                continue
            if saved is not None:
                # what the store's index holds now, not what was handed to it (the store's own
                # answer counts saves still queued, which a hung disk may never write)
                after = cache.store.backend.present_each([r.key for r in refs])
                report.chunks_stored += sum(now and not was for was, now in zip(before, after, strict=True))
                problem = _not_stored(cache, len(refs), after.count(False), saved)
                if problem:
                    report.errors.append(f"line {p.line}: {problem}")
                    if saved.timed_out:  # the disk hangs: every further prompt would wait as long
                        if i + 1 < len(prompts):
                            report.errors.append(f"not run: the {len(prompts) - i - 1} prompt(s) after line {p.line}")
                        break
                    continue
            report.prompts += 1
            report.tokens += len(ids)
            progress(report.prompts, report.tokens, report.chunks_stored)


# Longest wait for a prompt's chunks to reach the disk: bounded, so that a hung disk ends
# the warm-up with an error instead of hanging it.
FLUSH_TIMEOUT_S = 600.0
# The vLLM engine's connector waits at most this long per step for the writer: below vLLM's
# own limit on a step of a multi-process engine (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s
# by default), past which it stops the engine.
VLLM_SAVE_WAIT_S = 240.0


@dataclass
class _Saved:
    dropped: int  # saves the store dropped (queue or buffers full, failed writes)
    io_errors: int  # failed writes among them
    disk_full: int  # saves a full file system refused
    timed_out: bool  # the chunks did not reach the disk within FLUSH_TIMEOUT_S
    chunk_bytes: int  # bytes of one full chunk


def _save_waiting(cache: Any, ids: list[int], kv: Any, extras: Any) -> _Saved:
    """Save a prompt's KV, waiting for the writer to make room in the write queue rather
    than drop what it cannot hold (a server drops instead: its loop must not wait for the
    disk), then for all of it to be written; both within one FLUSH_TIMEOUT_S."""
    from kvtier.cache import TOKEN_AXIS

    store = cache.store
    chunk_bytes = kv.element_size() * kv.numel() // max(1, kv.shape[TOKEN_AXIS]) * cache.namespace.chunk_tokens
    before = store.counters.snapshot()
    deadline = time.monotonic() + FLUSH_TIMEOUT_S
    cache.save(ids, kv, extras, wait=FLUSH_TIMEOUT_S)
    timed_out = not cache.flush(timeout=max(0.0, deadline - time.monotonic()))
    after = store.counters.snapshot()
    return _Saved(*(after[k] - before[k] for k in ("dropped_saves", "io_errors", "dropped_disk_full")),
                  timed_out, chunk_bytes)


def _not_stored(cache: Any, chunks: int, missing: int, saved: _Saved) -> str | None:
    """What went wrong, if ``missing`` of a prompt's ``chunks`` are not in the store after
    its save, and what to do about it; None if every chunk is there."""
    import shutil

    if not missing:
        return None
    config = cache.store.config
    what = f"{missing} of {chunks} chunk(s) not stored"
    if saved.timed_out:
        return (f"{what}: the store did not finish writing within {FLUSH_TIMEOUT_S:.0f} s (a hung or very "
                "slow disk); check the disk, then run the warm-up again")
    if saved.io_errors or saved.disk_full:
        free = shutil.disk_usage(config.path).free
        if saved.disk_full or free < missing * saved.chunk_bytes:  # what failed to be written does not fit
            return (f"{what}: the disk holding {config.path} is full ({free:,} bytes free); free space "
                    "on it, or lower disk_bytes below what it can hold, then run the warm-up again")
        return (f"{what}: writing them failed (an I/O error; see the warnings above); check the disk "
                "and the store's permissions, then run the warm-up again")
    if saved.dropped:
        return (f"{what}: the write queue could not take them (write_queue_bytes is "
                f"{config.write_queue_bytes:,} bytes; one chunk may need more); raise write_queue_bytes "
                "in --config, then run the warm-up again")
    return (f"{what}: evicted again after being stored (the store's disk budget, disk_bytes = "
            f"{config.disk_bytes:,} bytes, holds less than these prompts' KV, or another process "
            "evicted them); raise disk_bytes or warm up fewer prompts")


def _run_vllm(model: str, prompts: list[Prompt], config: dict[str, Any], settings: Any, dtype: str,
              block_size: int, engine_args: dict[str, Any], report: WarmupReport, progress: Progress) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    # the connector's default path, made explicit; saves wait for the disk rather than drop
    # what a step's saves would overflow (an offline producer may wait, a server may not)
    extra = {"save_wait_s": VLLM_SAVE_WAIT_S, **config, "path": str(settings.cache.path)}
    ktc = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_producer",
                           kv_connector_module_path="kvtier.vllm.connector", kv_connector_extra_config=extra)
    kwargs = {"dtype": dtype, "block_size": block_size, **engine_args}
    records_before = _records(settings)
    llm = LLM(model=model, kv_transfer_config=ktc, **kwargs)
    try:
        params = SamplingParams(max_tokens=1, temperature=0)
        ready = _fit_for_engine(llm, prompts, report)
        batch = 8
        for i in range(0, len(ready), batch):
            group = ready[i : i + batch]
            try:
                outs = llm.generate([_vllm_input(p) for p in group], params, use_tqdm=False)
            except Exception as exc:
                if _engine_dead(exc):
                    raise
                # vLLM refuses a whole call for one bad prompt (and aborts the rest): run the
                # call's prompts one by one, so that only the bad one is lost, with its line
                outs = []
                for p in group:
                    try:
                        outs += llm.generate([_vllm_input(p)], params, use_tqdm=False)
                    except Exception as one:
                        if _engine_dead(one):
                            raise
                        report.errors.append(f"line {p.line}: {type(one).__name__}: {_one_line(one)}")
            for o in outs:
                report.prompts += 1
                report.tokens += len(o.prompt_token_ids or [])
            progress(report.prompts, report.tokens, report.chunks_stored)
    finally:
        llm.llm_engine.engine_core.shutdown()  # flushes the connector's store
        del llm
    report.chunks_stored = _records(settings) - records_before
    progress(report.prompts, report.tokens, report.chunks_stored)


def _vllm_input(p: Prompt) -> Any:
    from vllm.inputs import TokensPrompt

    item: dict[str, Any] = {"prompt_token_ids": list(p.token_ids)} if p.token_ids is not None else {"prompt": p.text}
    if p.cache_salt:
        item["cache_salt"] = p.cache_salt
    return TokensPrompt(**item) if p.token_ids is not None else item


def _fit_for_engine(llm: Any, prompts: list[Prompt], report: WarmupReport) -> list[Prompt]:
    """The prompts the engine can take: one longer than its ``max_model_len`` is reported
    with its line (the server would refuse it too) instead of failing its whole batch.
    A text prompt is measured with the engine's tokenizer where it has one."""
    max_len = int(llm.llm_engine.model_config.max_model_len)
    try:
        tokenizer = llm.get_tokenizer()
    except Exception:  # skip_tokenizer_init: text prompts are left to the engine to judge
        tokenizer = None
    fit = []
    for p in prompts:
        n: int | None = len(p.token_ids) if p.token_ids is not None else None
        if n is None and tokenizer is not None:
            try:
                n = len(tokenizer.encode(p.text))
            except Exception:  # the engine will say what is wrong with it
                n = None
        if n is not None and n > max_len:
            report.errors.append(
                f"line {p.line}: {n:,} tokens, more than the engine's max_model_len ({max_len:,}); "
                "shorten the prompt, or warm up with the server's larger max_model_len in --engine-args")
            continue
        fit.append(p)
    return fit


def _engine_dead(exc: BaseException) -> bool:
    """Whether vLLM's engine itself has failed (then no prompt can run: stop)."""
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # another vLLM layout: judge by name
        return type(exc).__name__ == "EngineDeadError"
    return isinstance(exc, EngineDeadError)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _records(settings: Any) -> int:
    from kvtier.backends import open_backend

    backend = open_backend(settings.cache)  # only counts: no writer thread, no host tier
    try:
        return backend.usage()[0]
    finally:
        backend.close()


__all__ = ["ENGINES", "Prompt", "PromptError", "PromptsFileError", "WarmupReport", "read_prompts", "warmup",
           "with_store_settings"]
