"""A vLLM engine with the kvtier connector, for the crash-injection harness.

    python _engine_job.py write MODEL STORE SEED   # prints READY once saving, then saves until killed
    python _engine_job.py run MODEL STORE|-        # generates the fixed prompts once, prints RESULT json
"""

from __future__ import annotations

import json
import os
import random
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: a SIGKILL kills the whole engine


def prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts sharing a 256-token prefix, then 100-400 tokens of their own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 1000) for _ in range(256)]
    return [prefix + [rng.randrange(10, 1000) for _ in range(rng.randrange(100, 400))] for _ in range(n)]


FIXED = prompts(7, 4)


def main() -> None:
    mode, model, store = sys.argv[1], sys.argv[2], sys.argv[3]
    from kvtier.testing.engine import Engine, kv_transfer_config

    # (a new store's backend; a later engine follows the store's)
    backend = {"backend": os.environ["KVTIER_JOB_BACKEND"]} if os.environ.get("KVTIER_JOB_BACKEND") else {}
    ktc = None if store == "-" else kv_transfer_config(store, **backend, chunk_tokens=64, disk_bytes="8M",
                                                     commit_bytes="64K", load_async=False)
    with Engine(model, ktc, dtype="float32", block_size=32, max_model_len=1024) as engine:
        if mode == "run":
            out = engine.generate(FIXED, max_tokens=6)
            print("RESULT " + json.dumps([[r.tokens, r.num_cached_tokens] for r in out]), flush=True)
            return
        seed = int(sys.argv[4])
        engine.generate(FIXED[:1], max_tokens=1)
        print("READY", flush=True)
        i = 0
        while True:  # new prompts (saves, evictions under the small budget) and repeats (loads)
            batch = prompts(seed * 1000 + i, 2) + [FIXED[i % len(FIXED)]]
            engine.generate(batch, max_tokens=2)
            # else the repeats hit vLLM's own prefix cache: no load, so no use the store's LRU
            # sees, and the fixed prompts would be evicted under the budget
            engine.llm.reset_prefix_cache()
            i += 1


if __name__ == "__main__":
    main()
