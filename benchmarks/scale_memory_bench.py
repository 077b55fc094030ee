#!/usr/bin/env python
"""Memory and scale benchmark: resident memory over a long run, and a store of ~1M chunks.

    .venv/bin/python benchmarks/scale_memory_bench.py        # ~4-5 minutes, prints markdown

1. Memory soak (``lmdb`` and ``files`` backends, each in a fresh process): open a ``KVCache``
   with small host-tier, write-queue and disk budgets (so both tiers evict all the time) and
   run thousands of requests -- a prompt made of one of a few shared prefixes plus a unique
   suffix; ``lookup``, ``save``, then ``load`` of a request seen earlier -- sampling the
   process's ``VmRSS`` (and its anonymous / file-backed parts) from ``/proc/self/status``.
   Reported: RSS after import + open (baseline), peak, final, the budgets, and the RSS slope
   over the second half of the run (least squares, MiB per 1000 requests).
2. Scale (``lmdb``): fill one store with ~1M tiny records and another with 10k (the chunks of
   one 128k-token prompt plus filler records under random keys, through ``ChunkStore.put``),
   then, in a *fresh* process with the page cache dropped, time opening the store and
   ``KVCache.lookup`` / ``ChunkStore.count_present_prefix`` on the 128k-token prompt (512 keys).

Each measurement runs in its own subprocess (``--worker``); the parent never imports kvtier.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_common import (  # noqa: E402
    MIB,
    RESULT_PREFIX,
    dir_bytes,
    drop_caches,
    emit,
    time_calls,
    tokens_for,
)

Params = dict[str, Any]
Result = dict[str, Any]

CHUNK = 256
SOAK_SHAPE = (8, 2, 4, 64)  # layers, k/v, kv_heads, head_dim: 8 KiB per token in bf16, 2 MiB per chunk
SCALE_SHAPE = (1, 2, 1, 1)  # the prompt's chunks: 1 KiB each (a lookup never reads records)
FILLER_TOKENS = 32  # filler records: [1, 2, 32, 1, 1] bf16 = 128 payload bytes


def rss() -> dict[str, int]:
    """VmRSS and its anonymous / file-backed parts, in bytes, from /proc/self/status."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[name] = int(value.split()[0]) * 1024
    return out


# ----------------------------------------------------------------------------------------
# workers (each runs in a fresh process)
# ----------------------------------------------------------------------------------------
def w_soak(p: Params) -> Result:
    import numpy as np
    import torch

    from kvtier import CacheConfig, KVCache, Namespace

    ns = Namespace(model="bench-soak", weights_fingerprint="bench", dtype="bfloat16",
                   kv_shape=SOAK_SHAPE, chunk_tokens=CHUNK)
    cfg = CacheConfig(path=Path(p["dir"]), backend=p["backend"], chunk_tokens=CHUNK,
                      host_bytes=p["host_bytes"], write_queue_bytes=p["queue_bytes"],
                      disk_bytes=p["disk_bytes"], io_threads=2,
                      **({"commit_bytes": p["commit_bytes"]} if p.get("commit_bytes") else {}))
    rng = np.random.default_rng(p["seed"])
    prefixes = [np.asarray(tokens_for(p["prefix_tokens"], 1000 + i), dtype=np.uint32)
                for i in range(p["prefixes"])]
    max_tokens = p["prefix_tokens"] + p["max_suffix"]
    # The application's KV buffer: one source tensor, allocated before the baseline is taken.
    layers, two, heads, dim = SOAK_SHAPE
    src = torch.randn(layers, two, max_tokens, heads, dim).to(torch.bfloat16)
    cache = KVCache.open(p["dir"], ns, cfg)
    base = rss()
    samples: list[tuple[int, dict[str, int]]] = [(0, base)]
    seen: list[np.ndarray] = []
    hit_tokens = loaded_tokens = saved_tokens = 0
    t0 = time.perf_counter()
    for i in range(1, p["requests"] + 1):
        if seen and i % 3 == 0:  # a re-sent earlier request: its KV comes from the cache
            prompt = seen[int(rng.integers(len(seen)))]
        else:
            suffix = rng.integers(0, 128_000, int(rng.integers(p["min_suffix"], p["max_suffix"] + 1)),
                                  dtype=np.uint32)
            prompt = np.concatenate([prefixes[int(rng.integers(len(prefixes)))], suffix])
            if len(seen) < 256:
                seen.append(prompt)
            else:
                seen[int(rng.integers(len(seen)))] = prompt
        n = cache.lookup(prompt)
        hit_tokens += n
        if n:
            loaded_tokens += cache.load(prompt).shape[2]
        if n < len(prompt):
            saved_tokens += cache.save(prompt, src.narrow(2, 0, len(prompt)))
        if i % p["sample_every"] == 0:
            samples.append((i, rss()))
    cache.flush()
    elapsed = time.perf_counter() - t0
    final = rss()
    stats = cache.stats()
    cache.close()
    return {"store_du": dir_bytes(Path(p["dir"])), "baseline": base, "final": final, "samples": samples, "elapsed_s": elapsed,
            "hit_tokens": hit_tokens, "loaded_tokens": loaded_tokens, "saved_tokens": saved_tokens,
            "stats": stats}


