"""A vLLM engine with the kvtier connector, for the crash-injection harness.

    python _engine_job.py write MODEL STORE SEED   # prints READY once saving, then saves until killed

``engine`` and ``FIXED`` also serve the test's last check, in its own process (an engine
killed at random must run in a process of its own; the check's engines need not).
"""

from __future__ import annotations

import os
import random
import sys
from typing import TYPE_CHECKING

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: a SIGKILL kills the whole engine

if TYPE_CHECKING:
    from kvtier.testing.engine import Engine


def prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts sharing a 256-token prefix, then 100-400 tokens of their own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 1000) for _ in range(256)]
    return [prefix + [rng.randrange(10, 1000) for _ in range(rng.randrange(100, 400))] for _ in range(n)]


FIXED = prompts(7, 4)


def engine(model: str, store: str | None, backend: str = "") -> Engine:
    """The harness's engine on ``store`` (``None``: without the connector); ``backend`` is a
    new store's (a later engine follows the store's)."""
    from kvtier.testing.engine import Engine, kv_transfer_config

    ktc = None if store is None else kv_transfer_config(
        store, **({"backend": backend} if backend else {}), chunk_tokens=64, disk_bytes="8M",
        commit_bytes="64K", load_async=False)
    return Engine(model, ktc, dtype="float32", block_size=32, max_model_len=1024)


def main() -> None:
    model, store, seed = sys.argv[2], sys.argv[3], int(sys.argv[4])
    with engine(model, store, os.environ.get("KVTIER_JOB_BACKEND", "")) as eng:
        eng.generate(FIXED[:1], max_tokens=1)
        print("READY", flush=True)
        i = 0
        while True:  # new prompts (saves, evictions under the small budget) and repeats (loads)
            batch = prompts(seed * 1000 + i, 2) + [FIXED[i % len(FIXED)]]
            eng.generate(batch, max_tokens=2)
            # else the repeats hit vLLM's own prefix cache: no load, so no use the store's LRU
            # sees, and the fixed prompts would be evicted under the budget
            eng.llm.reset_prefix_cache()
            i += 1


if __name__ == "__main__":
    main()
