"""A server restarted on a cold page cache: time to first token of a cached long prompt, with
and without the connector's ``prefetch_bytes`` (side by side, one run).

A model with a KV heavy enough for the disk to matter (8 layers, 8 KV heads of 128: 32 KiB
per token) serves a ``--tokens``-token prompt once to fill the store. Then, for each setting,
the page cache is dropped (as after a reboot), a fresh engine starts, and — once its start-up
prefetch (if any) has finished, as when traffic arrives a little after start — the same
prompt is sent. Needs root for drop_caches.

    .venv/bin/python benchmarks/prefetch_engine_bench.py [--tokens 8192]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    from bench_common import drop_caches

    from kvtier.testing.engine import Engine, kv_transfer_config
    from kvtier.testing.tiny_model import make_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="kvtier-prefetch-engine-"))
    model = make_tiny_llama(work / "model", layers=8, hidden=1024, heads=8, kv_heads=8, vocab=2048,
                            max_len=args.tokens + 64, std=0.05)
    prompt = [random.Random(0).randrange(3, 2000) for _ in range(args.tokens)]
    opts = {"max_model_len": args.tokens + 64, "kv_cache_memory_bytes": 1 << 30, "enable_prefix_caching": False}
    store = work / "store"
    base = {"host_bytes": "2G"}
    with Engine(model, kv_transfer_config(store, **base), **opts) as e:
        e.generate([prompt], max_tokens=1)
        e.worker_connector._store.flush()
    kv_bytes = args.tokens * 8 * 2 * 8 * 128 * 2
    rows = []
    for label, extra in (("no prefetch", {}), ("prefetch_bytes=1G", {"prefetch_bytes": "1G"})):
        cold = drop_caches()
        t0 = time.perf_counter()
        with Engine(model, kv_transfer_config(store, **base, **extra), **opts) as e:
            started = time.perf_counter() - t0
            pf = 0.0
            if e.worker_connector.prefetch is not None:
                t1 = time.perf_counter()
                e.worker_connector.prefetch.result()
                pf = time.perf_counter() - t1
            r, ttft = e.timed_generate(prompt, max_tokens=1)
            stats = e.worker_connector._store.counters.snapshot()
        rows.append((label, cold, started, pf, ttft, r.num_cached_tokens, stats["hits_host"], stats["hits_disk"]))
    print(f"{args.tokens}-token prompt, {kv_bytes / 2**20:.0f} MiB of KV, page cache dropped before each start")
    print("| setting | engine start | prefetch (background, after start) | TTFT of the cached prompt | cached tokens | chunk loads from host / disk (incl. prefetch) |")
    print("|---|---|---|---|---|---|")
    for label, cold, started, pf, ttft, cached, hh, hd in rows:
        tag = "" if cold else " (WARM)"
        print(f"| {label}{tag} | {started:.2f} s | {pf:.2f} s | {ttft:.3f} s | {cached} | {hh} / {hd} |")


if __name__ == "__main__":
    main()
