"""Cold start to first hit, with and without ``kvtier prefetch`` (side by side, one run).

A store holds ``--gib`` of KV for ``--prompts`` long prompts (Llama-3-8B geometry per rank,
bf16, 256-token chunks). For each backend, with the page cache dropped (as after a reboot):

* **cold**: a fresh process opens the store and loads the most recently used prompt;
* **prefetched**: ``kvtier prefetch STORE --max-bytes`` the hot set first (timed), then the
  same fresh-process load; for the files backend also with ``--reader dali`` (NVIDIA DALI's
  file reader, if the ``dali`` extra is installed).

Needs root for ``/proc/sys/vm/drop_caches``; without it the rows say WARM.

    .venv/bin/python benchmarks/prefetch_bench.py [--gib 2] [--prompts 8] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import GIB, drop_caches, fill_kv

from kvtier import CacheConfig, KVCache, Namespace
from kvtier.dali_reader import dali_available

LAYERS, HEADS, DIM, CHUNK = 32, 8, 128, 256
NS = Namespace(model="bench-llama-3-8b", weights_fingerprint="bench", dtype="bfloat16",
               kv_shape=(LAYERS, 2, HEADS, DIM), chunk_tokens=CHUNK)
LOAD = """
import sys, time, json
t0 = time.perf_counter()
from kvtier import CacheConfig, KVCache, Namespace
from kvtier.dali_reader import dali_available
ns = Namespace(**json.loads(sys.argv[2]))
with KVCache.open(sys.argv[1], ns, CacheConfig(path=sys.argv[1], backend=sys.argv[3], host_bytes=0), readonly=True) as c:
    toks = json.loads(sys.argv[4])
    t1 = time.perf_counter()
    kv = c.load(toks)
    t2 = time.perf_counter()
print(json.dumps({"open_s": t1 - t0, "load_s": t2 - t1, "tokens": kv.shape[2]}))
"""

HOST_PREFETCH = """
import sys, time, json
from kvtier import CacheConfig
from kvtier.store import ChunkStore
ns_id, reader, nbytes = bytes.fromhex(sys.argv[2]), sys.argv[3], int(sys.argv[4])
with ChunkStore(CacheConfig(path=sys.argv[1], backend="files", host_bytes=nbytes + (64 << 20)), readonly=True) as st:  # noqa: E501
    t0 = time.perf_counter()
    n = st.prefetch_recent(ns_id, nbytes, reader).result()
    print(json.dumps({"chunks": n, "seconds": time.perf_counter() - t0}))
"""


def host_prefetch(root: Path, reader: str, nbytes: int) -> dict[str, float]:
    """The connector's start-up prefetch (into the host tier), in a fresh process."""
    out = subprocess.run([sys.executable, "-c", HOST_PREFETCH, str(root), NS.id.hex(), reader, str(nbytes)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def build(root: Path, backend: str, gib: float, prompts: int) -> list[list[int]]:
    chunk_bytes = LAYERS * 2 * CHUNK * HEADS * DIM * 2
    per_prompt = max(1, int(gib * GIB / chunk_bytes / prompts)) * CHUNK
    seqs = [[(p * 7919 + i) % 120_000 + 1 for i in range(per_prompt)] for p in range(prompts)]
    # the write queue holds a whole prompt: KVCache.save drops what does not fit (write-behind)
    cfg = CacheConfig(path=root, backend=backend, disk_bytes=int(4 * gib * GIB), host_bytes=0,
                      write_queue_bytes=per_prompt // CHUNK * chunk_bytes + (64 << 20))
    with KVCache.open(root, NS, cfg) as cache:
        for p, toks in enumerate(seqs):  # written in order: the last prompt is the most recent
            kv = fill_kv(torch.empty(LAYERS, 2, len(toks), HEADS, DIM, dtype=torch.bfloat16), seed=p)
            cache.save(toks, kv)
            cache.flush()
        stats = cache.stats()
        assert stats["dropped_saves"] == stats["evicted_disk"] == 0, f"the store build lost chunks: {stats}"
    return seqs


def load(root: Path, backend: str, toks: list[int]) -> dict[str, float]:
    ns = {k: (list(v) if isinstance(v, tuple) else v) for k, v in NS.describe().items()}
    ns["kv_shape"] = tuple(ns["kv_shape"])
    ns["extra"] = ()
    out = subprocess.run([sys.executable, "-c", LOAD, str(root), json.dumps(ns), backend, json.dumps(toks)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="kvtier-prefetch-"))
    try:
        kvtier = Path(sys.executable).parent / "kvtier"
        rows = []
        for backend in ("lmdb", "files"):
            root = base / backend
            seqs = build(root, backend, args.gib, args.prompts)
            hot = seqs[-1]
            hot_bytes = len(hot) * LAYERS * 2 * HEADS * DIM * 2
            cold_ok = drop_caches()
            cold = load(root, backend, hot)
            readers = ["default"] + (["dali"] if backend == "files" and dali_available() else [])
            for reader in readers:
                drop_caches()
                t0 = time.perf_counter()
                subprocess.run([str(kvtier), "prefetch", str(root), "--max-bytes", str(int(hot_bytes * 1.05)),
                                "--json", "--reader", reader], check=True, capture_output=True)
                prefetch_s = time.perf_counter() - t0
                warm = load(root, backend, hot)
                name = backend if reader == "default" else f"{backend}, DALI reader"
                rows.append((name, hot_bytes, cold_ok, cold, prefetch_s, warm))
        host_rows = []
        if dali_available():
            root, nbytes = base / "files", rows[0][1]
            for reader in ("default", "dali"):
                drop_caches()
                host_rows.append((reader, nbytes, host_prefetch(root, reader, int(nbytes * 1.05))))
    finally:
        if not args.dir:  # gigabytes of test data: never leave them behind
            shutil.rmtree(base, ignore_errors=True)
    print(f"store: {args.gib} GiB in {args.prompts} prompts per backend; first hit = the most recent "
          f"prompt ({rows[0][1] / GIB:.2f} GiB), loaded by a fresh process")
    print("| backend | first load, cold | kvtier prefetch | first load after prefetch | speed-up of the load |")
    print("|---|---|---|---|---|")
    for backend, nbytes, cold_ok, cold, prefetch_s, warm in rows:
        tag = "" if cold_ok else " (WARM: no root)"
        print(f"| {backend} | {cold['load_s']:.3f} s ({nbytes / GIB / cold['load_s']:.2f} GiB/s){tag} "
              f"| {prefetch_s:.3f} s | {warm['load_s']:.3f} s ({nbytes / GIB / warm['load_s']:.2f} GiB/s) "
              f"| {cold['load_s'] / warm['load_s']:.1f}x |")
    if host_rows:
        print("\nthe connector's start-up prefetch into the host tier (files backend, cold page cache, "
              "a fresh process, records verified):")
        print("| reader | chunks | seconds | GiB/s |")
        print("|---|---|---|---|")
        for reader, nbytes, r in host_rows:
            print(f"| {reader} | {r['chunks']} | {r['seconds']:.3f} | {nbytes / GIB / r['seconds']:.2f} |")


if __name__ == "__main__":
    main()
