"""Drive a real vLLM engine in this process (tests, demo, benchmarks).

Set ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` before importing vLLM to keep the engine in-process
(starts in seconds; two engines can run one after the other in one process).
"""

from __future__ import annotations

import gc
import time
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


class Engine:
    """One ``vllm.LLM`` with defaults that fit these 2-core CPU machines."""

    def __init__(self, model: str | Path, kv_transfer_config: Any = None, *, block_size: int = 32,
                 max_model_len: int = 4096, kv_cache_memory_bytes: int = 64 << 20,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 8,
                 dtype: str = "bfloat16", **kwargs: Any) -> None:
        from vllm import LLM

        self.llm = LLM(
            model=str(model), skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len,
            enforce_eager=True, seed=0, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes, distributed_executor_backend="uni",
            kv_transfer_config=kv_transfer_config, **kwargs)

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
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
