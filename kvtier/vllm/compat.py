"""What this kvtier knows about vLLM, checked at start-up: versions, parallelism, KV formats.

A setting kvtier does not handle turns the connector off with one line naming it; the engine
then serves without a cache tier. kvtier never guesses: a vLLM version outside the tested
range, a parallelism that shards a block's tokens across ranks, or a quantized KV cache
would otherwise risk storing or serving KV that passes every checksum and is still wrong.
"""

from __future__ import annotations

import re
from typing import Any

# vLLM minor releases this kvtier was tested against (inclusive). The CPU releases 0.30-0.32
# run the engine tests in CI; 0.33 (CUDA only) is covered by the API signature check.
TESTED_VLLM = ((0, 30), (0, 33))
TESTED_RANGE = f"{TESTED_VLLM[0][0]}.{TESTED_VLLM[0][1]}-{TESTED_VLLM[1][0]}.{TESTED_VLLM[1][1]}"

# KV-cache dtypes stored as they are computed; anything else (fp8, ...) is quantized with
# per-layer scales that may be computed at run time and are not part of the stored bytes.
UNQUANTIZED_KV_DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")


def release_from_vllm(connector: Any) -> bool:
    """Have vLLM let go of ``connector``, its process-wide KV transfer agent, when a worker's
    start-up fails after building it: vLLM does not, and another engine started in the same
    process (a notebook, a script that retries with other settings) would get the failed one
    back, its settings and store included. Whether vLLM held it (and so shut it down)."""
    try:
        from vllm.distributed.kv_transfer import kv_transfer_state as state

        if state.has_kv_transfer_group() and state.get_kv_transfer_group() is connector:
            state.ensure_kv_transfer_shutdown()  # (calls the connector's shutdown, then forgets it)
            return True
    except (ImportError, AttributeError):  # (a vLLM that keeps it elsewhere: nothing to do here)
        pass
    return False


def parse_version(text: str) -> tuple[int, int] | None:
    m = re.match(r"\s*(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def version_problem(version: str) -> str | None:
    """Why this vLLM version is not supported, or None."""
    v = parse_version(version)
    if v is None or not TESTED_VLLM[0] <= v <= TESTED_VLLM[1]:
        return (f"vLLM {version} is outside the versions this kvtier supports ({TESTED_RANGE}); "
                f"upgrade kvtier or use a supported vLLM")
    return None


def unsupported_setting(vllm_config: Any) -> str | None:
    """The first engine setting under which kvtier could serve wrong KV, or None."""
    pc = vllm_config.parallel_config
    if int(getattr(pc, "pipeline_parallel_size", 1)) > 1:
        return "pipeline parallelism (each stage would need its own namespace)"
    world = int(getattr(pc, "world_size", 1) or 1)
    if getattr(pc, "distributed_executor_backend", None) == "external_launcher" and world > 1:
        # Each rank then runs a scheduler of its own, and the ranks must schedule alike. A
        # store other processes write can answer one rank's lookup with a hit and the next
        # one's with a miss, so their steps (and collectives) would differ.
        return (f"the external_launcher executor with {world} ranks (each rank schedules on its own, "
                "and a shared store can answer ranks differently); use the default executor")
    for field, what in (("decode_context_parallel_size", "decode"),
                        ("prefill_context_parallel_size", "prefill")):
        n = int(getattr(pc, field, 1) or 1)
        if n > 1:
            # A manager block then holds block_size x n tokens spread over the ranks, so
            # kvtier's token-to-block mapping would save one prompt's KV under another's key.
            return f"{what} context parallelism ({field}={n})"
    if getattr(vllm_config.model_config, "enable_sleep_mode", False):
        # While asleep the weights can be swapped (the RL loop), and kvtier keys by the
        # weights it fingerprinted at start-up.
        return "sleep mode (enable_sleep_mode: the weights may change while the engine sleeps)"
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype not in UNQUANTIZED_KV_DTYPES:
        return f"quantized KV cache (kv_cache_dtype={cache_dtype})"
    return None


def startup_problem(vllm_config: Any) -> str | None:
    """Every start-up check that needs no KV layout: version, then settings."""
    import vllm

    return version_problem(str(getattr(vllm, "__version__", "unknown"))) or unsupported_setting(vllm_config)