def w_scale_build(p: Params) -> Result:
    import numpy as np
    import torch

    from kvtier import CacheConfig, KVCache, Namespace

    ns = Namespace(model="bench-scale", weights_fingerprint="bench", dtype="bfloat16",
                   kv_shape=SCALE_SHAPE, chunk_tokens=CHUNK)
    cfg = CacheConfig(path=Path(p["dir"]), backend="lmdb", chunk_tokens=CHUNK, host_bytes="16M",
                      write_queue_bytes="1G", disk_bytes="64G")
    cache = KVCache.open(p["dir"], ns, cfg)
    store = cache.store
    prompt = np.asarray(tokens_for(p["prompt_tokens"], p["seed"]), dtype=np.uint32)
    t0 = time.perf_counter()
    kv = torch.zeros(1, 2, len(prompt), 1, 1, dtype=torch.bfloat16)
    cache.save(prompt, kv)
    filler = torch.zeros(1, 2, FILLER_TOKENS, 1, 1, dtype=torch.bfloat16)
    want = max(0, p["stored_chunks"] - len(prompt) // CHUNK)
    deadline = t0 + p["build_limit_s"]
    done = dropped = 0
    batch = 50_000
    while done < want and time.perf_counter() < deadline:
        for j in range(done, min(want, done + batch)):
            key = j.to_bytes(8, "little") + os.urandom(24)
            if not store.put(key, filler, namespace_id=ns.id, token_start=0, num_tokens=FILLER_TOKENS):
                dropped += 1
        done = min(want, done + batch)
        store.flush()  # bounds the queue: keys in flight stay in memory until committed
    t_build = time.perf_counter() - t0
    stats = cache.stats()
    cache.close()
    os.sync()
    return {"build_s": t_build, "filler_put": done, "dropped": dropped,
            "disk_records": stats["disk_records"], "disk_bytes": stats["disk_bytes"],
            "rate_per_s": stats["disk_records"] / t_build if t_build else None,
            "hit_limit": done < want}


def w_scale_measure(p: Params) -> Result:
    import numpy as np

    from kvtier import CacheConfig, KVCache, Namespace
    from kvtier.keys import as_token_array, chain_seed, chunk_keys

    cold = drop_caches()
    base = rss()
    t0 = time.perf_counter()
    ns = Namespace(model="bench-scale", weights_fingerprint="bench", dtype="bfloat16",
                   kv_shape=SCALE_SHAPE, chunk_tokens=CHUNK)
    cfg = CacheConfig(path=Path(p["dir"]), backend="lmdb", chunk_tokens=CHUNK)
    cache = KVCache.open(p["dir"], ns, cfg)
    t_open = time.perf_counter() - t0
    hit = np.asarray(tokens_for(p["prompt_tokens"], p["seed"]), dtype=np.uint32)
    miss = np.asarray(tokens_for(p["prompt_tokens"], p["seed"] + 1), dtype=np.uint32)
    t0 = time.perf_counter()
    first = cache.lookup(hit)
    t_first = time.perf_counter() - t0
    if first != len(hit) or cache.lookup(miss) != 0:
        raise RuntimeError(f"lookup found {first} of {len(hit)} tokens")
    keys = [c.key for c in chunk_keys(as_token_array(hit), chain_seed(ns), CHUNK, None)]
    runs = p["runs"]
    res = {
        "cold": cold, "open_s": t_open, "first_lookup_ms": t_first * 1e3,
        "lookup_hit": time_calls(lambda: cache.lookup(hit), runs),
        "lookup_miss": time_calls(lambda: cache.lookup(miss), runs),
        "index_only": time_calls(lambda: cache.store.count_present_prefix(keys), runs),
        "keys": len(keys), "disk_records": cache.stats()["disk_records"],
        "rss_open_delta": rss()["VmRSS"] - base["VmRSS"],
    }
    cache.close()
    return res


WORKERS: dict[str, Callable[[Params], Result]] = {
    "soak": w_soak, "scale_build": w_scale_build, "scale_measure": w_scale_measure,
}


# ----------------------------------------------------------------------------------------
# the parent: run workers, collect, print
# ----------------------------------------------------------------------------------------
def run_worker(label: str, worker: str, params: Params, timeout: float,
               env: dict[str, str] | None = None) -> Result | None:
    print(f"[{label}]", file=sys.stderr, flush=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", worker, json.dumps(params)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        print(f"  {label}: timed out after {timeout:.0f} s", file=sys.stderr)
        return None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    print(f"  {label}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}", file=sys.stderr)
    return None


def slope_per_1000(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least-squares slope of bytes over requests and its standard error, in MiB per 1000
    requests."""
    n = len(points)
    if n < 3:
        return 0.0, 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if not sxx:
        return 0.0, 0.0
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    resid = sum((y - my - b * (x - mx)) ** 2 for x, y in points)
    se = (resid / (n - 2) / sxx) ** 0.5
    return b * 1000 / MIB, se * 1000 / MIB


def mib(x: float | None) -> str:
    return "—" if x is None else f"{x / MIB:.1f}"


def render_soak(res: dict[str, Result | None], args: argparse.Namespace) -> tuple[str, list[tuple[str, str, bool]]]:
    lines = [
        f"Soak: {args.requests} requests per backend, kv_shape {SOAK_SHAPE} bf16, chunk {CHUNK} "
        f"tokens (2 MiB per chunk); each prompt = one of {args.prefixes} shared {args.prefix_tokens}-token "
        f"prefixes + a unique {args.min_suffix}–{args.max_suffix}-token suffix, every third request "
        "re-sends an earlier prompt; per request `lookup`, `load` of the cached prefix and `save` of the "
        f"rest. Budgets: host_bytes {args.host_mib} MiB, write_queue_bytes {args.queue_mib} MiB, "
        f"disk_bytes {args.disk_mib} MiB (evicts throughout). RSS sampled every {args.sample_every} "
        "requests; baseline = after import, the 16 MiB source KV buffer and `KVCache.open`.",
        "",
        "| backend | req/s | RSS baseline / peak / final MiB | peak − baseline MiB "
        "| anon baseline / peak MiB | anon peak − baseline MiB | file-backed peak MiB "
        "| allowed (host + queue + 64) MiB | slope ± s.e., 2nd half, MiB/1000 req: RSS (anon) "
        "| saves dropped | disk evictions | store on disk at end (du) MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    checks: list[tuple[str, str, bool]] = []
    allowed = (args.host_mib + args.queue_mib + 64) * MIB
    for backend, r in res.items():
        if r is None:
            lines.append(f"| {backend} | failed | | | | | | | | | | |")
            continue
        samples = [(i, s) for i, s in r["samples"]]
        base = r["baseline"]["VmRSS"]
        peak = max(s["VmRSS"] for _, s in samples + [(0, r["final"])])
        peak_anon = max(s.get("RssAnon", 0) for _, s in samples)
        peak_file = max(s.get("RssFile", 0) for _, s in samples)
        half = [(i, s["VmRSS"]) for i, s in samples if i >= args.requests // 2]
        slope, slope_se = slope_per_1000(half)
        anon_slope, anon_se = slope_per_1000([(i, s.get("RssAnon", 0)) for i, s in samples if i >= args.requests // 2])
        st = r["stats"]
        base_anon = r["baseline"].get("RssAnon", 0)
        lines.append(
            f"| {backend} | {args.requests / r['elapsed_s']:.0f} | {mib(base)} / {mib(peak)} / "
            f"{mib(r['final']['VmRSS'])} | {mib(peak - base)} | {mib(base_anon)} / {mib(peak_anon)} | "
            f"{mib(peak_anon - base_anon)} | {mib(peak_file)} | {mib(allowed)} | "
            f"{slope:+.1f} ± {slope_se:.1f} ({anon_slope:+.1f} ± {anon_se:.1f}) | {st.get('dropped_saves', 0)} | {st.get('evicted_disk', 0)} | {mib(r.get('store_du'))} |")
        checks.append((f"{backend}: peak RSS (VmRSS) − baseline ≤ host + queue + 64 MiB",
                       f"{mib(peak - base)} vs {mib(allowed)} MiB", peak - base <= allowed))
        checks.append((f"{backend}: peak anonymous RSS − baseline ≤ host + queue + 64 MiB",
                       f"{mib(peak_anon - base_anon)} vs {mib(allowed)} MiB", peak_anon - base_anon <= allowed))
        # "no growth": the second half's least-squares slope is not measurably above
        # 1 MiB per 1000 requests (slope − 2 standard errors < 1; samples jitter by ~±30 MiB)
        checks.append((f"{backend}: no RSS growth over the second half",
                       f"RSS {slope:+.1f} ± {slope_se:.1f}, anon {anon_slope:+.1f} ± {anon_se:.1f} MiB / 1000 req",
                       slope - 2 * slope_se < 1.0 and anon_slope - 2 * anon_se < 1.0))
    lines.append("")
    lines.append("Hit / loaded / saved tokens and the store's final counters: " + "; ".join(
        f"{b}: {r['hit_tokens']} / {r['loaded_tokens']} / {r['saved_tokens']}, "
        f"disk_records {r['stats'].get('disk_records')}, host_chunks {r['stats'].get('host_chunks')}"
        for b, r in res.items() if r))
    return "\n".join(lines), checks


def render_scale(res: dict[int, Result | None], args: argparse.Namespace) -> tuple[str, list[tuple[str, str, bool]]]:
    lines = [
        f"Scale (lmdb): stores built with the {args.prompt_tokens // CHUNK} chunks of one "
        f"{args.prompt_tokens}-token prompt (1 KiB records) plus filler records (128 payload bytes) "
        "under random keys via `ChunkStore.put`; then a fresh process, page cache dropped, opens the "
        "store and runs `KVCache.lookup` on the prompt (full hit, and a full miss) and "
        f"`ChunkStore.count_present_prefix` on its {args.prompt_tokens // CHUNK} keys. Median (p90) ms "
        f"over {args.runs} calls.",
        "",
        "| stored chunks | build rate (records/s) | store size MiB | cold | open ms | first lookup ms "
        "| lookup hit ms | lookup miss ms | count_present_prefix ms | RSS after open+lookups MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    checks: list[tuple[str, str, bool]] = []
    meds: dict[int, float] = {}
    for target, r in res.items():
        if r is None or r.get("measure") is None:
            lines.append(f"| {target} (target) | failed | | | | | | | | |")
            continue
        b, m = r["build"], r["measure"]

        def mp(x: dict[str, float]) -> str:
            return f"{x['median_ms']:.3f} ({x['p90_ms']:.3f})"

        lines.append(
            f"| {m['disk_records']:,} | {b['rate_per_s']:,.0f} | {mib(r['size'])} | {m['cold']} | "
            f"{m['open_s'] * 1e3:.1f} | {m['first_lookup_ms']:.2f} | {mp(m['lookup_hit'])} | "
            f"{mp(m['lookup_miss'])} | {mp(m['index_only'])} | {mib(m['rss_open_delta'])} |")
        meds[m["disk_records"]] = m["lookup_hit"]["median_ms"]
        checks.append((f"open a store of {m['disk_records']:,} chunks well under 1 s",
                       f"{m['open_s'] * 1e3:.1f} ms", m["open_s"] < 0.25))
        if b.get("hit_limit"):
            lines.append(f"\nThe {target:,}-chunk build stopped at the {args.build_limit_s:.0f} s limit.")
    if len(meds) >= 2:
        small, big = min(meds), max(meds)
        q = meds[big] / meds[small]
        checks.append((f"lookup latency does not grow: {big:,} vs {small:,} chunks",
                       f"{meds[big]:.3f} vs {meds[small]:.3f} ms ({q:.2f}×)", q <= 1.5))
    return "\n".join(lines), checks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("params", nargs="?", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help="work directory (default: a temporary one under /tmp)")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--sample-every", type=int, default=50)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--min-suffix", type=int, default=64)
    ap.add_argument("--max-suffix", type=int, default=1536)
    ap.add_argument("--host-mib", type=int, default=64)
    ap.add_argument("--queue-mib", type=int, default=64)
    ap.add_argument("--disk-mib", type=int, default=512)
    ap.add_argument("--commit-mib", type=int, default=0, help="commit_bytes in MiB (0: the default)")
    ap.add_argument("--stored", type=int, nargs="+", default=[10_000, 1_000_000])
    ap.add_argument("--prompt-tokens", type=int, default=131_072)
    ap.add_argument("--build-limit-s", type=float, default=120.0,
                    help="stop filling a scale store after this long (the table says so)")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--mmap-threshold", type=int, default=262_144,
                    help="also run the soak with MALLOC_MMAP_THRESHOLD_ set to this (0: skip)")
    ap.add_argument("--skip-soak", action="store_true")
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--json", help="also write the raw results here")
    args = ap.parse_args()
    if args.worker:
        emit(WORKERS[args.worker](json.loads(args.params)))
        return

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvtier-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    soak: dict[str, Result | None] = {}
    scale: dict[int, Result | None] = {}
    try:
        if not args.skip_soak:
            variants = [("lmdb", {}), ("files", {})]
            if args.mmap_threshold:  # diagnostic: glibc hands 2 MiB tensors back to the OS on free
                env = {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)}
                variants += [("lmdb", env), ("files", env)]
            for backend, env in variants:
                name = backend + (f", MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if env else "")
                d = work / f"soak-{backend}"
                shutil.rmtree(d, ignore_errors=True)
                soak[name] = run_worker(f"soak {name}", "soak", {
                    "dir": str(d), "backend": backend, "seed": 5, "requests": args.requests,
                    "sample_every": args.sample_every, "prefixes": args.prefixes,
                    "prefix_tokens": args.prefix_tokens, "min_suffix": args.min_suffix,
                    "max_suffix": args.max_suffix, "host_bytes": args.host_mib * MIB,
                    "queue_bytes": args.queue_mib * MIB, "disk_bytes": args.disk_mib * MIB,
                    "commit_bytes": args.commit_mib * MIB,
                }, timeout=600, env=env)
                shutil.rmtree(d, ignore_errors=True)
        if not args.skip_scale:
            for stored in args.stored:
                d = work / f"scale-{stored}"
                shutil.rmtree(d, ignore_errors=True)
                p = {"dir": str(d), "stored_chunks": stored, "prompt_tokens": args.prompt_tokens,
                     "seed": 11, "runs": args.runs, "build_limit_s": args.build_limit_s}
                built = run_worker(f"scale build {stored}", "scale_build", p, timeout=args.build_limit_s + 300)
                meas = run_worker(f"scale measure {stored}", "scale_measure", p, timeout=300) if built else None
                scale[stored] = {"build": built, "measure": meas, "size": dir_bytes(d)} if built else None
                shutil.rmtree(d, ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)

    if args.json:
        Path(args.json).write_text(json.dumps({"soak": soak, "scale": scale}, indent=1))
    out = [f"`{' '.join([Path(sys.executable).name, *sys.argv])}` — "
           f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, "
           f"{platform.platform()}, run took {time.time() - started:.0f} s", ""]
    checks: list[tuple[str, str, bool]] = []
    if soak:
        text, c = render_soak(soak, args)
        out += ["### Resident memory over a long run", "", text, ""]
        checks += c
    if scale:
        text, c = render_scale(scale, args)
        out += ["### Opening and lookup at scale", "", text, ""]
        checks += c
    out += ["### Targets", "", "| target | measured | met |", "|---|---|---|"]
    out += [f"| {name} | {val} | {'yes' if ok else 'NO'} |" for name, val, ok in checks]
    print("\n".join(out))


if __name__ == "__main__":
    main()
