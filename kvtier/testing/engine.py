"""Drive a real vLLM engine in this process (tests, demo, benchmarks).

Set ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` before importing vLLM to keep the engine in-process
(starts in seconds; two engines can run one after the other in one process).

``KVTIER_TEST_ASYNC_SCHEDULING=1`` (or ``Engine(async_scheduling=True)``) runs the engine
with vLLM's asynchronous scheduling, as on a GPU server: see :func:`cpu_async_scheduling`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Result:
    tokens: list[int]
    num_cached_tokens: int
    logprobs: list[float] | None
    ttft_s: float | None


def kv_transfer_config(store: str | Path, role: str = "kv_both", *, by_name: bool = False,
                       **extra: Any) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="KVTierConnector", kv_role=role,
        kv_connector_module_path=None if by_name else "kvtier.vllm.connector",
        # budgets for these machines' small models: the worker reserves host_bytes +
        # write_queue_bytes of memory when it starts (the defaults: 1.25 GiB per worker)
        kv_connector_extra_config={"path": str(store), "host_bytes": "128M", "write_queue_bytes": "128M", **extra},
    )


def observe(obj: Any, name: str, seen: Callable[..., None]) -> None:
    """Wrap ``obj.name`` so that ``seen(result, *args, **kwargs)`` runs after each call: tests
    and benchmarks watch vLLM's scheduler (its preemptions, its steps, the connector's calls)
    without changing what it does."""
    call = getattr(obj, name)

    def watched(*args: Any, **kwargs: Any) -> Any:
        result = call(*args, **kwargs)
        seen(result, *args, **kwargs)
        return result

    setattr(obj, name, watched)


@contextlib.contextmanager
def cpu_async_scheduling(on: bool = True) -> Iterator[None]:
    """Engines built inside run vLLM's asynchronous scheduling on the CPU too.

    GPU servers schedule asynchronously by default: the scheduler plans step N+1 before it
    has step N's output (vLLM's engine core with a batch queue of 2), so a connector sees
    its requests a step behind. vLLM's CPU platform turns it off ("not required on CPU");
    this sets it back on after the platform's own checks, so that the same scheduler,
    engine core and connector code run in that order here.
    """
    from vllm.platforms import current_platform

    if not on or not current_platform.is_cpu():
        yield
        return
    cls = type(current_platform)
    own = cls.__dict__.get("check_and_update_config")
    platform_check = cls.check_and_update_config

    def check_and_update_config(_cls: type, vllm_config: Any) -> None:
        platform_check(vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    cls.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if own is None:
            del cls.check_and_update_config
        else:
            cls.check_and_update_config = own  # type: ignore[method-assign]


class Engine:
    """One ``vllm.LLM`` with defaults that fit these 2-core CPU machines."""

    def __init__(self, model: str | Path, kv_transfer_config: Any = None, *, block_size: int = 32,
                 max_model_len: int = 4096, kv_cache_memory_bytes: int = 64 << 20,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 8,
                 dtype: str = "bfloat16", async_scheduling: bool | None = None, **kwargs: Any) -> None:
        from vllm import LLM

        if async_scheduling is None:
            async_scheduling = os.environ.get("KVTIER_TEST_ASYNC_SCHEDULING", "") == "1"
        # vLLM's start runs about four full garbage collections (weight loading, then the
        # freeze of its heap), each 0.4 s against the 600k objects its imports leave; frozen
        # first, they scan only what the start makes. vLLM freezes the whole heap after its
        # start anyway, and its shutdown unfreezes it, so a closed engine's last cycles (frozen
        # here by the next engine) go at that engine's shutdown: at most one closed engine
        # waits for them.
        gc.freeze()
        try:
            with cpu_async_scheduling(async_scheduling):
                self.llm = LLM(
                    model=str(model), skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len,
                    enforce_eager=True, seed=0, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                    kv_cache_memory_bytes=kv_cache_memory_bytes, distributed_executor_backend="uni",
                    kv_transfer_config=kv_transfer_config, **kwargs)
        except BaseException:
            gc.unfreeze()  # (a start that fails leaves no frozen heap behind, as close() does not run)
            raise

    def generate(self, prompts: list[list[int]], max_tokens: int = 8, *, logprobs: bool = False,
                 salts: list[str | None] | None = None, lora: Any = None) -> list[Result]:
        """Greedy generation; ``lora`` is a ``vllm.lora.request.LoRARequest`` for every prompt."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        inputs = []
        for i, p in enumerate(prompts):
            tp = TokensPrompt(prompt_token_ids=list(p))
            if salts and salts[i] is not None:
                tp["cache_salt"] = salts[i]
            inputs.append(tp)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                detokenize=False, logprobs=1 if logprobs else None)
        outs = self.llm.generate(inputs, params, use_tqdm=False, lora_request=lora)
        results = []
        for o in outs:
            c = o.outputs[0]
            lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)] if logprobs else None
            m = getattr(o, "metrics", None)
            ttft = getattr(m, "first_token_latency", None) if m is not None else None
            results.append(Result(list(c.token_ids), o.num_cached_tokens or 0, lps, ttft))
        return results

    def timed_generate(self, prompt: list[int], max_tokens: int = 1) -> tuple[Result, float]:
        t0 = time.perf_counter()
        r = self.generate([prompt], max_tokens)[0]
        return r, time.perf_counter() - t0

    @property
    def async_scheduling(self) -> bool:
        """Whether the engine core plans a step before the one before has its output."""
        return self.llm.llm_engine.engine_core.engine_core.batch_queue is not None

    @property
    def scheduler(self) -> Any:
        return self.llm.llm_engine.engine_core.engine_core.scheduler

    @property
    def scheduler_connector(self) -> Any:
        return self.scheduler.connector

    @property
    def worker_connector(self) -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        return get_kv_transfer_group() if has_kv_transfer_group() else None

    def close(self) -> None:
        # vLLM's shutdown closes the connector (its store, its threads) and runs its own full
        # collections; the engine's remaining reference cycles go with a later one (see
        # __init__). Another gc.collect() here cost 0.4 s per engine.
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.unfreeze()  # undo __init__'s freeze, whether or not this vLLM's shutdown did

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
