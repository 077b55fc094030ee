"""A writer process for the concurrency tests: saves prompts into a store until told to stop.

Usage: ``python cli_writer.py STORE BACKEND STOPFILE``. Prints ``ready`` once the store is
open and the first save is committed, then, when ``STOPFILE`` appears, one JSON line: how
many chunks it committed, its store counters and the slowest save+flush it saw.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from clihelpers import CHUNK, NS_QWEN  # noqa: E402

from kvtier import CacheConfig, KVCache  # noqa: E402


def main() -> None:
    path, backend, stop = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    cfg = CacheConfig(path=path, backend=backend, chunk_tokens=CHUNK, disk_bytes="1G")
    rng = np.random.default_rng(int(time.time_ns() % 2**32))
    layers, two, heads, dim = NS_QWEN.kv_shape
    chunks = 0
    slowest = 0.0
    with KVCache.open(path, NS_QWEN, cfg) as cache:
        i = 0
        while not stop.exists():
            toks = rng.integers(0, 32000, 3 * CHUNK)
            t0 = time.monotonic()
            cache.save(toks, torch.randn(layers, two, len(toks), heads, dim).to(torch.float16))
            assert cache.flush(30)
            slowest = max(slowest, time.monotonic() - t0)
            chunks += len(cache.chunks(toks))
            if i == 0:
                print("ready", flush=True)
            i += 1
            time.sleep(0.1)
        stats = cache.stats()
    print(json.dumps({"chunks": chunks, "saves": i, "slowest_save_s": round(slowest, 3), "stats": stats}),
          flush=True)


if __name__ == "__main__":
    main()
