#!/usr/bin/env python
"""The shared index at scale, and one budget across writer processes, in one run.

    .venv/bin/python benchmarks/index_bench.py                 # ~3 minutes, prints markdown
    .venv/bin/python benchmarks/index_bench.py --stored 1000 100000 1000000 10000000

1. Lookup: a 128k-token prompt is 512 chunk keys. For each store size, the index is filled
   with that many entries in 512-chunk chains (index only: lookups never read payloads),
   the page cache is dropped (``echo 3 > /proc/sys/vm/drop_caches``, needs root; else the
   line says WARM), and a new process opens the index (which includes the page check of
   ``backends/lmdb_check.py``: a helper process reads the whole index, so the pages a lookup
   needs are then in the page cache) and times its *first* lookup of a stored prompt in chain
   order (``present_chain``, what the scheduler does: cold, after a restart), then the same
   keys looked up one by one by key (``present_prefix``: the random-access path), then the
   median of repeated chain lookups (warm). The SHA-256 chain over the prompt's tokens
   (``kvtier.keys``), computed once when a request arrives, is timed beside it.
2. Tail lookups: a prompt whose full chunks are stored and whose trailing partial chunk is
   not, looked up at block sizes 16 and 64 (every tail length, 16 tokens apart, is tried in
   one index read), beside the same prompt cut at its last chunk boundary; and vLLM's
   scheduler asking again about a waiting request (its tail candidates are kept).
3. Budget: four writer processes (two servers x two tensor-parallel ranks) save into one
   ``files`` store with a small ``disk_bytes`` while a sampler reads what the index
   publishes and what the record files take on disk; reports the highest of each as a
   ratio to the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

KEYS_PER_PROMPT = 512  # 131072 tokens / 256 tokens per chunk


def _key(i: int) -> bytes:
    import hashlib

    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def build(path: str, stored: int) -> dict[str, Any]:
    """Fill a store's index with ``stored`` entries (one 512-chunk chain first)."""
    from kvtier.backends.index import NO_KEY, EntryInfo, StoreIndex

    index = StoreIndex(Path(path))
    t0 = time.perf_counter()
    batch = 20_000
    now = time.time_ns()
    for lo in range(0, stored, batch):
        entries = []
        for i in range(lo, min(stored, lo + batch)):
            k = _key(i)
            parent = _key(i - 1) if i % KEYS_PER_PROMPT else NO_KEY
            # chains of 512 chunks: chunk i of chain c has head = chain c's first key
            head = _key(i - i % KEYS_PER_PROMPT)
            entries.append(EntryInfo(k, 32 << 20, now + i, bytes(16), occupied=32 << 20, location=i,
                                     group=k, parent=parent, token_start=(i % KEYS_PER_PROMPT) * 256,
                                     num_tokens=256, head=head))
        index.publish(entries, None, 0.9)
    seconds = time.perf_counter() - t0
    size = index.index_bytes()
    index.close()
    return {"seconds": seconds, "index_bytes": size}


