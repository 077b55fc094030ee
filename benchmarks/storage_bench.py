#!/usr/bin/env python
"""Storage benchmark: kvtier vs the raw disk vs LMCache's local disk backend, in one run.

    .venv/bin/python benchmarks/storage_bench.py            # ~4-5 minutes, prints markdown

Everything is measured side by side in one run, in one directory on one disk, and every
result is reported as a ratio to the raw disk and to LMCache:

1. raw disk: sequential write of the same bytes (buffered + one fsync at the end, and
   O_DIRECT), and cold sequential read (buffered and O_DIRECT) with one stream and with
   ``--io-threads`` streams;
2. kvtier store: ``KVCache.save`` + ``flush`` for both backends, durability ``process``
   and ``power`` (and zstd as an extra line); "durable" adds ``os.sync()`` where the
   durability mode does not sync by itself;
3. kvtier cold load in a *new process*, files evicted from the page cache: ``KVCache.load``,
   and ``ChunkStore.get`` into preallocated buffers, sequential and on ``--io-threads``;
4. lookup latency on a 128k-token prompt (``KVCache.lookup``: SHA-256 chain + index), after
   a restart, with 1k and 100k chunks in the store (files backend: at most 20k);
5. LMCache 0.5.6 (``benchmarks/lmcache_worker.py`` under ``.venv-lmcache``, installed by
   ``benchmarks/setup_lmcache.sh``): store, cold load and ``engine.lookup`` on the same data.

Each measurement runs in its own subprocess (``--worker``); the parent never imports kvtier.
Cold means the files were written back and evicted from the page cache first
(``posix_fadvise(DONTNEED)``, checked with ``fincore``; the lookup test drops every cache
with ``echo 3 > /proc/sys/vm/drop_caches``); if that fails the table says "WARM".
GiB/s = 2**30 bytes per second.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_common import (  # noqa: E402
    GIB,
    MIB,
    RESULT_PREFIX,
    dir_bytes,
    drop_caches,
    emit,
    evict,
    fill_flat,
    fill_kv,
    time_calls,
    tokens_for,
)

LMCACHE_PY = Path(os.environ.get("LMCACHE_VENV", ROOT / ".venv-lmcache")) / "bin" / "python"
Params = dict[str, Any]
Result = dict[str, Any]


# ----------------------------------------------------------------------------------------
# workers (each runs in a fresh process)
# ----------------------------------------------------------------------------------------
def _aligned_buffer(size: int, fill_seed: int | None = None) -> mmap.mmap:
    """A page-aligned buffer (O_DIRECT needs alignment), optionally filled with data."""
    buf = mmap.mmap(-1, size)
    if fill_seed is not None:
        import torch

        t = torch.frombuffer(buf, dtype=torch.bfloat16)
        fill_flat(t, fill_seed)
        del t
    return buf


def _raw_write(path: Path, total: int, buf: mmap.mmap, direct: bool) -> float:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o600)
    try:
        written = 0
        while written < total:
            n = os.write(fd, buf)
            if n != len(buf):
                raise OSError(f"short write: {n} of {len(buf)}")
            written += n
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _raw_read(path: Path, block: int, threads: int, direct: bool) -> float:
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    total = path.stat().st_size
    per = total // threads // block * block
    got = [0] * threads

    def reader(i: int) -> None:
        buf = _aligned_buffer(block)
        fd = os.open(path, flags)
        try:
            off, end = i * per, (i + 1) * per if i < threads - 1 else total
            while off < end:
                n = os.preadv(fd, [buf], off)
                if n <= 0:
                    break
                off += n
                got[i] += n
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=reader, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    if sum(got) != total:
        raise RuntimeError(f"read {sum(got)} of {total} bytes")
    return dt


def w_raw(p: Params) -> Result:
    """Raw sequential writes and cold reads of the same bytes, in the benchmark directory."""
    work, total, block = Path(p["dir"]), p["bytes"], p["block"]
    buf = _aligned_buffer(block, fill_seed=p["seed"])
    res: Result = {}
    f1, f2 = work / "raw-buffered.bin", work / "raw-direct.bin"
    evict(work)
    res["write_buffered"] = {"bytes": total, "s": _raw_write(f1, total, buf, direct=False)}
    f1.unlink()
    evict(work)
    res["write_direct"] = {"bytes": total, "s": _raw_write(f2, total, buf, direct=True)}
    for direct in (False, True):
        for threads in sorted({1, p["threads"]}):
            cold = evict(f2)
            dt = _raw_read(f2, block, threads, direct)
            res[f"read_{'direct' if direct else 'buffered'}_{threads}"] = {"bytes": total, "s": dt, "cold": cold}
    f2.unlink()
    return res


def _namespace(p: Params) -> Any:
    from kvtier import Namespace

    return Namespace(model="bench-llama-8b-like", weights_fingerprint="bench", dtype="bfloat16",
                     kv_shape=(p["layers"], 2, p["kv_heads"], p["head_dim"]),
                     chunk_tokens=p["chunk_tokens"])


def _config(p: Params, **kw: Any) -> Any:
    from kvtier import CacheConfig

    if p.get("commit_bytes"):  # --commit-mib (the tests' workers leave it at the default)
        kw.setdefault("commit_bytes", p["commit_bytes"])
    return CacheConfig(path=Path(p["dir"]), backend=p["backend"], chunk_tokens=p["chunk_tokens"],
                       io_threads=p["io_threads"], **kw)


def _source(p: Params) -> tuple[Any, Any]:
    import numpy as np
    import torch

    n_tok = p["n_chunks"] * p["chunk_tokens"]
    kv = torch.empty(p["layers"], 2, n_tok, p["kv_heads"], p["head_dim"], dtype=torch.bfloat16)
    fill_kv(kv, p["seed"], p["chunk_tokens"])
    return np.asarray(tokens_for(n_tok, p["seed"]), dtype=np.uint32), kv


def w_kv_store(p: Params) -> Result:
    from kvtier import KVCache

    if p.get("one_txn"):  # the A/B baseline of LMDB's 16 MiB transactions: one per batch
        from kvtier.backends.lmdb import LmdbPayloads

        LmdbPayloads.txn_bytes = 1 << 62
    if p.get("serial"):  # the A/B baseline of the writer pipeline: a batch is prepared only
        from kvtier.store import ChunkStore  # once the one before it is written

        can_take = ChunkStore._can_take
        ChunkStore._can_take = lambda self: can_take(self) and not self._committing  # type: ignore[method-assign]
    if p.get("staged"):  # the A/B baseline: records assembled in a staging buffer before the write
        from kvtier import codec

        codec.record_in_place = lambda tensor, header: None
    tokens, kv = _source(p)
    total = kv.numel() * kv.element_size()
    cfg = _config(p, durability=p["durability"], compression=p["compression"],
                  write_queue_bytes=total + 64 * MIB)
    os.sync()  # no dirty pages from earlier steps
    t0 = time.perf_counter()
    cache = KVCache.open(p["dir"], _namespace(p), cfg)
    t1 = time.perf_counter()
    queued = cache.save(tokens, kv)
    t2 = time.perf_counter()
    drained = cache.flush()
    t3 = time.perf_counter()
    if p["durability"] != "power":
        os.sync()
    t4 = time.perf_counter()
    stats = cache.stats()
    cache.close()
    res: Result = {"bytes": total, "open_s": t1 - t0, "save_s": t2 - t1, "flush_s": t3 - t2,
                   "sync_s": t4 - t3, "store_s": t3 - t1, "durable_s": t4 - t1,
                   "disk_bytes": dir_bytes(Path(p["dir"])), "stats": stats}
    if queued != len(tokens) or not drained or stats["saves_committed"] != p["n_chunks"]:
        res["failed"] = (f"{stats['saves_committed']} of {p['n_chunks']} chunks stored "
                         f"(dropped_saves={stats['dropped_saves']}, io_errors={stats['io_errors']})")
    return res


def w_kv_load(p: Params) -> Result:
    """Cold loads from a stored cache, one mode after another in this fresh process.

    Before each mode the store's files are written back and evicted from the page cache and
    the store is opened anew (empty host tier), so every mode reads from the disk."""
    import torch

    from kvtier import KVCache

    tokens, kv = _source(p)
    total = kv.numel() * kv.element_size()
    del kv  # regenerated for the check afterwards
    ct = p["chunk_tokens"]
    results: Result = {}
    from kvtier import codec

    # Untimed, first, one whole load: whichever mode came first measured 1.1-1.4 GiB/s where
    # the same mode run second measured 1.7-2.3 (the kernel finding memory for the first
    # GiB of page cache and result, it seems)
    with KVCache.open(p["dir"], _namespace(p), _config(p)) as cache:
        cache.load(tokens)
    runs = codec._contiguous_runs
    for mode in p["modes"]:
        # "load_staged", the A/B baseline of "load": each record read whole into a staging
        # buffer, verified, then copied into its slice of the result
        codec._contiguous_runs = (lambda t: None) if mode == "load_staged" else runs
        bufs: list[torch.Tensor] = []
        if mode.startswith("get_"):
            shape = (p["layers"], 2, ct, p["kv_heads"], p["head_dim"])
            bufs = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(p["n_chunks"])]
        cold = evict(p["dir"])
        t0 = time.perf_counter()
        host = {"host_bytes": total + (64 << 20), "direct_reads": mode == "host_tier_direct"} \
            if mode.startswith("host_tier") else {}
        cache = KVCache.open(p["dir"], _namespace(p), _config(p, **host))
        if host:  # a serving process's pool is warm: its slots exist and were touched before
            shape = (p["layers"], 2, ct, p["kv_heads"], p["head_dim"])
            warm = [cache.store.pool.acquire(shape, torch.bfloat16) for _ in range(p["n_chunks"])]
            del warm
            t0 = time.perf_counter()
        t1 = time.perf_counter()
        if mode in ("load", "load_staged"):
            out = cache.load(tokens)
        elif mode.startswith("host_tier"):  # the connector's path: into the host tier's pooled buffers
            loaded = list(cache.store.load_many([c.key for c in cache.chunks(tokens)]))
            if any(x.tensor is None for x in loaded):
                raise RuntimeError(f"{sum(x.tensor is None for x in loaded)} chunks missing")
        else:
            keys = [c.key for c in cache.chunks(tokens)]
            if mode == "get_into":
                got = [cache.store.get(k, out=b) for k, b in zip(keys, bufs, strict=True)]
            else:  # get_parallel: one get_async per I/O thread, adjacent chunks on different threads
                nt = p["io_threads"]
                futs = [cache.store.get_async(keys[i::nt], bufs[i::nt]) for i in range(nt)]
                parts = [f.result() for f in futs]
                got = [parts[i % nt][i // nt] for i in range(len(keys))]
            if any(g is None for g in got):
                raise RuntimeError(f"{sum(g is None for g in got)} chunks missing")
        t2 = time.perf_counter()
        stats = cache.stats()
        if mode.startswith("host_tier"):  # (untimed: the check needs one tensor)
            out = torch.cat([x.tensor for x in loaded], dim=2)
            del loaded
        cache.close()
        if bufs:
            out = torch.cat(bufs, dim=2)
        del bufs
        _, ref = _source(p)
        ok = tuple(out.shape) == tuple(ref.shape) and torch.equal(out.view(torch.int16), ref.view(torch.int16))
        del out, ref
        results[mode] = {"bytes": total, "open_s": t1 - t0, "load_s": t2 - t1, "cold": cold,
                         "verified": ok, "stats": stats}
    return results


_LOOKUP_SHAPE = (1, 2, 1, 8)  # tiny chunks (8 KiB): a lookup never reads KV


def _lookup_cache(p: Params, **kw: Any) -> Any:
    from kvtier import CacheConfig, KVCache, Namespace

    ns = Namespace(model="bench-lookup", weights_fingerprint="bench", dtype="bfloat16",
                   kv_shape=_LOOKUP_SHAPE, chunk_tokens=256)
    cfg = CacheConfig(path=Path(p["dir"]), backend=p["backend"], chunk_tokens=256, **kw)
    return KVCache.open(p["dir"], ns, cfg)


def _prompts(p: Params) -> tuple[Any, Any, Any]:
    import numpy as np

    n = p["prompt_tokens"]
    hit = np.asarray(tokens_for(n, p["seed"]), dtype=np.uint32)
    miss = np.asarray(tokens_for(n, p["seed"] + 1), dtype=np.uint32)
    half = np.concatenate([hit[: n // 2], miss[n // 2 :]])
    return hit, half, miss


def w_lookup_build(p: Params) -> Result:
    import torch

    hit, _, _ = _prompts(p)
    cache = _lookup_cache(p, durability="process", write_queue_bytes="4G", host_bytes="2G")
    t0 = time.perf_counter()
    kv = torch.zeros(_LOOKUP_SHAPE[0], 2, len(hit), *_LOOKUP_SHAPE[2:], dtype=torch.bfloat16)
    cache.save(hit, kv)
    n_prompt = len(hit) // 256
    filler = torch.zeros(_LOOKUP_SHAPE[0], 2, 256, *_LOOKUP_SHAPE[2:], dtype=torch.bfloat16)
    ns_id = cache.namespace.id
    n_fill = max(0, p["stored_chunks"] - n_prompt)
    for i in range(n_fill):  # other prompts' chunks: distinct keys (the shared tensor is fine)
        key = i.to_bytes(8, "little") + os.urandom(24)
        if not cache.store.put(key, filler, namespace_id=ns_id, token_start=0, num_tokens=256):
            raise RuntimeError("filler save dropped")
    cache.flush()
    t1 = time.perf_counter()
    warm = time_calls(lambda: cache.lookup(hit), p["runs"])  # host tier holds every key
    stats = cache.stats()
    cache.close()
    os.sync()
    return {"build_s": t1 - t0, "host_tier": warm, "disk_records": stats["disk_records"]}


def w_lookup_measure(p: Params) -> Result:
    from kvtier.keys import as_token_array, chain_seed, chunk_keys

    hit, half, miss = _prompts(p)
    cold = drop_caches()
    t0 = time.perf_counter()
    cache = _lookup_cache(p)
    t_open = time.perf_counter() - t0
    t0 = time.perf_counter()
    first = cache.lookup(hit)
    t_first = time.perf_counter() - t0
    cache.stats()  # waits for the files backend's background index scan
    t_ready = time.perf_counter() - t0 + t_open
    n = len(hit)
    got = (cache.lookup(hit), cache.lookup(half), cache.lookup(miss))
    if first != n or got != (n, n // 2, 0):
        raise RuntimeError(f"lookup results {first}, {got}; expected {n}, ({n}, {n // 2}, 0)")
    arr = as_token_array(hit)
    seed = chain_seed(cache.namespace)
    keys = [c.key for c in chunk_keys(arr, seed, 256, None)]
    runs = p["runs"]
    res = {
        "cold": cold, "open_s": t_open, "first_ms": t_first * 1e3, "index_ready_s": t_ready,
        "full_hit": time_calls(lambda: cache.lookup(hit), runs),
        "half_hit": time_calls(lambda: cache.lookup(half), runs),
        "miss": time_calls(lambda: cache.lookup(miss), runs),
        "hash_only": time_calls(lambda: chunk_keys(as_token_array(hit), seed, 256, None), runs),
        "index_only": time_calls(lambda: cache.store.count_present_prefix(keys), runs),
        "disk_records": cache.stats()["disk_records"],
    }
    cache.close()
    return res


WORKERS: dict[str, Callable[[Params], Result]] = {
    "raw": w_raw, "kv_store": w_kv_store,
    "kv_load": w_kv_load, "lookup_build": w_lookup_build, "lookup_measure": w_lookup_measure,
}


# ----------------------------------------------------------------------------------------
# the parent: run workers, collect, print
# ----------------------------------------------------------------------------------------
class Runner:
    def __init__(self, verbose: bool, timeout: float) -> None:
        self.verbose = verbose
        self.timeout = timeout

    def run(self, label: str, argv: list[str]) -> Result | None:
        t0 = time.perf_counter()
        print(f"  {label} ...", end="", file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout,
                                  cwd=ROOT, check=False)
        except subprocess.TimeoutExpired:
            print(f" TIMEOUT after {self.timeout:.0f}s", file=sys.stderr)
            return None
        line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith(RESULT_PREFIX)), None)
        dt = time.perf_counter() - t0
        if proc.returncode != 0 or line is None:
            print(f" FAILED (rc={proc.returncode}, {dt:.1f}s)", file=sys.stderr)
            print(_tail(proc.stdout + proc.stderr, 25), file=sys.stderr)
            return None
        print(f" {dt:.1f}s", file=sys.stderr)
        if self.verbose:
            print(_tail(proc.stderr, 10), file=sys.stderr)
        result: Result = json.loads(line[len(RESULT_PREFIX):])
        return result

    def kvtier(self, label: str, worker: str, params: Params) -> Result | None:
        return self.run(label, [sys.executable, str(Path(__file__).resolve()), "--worker", worker,
                                "--params", json.dumps(params)])

    def lmcache(self, label: str, mode: str, params: Params) -> Result | None:
        return self.run(label, [str(LMCACHE_PY), str(HERE / "lmcache_worker.py"), mode,
                                json.dumps(params)])


def _tail(text: str, n: int) -> str:
    return "\n".join("    | " + ln for ln in text.strip().splitlines()[-n:])


def gib_s(r: Result | None, key: str) -> float | None:
    if not r or r.get("failed") or not r.get(key):
        return None
    return float(r["bytes"]) / float(r[key]) / GIB


def summary(runs: list[Result | None] | None, key: str) -> tuple[float | None, float | None, float | None]:
    """(median, min, max) GiB/s over the runs that produced ``key``."""
    vals = sorted(v for v in (gib_s(r, key) for r in runs or []) if v is not None)
    if not vals:
        return None, None, None
    return statistics.median(vals), vals[0], vals[-1]


def first_ok(runs: list[Result | None] | None) -> Result | None:
    return next((r for r in runs or [] if r and not r.get("failed")), None)


def collect(args: argparse.Namespace) -> Result:
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvtier-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    runner = Runner(args.verbose, args.timeout)
    base: Params = {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                    "chunk_tokens": args.chunk_tokens, "n_chunks": args.chunks, "seed": 7,
                    "io_threads": args.io_threads, "commit_bytes": args.commit_mib * MIB}
    chunk_bytes = args.layers * 2 * args.chunk_tokens * args.kv_heads * args.head_dim * 2
    total = chunk_bytes * args.chunks
    have_lmcache = LMCACHE_PY.exists()
    out: Result = {
        "machine": machine_info(work), "have_lmcache": have_lmcache,
        "params": {**base, "chunk_bytes": chunk_bytes, "bytes": total, "repeat": args.repeat,
                   "prompt_tokens": args.prompt_tokens},
        "raw": {}, "store": {}, "load": {}, "lmcache_store": {}, "lmcache_load": {},
        "lookup": {}, "lmcache_lookup": None, "notes": {},
    }
    print(f"[storage_bench] {work}: {args.chunks} chunks x {chunk_bytes / MIB:.0f} MiB = "
          f"{total / GIB:.2f} GiB, {args.repeat} round(s)", file=sys.stderr)
    # "staged": the same store with records copied into a staging buffer before they are
    # written (how every save was written before records were written from their pool buffers)
    # "one_txn" (lmdb only): the A/B baseline of LMDB's 16 MiB write transactions, with a
    # whole batch (up to commit_bytes) in one transaction
    # "serial": the A/B baseline of the writer pipeline, each batch prepared (encoded,
    # checksummed) only after the one before it is written
    configs = ([(dur, "none") for dur in ("process", "power")] + [("power", "staged"), ("power", "serial")]
               + [(dur, "one_txn") for dur in ("process", "power")]
               + ([("power", "zstd")] if args.zstd else []))
    try:
        for rnd in range(0 if args.skip_throughput else args.repeat):
            tag = f"#{rnd + 1}"
            print(f"[round {rnd + 1}/{args.repeat}: raw disk]", file=sys.stderr)
            raw = runner.kvtier(f"raw write/read {tag}", "raw",
                                {"dir": str(work), "bytes": total, "block": chunk_bytes,
                                 "threads": args.io_threads, "seed": 1})
            for name, r in (raw or {}).items():
                out["raw"].setdefault(name, []).append(r)

            for backend in args.backends:
                print(f"[round {rnd + 1}/{args.repeat}: kvtier {backend}]", file=sys.stderr)
                for dur, comp in configs:
                    if comp == "one_txn" and backend != "lmdb":
                        continue
                    name = f"{backend}/{dur}/{comp}"
                    d = work / f"kv-{backend}-{dur}-{comp}"
                    staged, one_txn, serial = comp == "staged", comp == "one_txn", comp == "serial"
                    baseline = staged or one_txn or serial
                    p = {**base, "dir": str(d), "backend": backend, "durability": dur,
                         "compression": "none" if baseline else comp, "staged": staged,
                         "one_txn": one_txn, "serial": serial}
                    shutil.rmtree(d, ignore_errors=True)
                    r = runner.kvtier(f"store {name} {tag}", "kv_store", p)
                    if r and r.get("failed"):  # e.g. saves dropped: shown as FAILED, no loads
                        out["notes"][name] = r["failed"]
                    out["store"].setdefault(name, []).append(r)
                    if dur == "power" and not baseline and r and not r.get("failed"):
                        modes = ["load", "load_staged", "get_into", "get_parallel"] if comp == "none" else ["load"]
                        if comp == "none" and backend == "files":
                            modes += ["host_tier", "host_tier_direct"]
                        loads = runner.kvtier(f"load {name} {'+'.join(modes)} {tag}", "kv_load",
                                              {**p, "modes": modes}) or {}
                        for m in modes:
                            out["load"].setdefault(f"{name}/{m}", []).append(loads.get(m))
                    shutil.rmtree(d, ignore_errors=True)

            if have_lmcache:
                print(f"[round {rnd + 1}/{args.repeat}: LMCache 0.5.6]", file=sys.stderr)
                for odirect in (False, True) if args.lmcache_odirect else (False,):
                    name = "use_odirect" if odirect else "default"
                    d = work / f"lmcache-{name}"
                    shutil.rmtree(d, ignore_errors=True)
                    r = runner.lmcache(f"LMCache store+load {name} {tag}", "store_load",
                                       {**base, "dir": str(d), "batch": args.lmcache_batch, "odirect": odirect})
                    out["lmcache_store"].setdefault(name, []).append(r)
                    out["lmcache_load"].setdefault(name, []).append(r)
                    shutil.rmtree(d, ignore_errors=True)

        if not args.skip_lookup:
            print("[lookup]", file=sys.stderr)
            for backend in args.backends:
                counts = args.lookup_stored if backend == "lmdb" else sorted(
                    {min(c, args.files_lookup_cap) for c in args.lookup_stored})
                for stored in counts:
                    d = work / f"lookup-{backend}-{stored}"
                    shutil.rmtree(d, ignore_errors=True)
                    lp = {"dir": str(d), "backend": backend, "prompt_tokens": args.prompt_tokens,
                          "stored_chunks": stored, "seed": 11, "runs": args.lookup_runs}
                    built = runner.kvtier(f"lookup build {backend} {stored}", "lookup_build", lp)
                    meas = runner.kvtier(f"lookup measure {backend} {stored}", "lookup_measure", lp) if built else None
                    out["lookup"][f"{backend}/{stored}"] = {"build": built, "measure": meas}
                    shutil.rmtree(d, ignore_errors=True)
            if have_lmcache:
                d = work / "lmcache-lookup"
                out["lmcache_lookup"] = runner.lmcache(
                    "LMCache lookup", "lookup", {"dir": str(d), "prompt_tokens": args.prompt_tokens,
                                                 "seed": 11, "runs": args.lookup_runs})
                shutil.rmtree(d, ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return out


def machine_info(work: Path) -> dict[str, str]:
    def sh(cmd: str) -> str:
        r = subprocess.run(cmd, shell=True, capture_output=True, text=True, check=False)
        return r.stdout.strip()

    mem = sh("awk '/MemTotal/ {printf \"%.0f GiB\", $2/1048576}' /proc/meminfo")
    dev = sh(f"findmnt -no SOURCE,FSTYPE -T {work}")
    name = dev.split()[0].rsplit("/", 1)[-1] if dev else ""
    ra = sh(f"cat /sys/block/{name}/queue/read_ahead_kb 2>/dev/null")
    model = sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2")
    head = sh(f"git -C {ROOT} rev-parse --short HEAD")
    dirty = sh(f"git -C {ROOT} status --porcelain -- kvtier")
    return {
        "cpu": f"{os.cpu_count()} cores ({model})",
        "memory": mem, "kernel": platform.release(), "python": platform.python_version(),
        "disk": f"{dev} (read_ahead_kb={ra})" if dev else "?", "dir": str(work),
        "kvtier": f"{head}{' + uncommitted changes in kvtier/' if dirty else ''}",
        "loadavg_start": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }


# ----------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------
def fmt(x: float | None, unit: str = "", digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}{unit}"


def fmt_range(s: tuple[float | None, float | None, float | None], n: int) -> str:
    med, lo, hi = s
    if med is None:
        return "–"
    return f"{med:.2f}" if n <= 1 or lo is None or hi is None else f"{med:.2f} ({lo:.2f}–{hi:.2f})"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _raw_refs(res: Result) -> dict[str, float | None]:
    raw = res["raw"]
    nt = res["params"]["io_threads"]
    get = {k: summary(v, "s")[0] for k, v in raw.items()}
    writes = [v for k, v in get.items() if k.startswith("write_") and v]
    reads = [v for k, v in get.items() if k.startswith("read_") and v]
    return {
        "write_best": max(writes) if writes else None,
        "write_dd": get.get("write_buffered"),
        "read_dd": get.get("read_buffered_1"),
        "read_best": max(reads) if reads else None,
        "read_n": get.get(f"read_buffered_{nt}"),
    }


def render(res: Result) -> str:
    m, pr = res["machine"], res["params"]
    n = pr["repeat"]
    lines: list[str] = []
    add = lines.append
    add(f"Machine: {m['cpu']}, {m['memory']} RAM, kernel {m['kernel']}, Python {m['python']}; "
        f"disk {m['disk']}; data in `{m['dir']}`. kvtier {m['kvtier']}. Load average "
        f"{m['loadavg_start']} at the start, {m.get('loadavg_end', '?')} at the end "
        "(other processes share these 2 cores; compare ratios, which are measured side by side).")
    add("")
    add(f"Data: {pr['n_chunks']} chunks × {pr['chunk_bytes'] / MIB:.0f} MiB "
        f"({pr['chunk_tokens']} tokens × {pr['layers']} layers × 2 × {pr['kv_heads']} kv heads × "
        f"{pr['head_dim']} head dim × bf16) = {pr['bytes'] / GIB:.2f} GiB of normal-distributed bf16; "
        f"kvtier commit_bytes {pr.get('commit_bytes', 256 * MIB) / MIB:.0f} MiB. GiB/s = 2^30 B/s. {n} interleaved round(s): median" + (" (min–max)." if n > 1 else "."))
    add("")
    refs = _raw_refs(res)
    lm_store = res["lmcache_store"].get("default")
    lm_load = res["lmcache_load"].get("default")
    lm_api, lm_dur = summary(lm_store, "store_s")[0], summary(lm_store, "store_durable_s")[0]
    lm_l = summary(lm_load, "load_s")[0]
    no_lm = "| LMCache: not installed (run benchmarks/setup_lmcache.sh) |"
    if res["raw"]:
        raw = res["raw"]
        cold = all(r.get("cold") for k, v in raw.items() if k.startswith("read_") for r in v if r)
        temp = "cold" if cold else "**WARM** (could not drop the page cache)"
        labels = {
            "write_buffered": "write: buffered 32 MiB `write()`s + one `fsync` at the end (like `dd conv=fsync`)",
            "write_direct": "write: `O_DIRECT` 32 MiB writes + `fsync`",
        }
        add("### Raw disk (same directory, same bytes)")
        add("")
        add("| raw | GiB/s |")
        add("|---|---|")
        for k, v in raw.items():
            if k.startswith("read_"):
                _, kind, threads = k.split("_")
                label = (f"read, {temp}: {'`O_DIRECT`' if kind == 'direct' else 'buffered'}, "
                         f"{threads} stream{'s' if threads != '1' else ''} of 32 MiB `preadv`s")
            else:
                label = labels[k]
            add(f"| {label} | {fmt_range(summary(v, 's'), n)} |")
        add("")
        add("### Store: `KVCache.save` + `flush` (API), and until on disk (durable)")
        add("")
        add(f"`durable ÷ raw` divides by the best raw write ({fmt(refs['write_best'])} GiB/s) and, in "
            f"brackets, by the `dd`-like buffered one ({fmt(refs['write_dd'])}). 'durable' adds `os.sync()` "
            "after `flush` where the durability mode does not sync itself (`process`). LMCache never "
            "fsyncs: its durable figure adds an fsync of every file. `÷ LMCache` = API ÷ LMCache "
            "store-until-indexed / durable ÷ LMCache durable. `staged`: records copied into a staging "
            "buffer before the write (the path before in-place writes); `one_txn`: LMDB with each "
            "batch in one write transaction instead of transactions of at most 16 MiB; `serial`: "
            "each batch prepared (encoded, checksummed) only once the one before it is written, "
            "instead of while it is written.")
        add("")
        add("| store | API GiB/s | durable GiB/s | durable ÷ raw | ÷ LMCache (API / durable) | on disk |")
        add("|---|---|---|---|---|---|")
        for name, runs in res["store"].items():
            api, dur = summary(runs, "store_s"), summary(runs, "durable_s")
            ok = first_ok(runs)
            disk = f"{ok['disk_bytes'] / GIB:.2f} GiB" if ok else "–"
            if not ok:
                add(f"| kvtier {name} | FAILED: {res['notes'].get(name, 'see log')} | | | | |")
                continue
            add(f"| kvtier {name} | {fmt_range(api, n)} | {fmt_range(dur, n)} | "
                f"{fmt(ratio(dur[0], refs['write_best']), '×')} ({fmt(ratio(dur[0], refs['write_dd']), '×')}) | "
                f"{fmt(ratio(api[0], lm_api), '×')} / {fmt(ratio(dur[0], lm_dur), '×')} | {disk} |")
        for name, runs in res["lmcache_store"].items():
            api, dur = summary(runs, "store_s"), summary(runs, "store_durable_s")
            ok = first_ok(runs)
            add(f"| LMCache 0.5.6 LocalDiskBackend, {name} | {fmt_range(api, n)} | {fmt_range(dur, n)} | "
                f"{fmt(ratio(dur[0], refs['write_best']), '×')} ({fmt(ratio(dur[0], refs['write_dd']), '×')}) | – | "
                f"{ok['files'] if ok else '–'} files |")
        if not res["have_lmcache"]:
            add(no_lm + " | | | | |")
        add("")
        add("### Cold load (files written back and evicted from the page cache; kvtier in a new process)")
        add("")
        add("`load` = `KVCache.load(tokens)` (lookup + read + verify + one new tensor), `load_staged` = the same with each record staged whole and copied into the result (the path before run-by-run reads); `get_into` = "
            "`ChunkStore.get(key, out=buf)` into preallocated chunk buffers, one after another; "
            f"`get_parallel` = the same split over {pr['io_threads']} `get_async` calls; `host_tier` = "
            "`ChunkStore.load_many` into the host tier's pooled buffers (the connector's path), "
            "`host_tier_direct` = the same with `direct_reads` (`O_DIRECT`). LMCache: "
            "`batched_get` from its disk backend (in the writing process: it cannot find its files "
            "after a restart) + copy into one pre-touched tensor. Every byte is compared with the source.")
        add("")
        add(f"| load | GiB/s | ÷ raw read, `dd`-like ({fmt(refs['read_dd'])}) | ÷ best raw read "
            f"({fmt(refs['read_best'])}) | ÷ LMCache | verified |")
        add("|---|---|---|---|---|---|")
        for name, runs in list(res["load"].items()) + [(f"LMCache {k}", v) for k, v in res["lmcache_load"].items()]:
            s = summary(runs, "load_s")
            ok = [r for r in runs if r]
            verified = "yes" if ok and all(r.get("verified") for r in ok) else "NO"
            warm = "" if all(r.get("cold") for r in ok) else " (**WARM**)"
            vs_lm = "–" if name.startswith("LMCache") else fmt(ratio(s[0], lm_l), "×")
            label = name if name.startswith("LMCache") else f"kvtier {name}"
            add(f"| {label}{warm} | {fmt_range(s, n)} | {fmt(ratio(s[0], refs['read_dd']), '×')} | "
                f"{fmt(ratio(s[0], refs['read_best']), '×')} | {vs_lm} | {verified} |")
        if not res["have_lmcache"]:
            add(no_lm + " | | | | |")
        add("")
    if res["lookup"]:
        lml = res.get("lmcache_lookup")
        lm_med = lml["full_hit"]["median_ms"] if lml else None
        nt = pr["prompt_tokens"]
        add(f"### Lookup: {nt}-token prompt ({nt // 256} chunks of 256), after a restart")
        add("")
        add("Median (p90) ms over many calls. `full`/`half`/`miss` = `KVCache.lookup` (SHA-256 key "
            "chain + index) on a prompt cached entirely / for its first half / not at all; `hash` = "
            "the key chain alone; `index` = `ChunkStore.count_present_prefix` on precomputed keys; "
            "`first` = the first call after opening with a cold page cache; `host tier` = the same "
            "process that saved (keys in memory). LMCache: `engine.lookup` in the process that "
            "stored (after a restart it finds nothing).")
        add("")
        add("| store | chunks stored | open ms | index ready ms | first ms | full | half | miss "
            "| hash | index | host tier | full: × faster than LMCache |")
        add("|---|---|---|---|---|---|---|---|---|---|---|---|")

        def mp(x: Result | None) -> str:
            return "–" if not x else f"{x['median_ms']:.3f} ({x['p90_ms']:.3f})"

        for name, r in res["lookup"].items():
            b, ms = r["build"], r["measure"]
            backend, stored = name.split("/")
            if not ms:
                add(f"| kvtier {backend} | {stored} | FAILED | | | | | | | | | |")
                continue
            add(f"| kvtier {backend} | {ms['disk_records']} | {ms['open_s'] * 1e3:.1f} | "
                f"{ms['index_ready_s'] * 1e3:.1f} | {ms['first_ms']:.2f} | {mp(ms['full_hit'])} | "
                f"{mp(ms['half_hit'])} | {mp(ms['miss'])} | {mp(ms['hash_only'])} | {mp(ms['index_only'])} | "
                f"{mp(b['host_tier'] if b else None)} | "
                f"{fmt(ratio(lm_med, ms['full_hit']['median_ms']), '×', 1)} |")
        if lml:
            add(f"| LMCache 0.5.6 (hash: {lml['hash']}) | {nt // 256} | – | – | – | {mp(lml['full_hit'])} | "
                f"{mp(lml['half_hit'])} | {mp(lml['miss'])} | {mp(lml['hash_only'])} | – | – | – |")
        elif not res["have_lmcache"]:
            add(no_lm + " | | | | | | | | | | |")
        add("")
    add(targets(res))
    return "\n".join(lines)


def targets(res: Result) -> str:
    rows: list[tuple[str, str, bool | None]] = []
    refs = _raw_refs(res)
    lm_store = res["lmcache_store"].get("default")
    lm_dur = summary(lm_store, "store_durable_s")[0]
    lm_l = summary(res["lmcache_load"].get("default"), "load_s")[0]
    out = ["### Targets", "",
           "Against LMCache's default disk settings (as shipped); the raw write is the best raw "
           "figure (`O_DIRECT`), the raw read the `dd`-like one.", "",
           "| target | measured | verdict |", "|---|---|---|"]
    for name, runs in res["store"].items():
        if not name.endswith("/power/none"):
            continue
        dur = summary(runs, "durable_s")[0]
        q = ratio(dur, refs["write_best"])
        rows.append((f"store {name}: durable ≥ 0.9× raw write (best)", fmt(q, "×"), None if q is None else q >= 0.9))
        q = ratio(dur, lm_dur)
        rows.append((f"store {name}: durable ≥ 2× LMCache (+fsync)", fmt(q, "×"), None if q is None else q >= 2))
    for name, runs in res["load"].items():
        if "/none/" not in name:
            continue
        prefix, mode = name.rsplit("/", 1)
        if mode == "load":
            label = f"cold `KVCache.load` {prefix.split('/')[0]}"
        elif mode == "get_parallel":  # the connector's path: into existing (touched) buffers
            other = summary(res["load"].get(f"{prefix}/get_into"), "load_s")[0] or 0.0
            if other > (summary(runs, "load_s")[0] or 0.0):
                runs, mode = res["load"][f"{prefix}/get_into"], "get_into"
            label = f"cold `ChunkStore.get` ({mode}) {prefix.split('/')[0]}"
        else:
            continue
        g = summary(runs, "load_s")[0]
        q = ratio(g, refs["read_dd"])
        rows.append((f"{label}: ≥ 0.9× raw read (`dd`-like)", fmt(q, "×"), None if q is None else q >= 0.9))
        q = ratio(g, lm_l)
        rows.append((f"{label}: ≥ 1.5× LMCache", fmt(q, "×"), None if q is None else q >= 1.5))
    lml = res.get("lmcache_lookup")
    for name, r in res["lookup"].items():
        ms = r["measure"]
        if not ms:
            continue
        med = ms["full_hit"]["median_ms"]
        rows.append((f"lookup {name} chunks: median ≤ 1 ms", f"{med:.3f} ms", med <= 1.0))
        if lml:
            q = lml["full_hit"]["median_ms"] / med
            rows.append((f"lookup {name} chunks: ≥ 5× faster than LMCache", f"{q:.1f}×", q >= 5))
    if not rows:
        return ""
    for what, val, ok in rows:
        verdict = "n/a" if ok is None else ("met" if ok else "**missed**")
        out.append(f"| {what} | {val} | {verdict} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="work directory on the disk to test (default: a new temp dir, removed after)")
    ap.add_argument("--chunks", type=int, default=32, help="chunks to store (default 32 = 1 GiB at the default shape)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--io-threads", type=int, default=4, help="kvtier io_threads, LMCache disk_io_threads, raw read streams")
    ap.add_argument("--commit-mib", type=int, default=256,
                    help="kvtier commit_bytes in MiB (the write queue holds every chunk, so the writer "
                         "prepares the next batch while one is written whenever this is under half of it)")
    ap.add_argument("--backends", nargs="+", default=["lmdb", "files"], choices=["lmdb", "files"])
    ap.add_argument("--repeat", type=int, default=1,
                    help="interleaved rounds of the throughput part (median and range reported)")
    ap.add_argument("--no-zstd", dest="zstd", action="store_false", help="skip the zstd lines")
    ap.add_argument("--no-lmcache-odirect", dest="lmcache_odirect", action="store_false",
                    help="skip the extra LMCache run with use_odirect (its fastest disk setting)")
    ap.add_argument("--lmcache-batch", type=int, default=8, help="chunks per LMCache batched_put/get")
    ap.add_argument("--prompt-tokens", type=int, default=131072)
    ap.add_argument("--lookup-stored", type=int, nargs="+", default=[1000, 100_000],
                    help="chunks in the store during the lookup test")
    ap.add_argument("--files-lookup-cap", type=int, default=20_000,
                    help="at most this many chunks in the files backend's lookup store (it writes "
                         "~1000 small records/s, so 100k would take minutes)")
    ap.add_argument("--lookup-runs", type=int, default=200)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-lookup", action="store_true")
    ap.add_argument("--json", help="also write every raw result to this file")
    ap.add_argument("--render", metavar="JSON", help="only print the report of a saved --json file")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per worker")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--params", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        emit(WORKERS[args.worker](json.loads(args.params)))
        return
    if args.render:
        saved: Result = json.loads(Path(args.render).read_text())
        print(render(saved))
        print(f"(benchmark took {saved.get('elapsed_s', 0):.0f} s)")
        return
    t0 = time.perf_counter()
    res = collect(args)
    res["machine"]["loadavg_end"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    res["elapsed_s"] = time.perf_counter() - t0
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    print(render(res))
    print(f"(benchmark took {res['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