def measure(path: str, runs: int, stored: int) -> dict[str, Any]:
    """In a fresh process: the first lookup of 512 present keys, then warm lookups."""
    t0 = time.perf_counter()
    from kvtier.backends.index import StoreIndex

    index = StoreIndex(Path(path), readonly=True)
    opened = time.perf_counter() - t0
    # the middle chain of the store, as the scheduler looks a prompt up (chain order)
    base = (stored // KEYS_PER_PROMPT // 2) * KEYS_PER_PROMPT
    spans = [(i * 256, _key(base + i)) for i in range(KEYS_PER_PROMPT)]
    t1 = time.perf_counter()
    n = index.present_chain(spans[0][1], spans)
    first = time.perf_counter() - t1
    if n != KEYS_PER_PROMPT:
        raise RuntimeError(f"lookup found {n} of {KEYS_PER_PROMPT}")
    keys = [k for _, k in spans]
    t2 = time.perf_counter()
    index.present_prefix(keys)  # by key alone: the pages are warm now, except leaf pages of 'entries'
    by_key = time.perf_counter() - t2
    warm = []
    for _ in range(runs):
        t = time.perf_counter()
        index.present_chain(spans[0][1], spans)
        warm.append(time.perf_counter() - t)
    index.close()
    return {"open_s": opened, "first_s": first, "by_key_s": by_key, "warm_median_s": statistics.median(warm)}


def chain_hash(runs: int) -> float:
    """Median seconds to derive a 128k-token prompt's 512 chunk keys."""
    import numpy as np

    from kvtier.keys import chunk_keys

    toks = np.arange(KEYS_PER_PROMPT * 256, dtype=np.int64) % 32000
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        chunk_keys(toks, b"\0" * 32, 256, None)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def tail_lookups(runs: int) -> dict[str, float]:
    """Median seconds of ``KVCache.lookup`` of a 4,095-token prompt whose 15 full chunks are
    stored and whose tail is not (a miss after the full chunks: every tail length is tried),
    by block size, beside the same prompt cut at its last chunk boundary (no tail to try)."""
    import numpy as np
    import torch

    from kvtier import CacheConfig, KVCache, Namespace

    ns = Namespace(model="bench", weights_fingerprint="bench", dtype="bfloat16", kv_shape=(2, 2, 2, 16),
                   chunk_tokens=256)
    toks = np.random.default_rng(0).integers(0, 32000, 4095).astype(np.uint32)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        cfg = CacheConfig(path=Path(d), chunk_tokens=256, backend="files")
        with KVCache.open(d, ns, cfg) as cache:
            cache.save(toks[:3840], torch.zeros(2, 2, 3840, 2, 16, dtype=torch.bfloat16))
            cache.flush()
        for name, granularity, prompt in (("no tail", 16, toks[:3840]), ("block 16", 16, toks),
                                          ("block 64", 64, toks)):
            with KVCache.open(d, ns, cfg, tail_granularity=granularity, readonly=True) as cache:
                if cache.lookup(prompt) != 3840:
                    raise RuntimeError("the stored chunks were not found")
                times = []
                for _ in range(runs):
                    t = time.perf_counter()
                    cache.lookup(prompt)
                    times.append(time.perf_counter() - t)
                out[name] = statistics.median(times)
    return out


def waiting_lookup(runs: int) -> float:
    """Median seconds of vLLM's scheduler asking again about a waiting request
    (``SchedulerSide.get_num_new_matched_tokens``): a 6,096-token prompt in 2048-token chunks,
    two tensor-parallel ranks, its full chunks stored and its tail not."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from kvtier import CacheConfig, ChunkStore, Namespace
    from kvtier.keys import as_token_array, chain_seed, chunk_keys
    from kvtier.store_view import StoreView
    from kvtier.vllm.identity import LoraFingerprints
    from kvtier.vllm.scheduler_side import SchedulerSide

    nss = [Namespace(model="bench", weights_fingerprint="bench", dtype="bfloat16", kv_shape=(2, 2, 1, 16),
                     chunk_tokens=2048, tp_rank=r, tp_size=2) for r in range(2)]
    prompt = np.random.default_rng(0).integers(0, 30000, 2 * 2048 + 2000).tolist()
    with tempfile.TemporaryDirectory() as d, ChunkStore(CacheConfig(path=Path(d), chunk_tokens=2048,
                                                                    host_bytes=0)) as store:
        for ns in nss:
            for ref in chunk_keys(as_token_array(prompt), chain_seed(ns), 2048, None):
                store.put(ref.key, torch.zeros(2, 2, 2048, 1, 16, dtype=torch.bfloat16), namespace_id=ns.id,
                          token_start=ref.start, num_tokens=2048)
        store.flush()
        view = StoreView(store.config)
        side = SchedulerSide(view, nss, 16, LoraFingerprints(None), can_load=True, can_save=True, save_partial=True)
        req = SimpleNamespace(request_id="r", prompt_token_ids=prompt, cache_salt=None, lora_request=None,
                              mm_features=[], prompt_embeds=None)
        side.get_num_new_matched_tokens(req, 0)
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            side.get_num_new_matched_tokens(req, 0)
            times.append(time.perf_counter() - t)
        view.close()
    return statistics.median(times)


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def writer(path: str, server: int, rank: int, prompts: int, budget: int, batch: int) -> dict[str, Any]:
    import torch

    from kvtier import CacheConfig, ChunkStore, Namespace
    from kvtier.keys import chain_seed, ranked_chunk_keys

    torch.set_num_threads(1)
    shape = (4, 2, 8, 64)  # 4 layers, 8 KV heads, head_dim 64: 1 MiB per 256-token bf16 chunk
    nss = [Namespace(model="bench", weights_fingerprint="bench", dtype="bfloat16", kv_shape=shape,
                     chunk_tokens=256, tp_rank=r, tp_size=2) for r in (0, 1)]
    seeds = [chain_seed(ns) for ns in nss]
    cfg = CacheConfig(path=Path(path), backend="files", disk_bytes=budget, commit_bytes=batch,
                      host_bytes=0, chunk_tokens=256)
    kv = torch.zeros(4, 2, 256, 8, 64, dtype=torch.bfloat16)
    with ChunkStore(cfg) as store:
        for p in range(prompts):
            toks = (torch.arange(4 * 256) + 7919 * (1000 * server + p)).numpy() % 32000
            chunks = ranked_chunk_keys(toks, seeds, 256, None)
            for i, c in enumerate(chunks):
                while not store.put(c.keys[rank], kv.clone(), namespace_id=nss[rank].id, token_start=c.start,
                                    num_tokens=256, group=c.keys[0],
                                    parent=chunks[i - 1].keys[rank] if i else None):
                    time.sleep(0.01)  # queue full: wait rather than drop (a benchmark)
        store.flush()
        return store.stats()


def budget_run(work: Path, budget: int, batch: int, prompts: int) -> dict[str, Any]:
    store = work / "budget"
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", "writer", "--params", json.dumps(
        {"path": str(store), "server": s, "rank": r, "prompts": prompts, "budget": budget, "batch": batch})],
        stdout=subprocess.PIPE) for s in (1, 2) for r in (0, 1)]
    published, on_disk = [0], [0]
    stop = threading.Event()

    def sample() -> None:
        from kvtier.backends.index import StoreIndex

        index = None
        while not stop.is_set():
            if index is None and (store / "index").exists():
                try:
                    index = StoreIndex(store, readonly=True)
                except Exception:
                    index = None
            if index is not None:
                published[0] = max(published[0], index.totals().occupied)
            files = 0
            # (os.walk passes over a directory removed meanwhile; rglob raised)
            for root, _, names in os.walk(store / "files"):
                for name in names:
                    if name.endswith(".kvt"):
                        try:
                            files += os.stat(os.path.join(root, name)).st_size
                        except FileNotFoundError:  # evicted meanwhile
                            continue
            on_disk[0] = max(on_disk[0], files)
            time.sleep(0.005)
        if index is not None:
            index.close()

    t = threading.Thread(target=sample)
    t.start()
    stats = [json.loads(p.communicate()[0].decode().strip().splitlines()[-1]) for p in procs]
    stop.set()
    t.join()
    return {"budget": budget, "commit_bytes": batch, "max_published": published[0],
            "max_on_disk": on_disk[0], "evicted": sum(s["evicted_disk"] for s in stats),
            "committed": sum(s["saves_committed"] for s in stats)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stored", type=int, nargs="+", default=[1000, 100_000, 1_000_000])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--dir", help="work directory (default: a new temp dir, removed after)")
    ap.add_argument("--budget-mib", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=40, help="prompts per writer (4 chunks each)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        fn = {"build": build, "measure": measure, "writer": writer}[args.worker]
        print(json.dumps(fn(**json.loads(args.params))))
        return

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)

        def run(name: str, **params: Any) -> dict[str, Any]:
            out = subprocess.run([sys.executable, __file__, "--worker", name, "--params", json.dumps(params)],
                                 check=True, capture_output=True, text=True)
            return json.loads(out.stdout.strip().splitlines()[-1])

        print("| chunks stored | index size | open after restart (with the page check) | first lookup after "
              "restart (512 chunks) | then the same keys one by one (by key) | warm lookup (median) |")
        print("|---:|---:|---:|---:|---:|---:|")
        rows = []
        for n in args.stored:
            path = work / f"idx-{n}"
            path.mkdir()
            b = run("build", path=str(path), stored=n)
            cold = drop_caches()
            m = run("measure", path=str(path), runs=args.runs, stored=n)
            rows.append({"stored": n, **b, **m, "cold": cold})
            print(f"| {n:,} | {b['index_bytes'] / 2**20:.0f} MiB | {m['open_s']:.2f} s | {m['first_s'] * 1e3:.2f} ms"
                  f"{'' if cold else ' (WARM)'} | {m['by_key_s'] * 1e3:.2f} ms | {m['warm_median_s'] * 1e3:.3f} ms |",
                  flush=True)
        print(f"\nSHA-256 chain for a 128k-token prompt (512 keys): {chain_hash(20) * 1e3:.2f} ms (median)\n")
        t = tail_lookups(max(args.runs, 100))
        print("| lookup of a 4,095-token prompt, tail not stored (`KVCache.lookup`, median) | no tail to try "
              "(3,840 tokens) | block size 16 | block size 64 |")
        print("|---|---:|---:|---:|")
        print(f"| 15 full chunks, then 15 tail lengths in one read | {t['no tail'] * 1e3:.3f} ms | "
              f"{t['block 16'] * 1e3:.3f} ms ({t['block 16'] / t['no tail']:.2f}x) | "
              f"{t['block 64'] * 1e3:.3f} ms ({t['block 64'] / t['no tail']:.2f}x) |")
        print(f"\nvLLM's scheduler asking again about a waiting 6,096-token request (2048-token chunks, 2 ranks, "
              f"tail not stored): {waiting_lookup(50) * 1e3:.3f} ms (median)\n")
        r = budget_run(work, args.budget_mib << 20, 8 << 20, args.prompts)
        print("| writers | disk_bytes | commit_bytes | max published / budget | max record files on disk / budget "
              "| chunks committed | evicted |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        print(f"| 4 | {r['budget'] >> 20} MiB | {r['commit_bytes'] >> 20} MiB | "
              f"{r['max_published'] / r['budget']:.3f} | {r['max_on_disk'] / r['budget']:.3f} | "
              f"{r['committed']} | {r['evicted']} |")


if __name__ == "__main__":
    main()
