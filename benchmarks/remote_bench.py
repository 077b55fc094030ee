#!/usr/bin/env python
"""The remote tier against a plain pipelined Redis client, side by side, on one server.

    .venv/bin/python benchmarks/remote_bench.py            # ~1 minute; starts its own redis-server
    .venv/bin/python benchmarks/remote_bench.py --url redis://HOST:PORT   # an existing server
                                                           # (it is FLUSHed: use a scratch one)

For 32 MiB and 2 MiB chunks (bf16 records of that size), in one run against the same server:
- the plain client: redis-py SETs and GETs the same number of values of the same size,
  pipelined in batches of 64 MiB, with no checks; twice: with redis-py's defaults (hiredis,
  which copies each value it sends) and with a connection that sends values without copying;
  the faster of the two is the baseline of each ratio;
- kvtier: ``RemoteTier.store_many`` (existence check, then one SET of manifest + payload per chunk) and ``fetch_many`` +
  ``codec.decode_pieces`` into preallocated tensors (every checksum verified), loads on
  ``--threads`` threads as ``ChunkStore`` does (up to 8 MiB of chunks per fetch).
Reports GB/s of each, best of ``--repeat`` runs, and kvtier's ratio to the plain client.
Then the lookup of a 512-chunk prompt (``count_present_prefix``): median and p99.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kvtier import codec  # noqa: E402
from kvtier.metrics import Counters  # noqa: E402
from kvtier.remote import RemoteTier  # noqa: E402
from kvtier.remote.nodes import zero_copy_connection_classes  # noqa: E402
from kvtier.testing.redis_server import LocalRedis  # noqa: E402

BATCH = 64 << 20


def batches(n: int, size: int) -> list[range]:
    per = max(1, BATCH // size)
    return [range(i, min(n, i + per)) for i in range(0, n, per)]


def plain(client, values: list[bytes]) -> tuple[float, float]:
    names = [f"plain:{i}" for i in range(len(values))]
    t0 = time.perf_counter()
    for b in batches(len(values), len(values[0])):
        with client.pipeline(transaction=False) as p:
            for i in b:
                p.set(names[i], values[i])
            p.execute()
    t1 = time.perf_counter()
    got = 0
    for b in batches(len(values), len(values[0])):
        with client.pipeline(transaction=False) as p:
            for i in b:
                p.get(names[i])
            got += sum(len(v) for v in p.execute())
    t2 = time.perf_counter()
    assert got == sum(len(v) for v in values)
    client.flushall()
    return t1 - t0, t2 - t1


def kvtier_run(tier: RemoteTier, client, records, outs, pool) -> tuple[float, float]:
    items = [(k, h, p) for k, h, p in records]
    t0 = time.perf_counter()
    for b in batches(len(items), items[0][2].nbytes):
        assert tier.store_many([items[i] for i in b]) == len(b)
    t1 = time.perf_counter()

    def load(b: range) -> None:
        recs = tier.fetch_many([items[i][0] for i in b])
        for i, rec in zip(b, recs, strict=True):
            codec.decode_pieces(rec.header, rec.pieces, expect_key=items[i][0], out=outs[i])

    # as ChunkStore loads: on its I/O threads, so one chunk's checks overlap the next's transfer
    chunks_per_batch = max(1, (8 << 20) // items[0][2].nbytes)
    list(pool.map(load, [range(i, min(len(items), i + chunks_per_batch))
                         for i in range(0, len(items), chunks_per_batch)]))
    t2 = time.perf_counter()
    client.flushall()
    return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an existing scratch server (default: start one)")
    ap.add_argument("--total-mib", type=int, default=512, help="bytes moved per size and direction")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--part-bytes", default="4M")
    ap.add_argument("--threads", type=int, default=4, help="load threads (io_threads' default)")
    args = ap.parse_args()
    server = None
    if args.url is None:
        server = LocalRedis(Path(tempfile.mkdtemp(prefix="kvtier-remote-bench-")),
                            maxmemory=f"{3 * args.total_mib}mb")
        url = server.url
    else:
        url = args.url
    import redis

    from kvtier.config import CacheConfig

    part = CacheConfig(path=tempfile.mkdtemp(), remote_part_bytes=args.part_bytes).remote_part_bytes
    tier = RemoteTier(url=url, password=None, timeout_s=5.0, part_bytes=part, queue_bytes=1 << 30,
                      counters=Counters(), writer=False)
    addr = tier.address
    conn = dict(host=addr.nodes[0][0], port=addr.nodes[0][1], db=addr.db,
                password=addr.password, username=addr.username)
    client = redis.Redis(**conn)
    zero_copy = redis.Redis(connection_pool=redis.ConnectionPool(
        connection_class=zero_copy_connection_classes()[0], **conn))
    client.flushall()
    print(f"server: {tier.address.describe()} (redis-server {client.info()['redis_version']}), "
          f"remote_part_bytes {part >> 20} MiB, {args.total_mib} MiB per size and direction, "
          f"best of {args.repeat}\n")
    print("| chunk | plain store GB/s (defaults / zero-copy) | kvtier store GB/s | ratio "
          "| plain load GB/s (defaults / zero-copy) | kvtier load GB/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    ns = os.urandom(16)
    pool = ThreadPoolExecutor(args.threads)
    for mib in (32, 2):
        size = mib << 20
        n = max(1, (args.total_mib << 20) // size)
        tokens = mib * 8  # 8 KV heads x 128 x 2 (K,V) x 2 bytes x 4 layers = 8 KiB per token... shape below
        records, outs = [], []
        for i in range(n):
            t = torch.randint(-30000, 30000, (size // 2,), dtype=torch.int16).view(torch.bfloat16)
            t = t.view(4, 2, tokens, 8, size // 2 // (4 * 2 * tokens * 8))
            key = os.urandom(32)
            header, payload = codec.encode(t, key=key, namespace_id=ns, token_start=i * tokens,
                                           num_tokens=tokens)
            records.append((key, header, payload))
            outs.append(torch.empty_like(t))
        values = [bytes(p) for _, _, p in records]
        best = [float("inf")] * 6
        for _ in range(args.repeat):
            runs = (*plain(client, values), *plain(zero_copy, values), *kvtier_run(tier, client, records, outs, pool))
            best = [min(a, b) for a, b in zip(best, runs, strict=True)]
        moved = n * size / 1e9
        ds, dl, zs, zl, ks, kl = (moved / t for t in best)
        ps, pl = max(ds, zs), max(dl, zl)
        print(f"| {mib} MiB | {ds:.2f} / {zs:.2f} | {ks:.2f} | {ks / ps:.2f}x "
              f"| {dl:.2f} / {zl:.2f} | {kl:.2f} | {kl / pl:.2f}x |")
        del records, outs, values
    # lookup: 512 stored chunks (small records: lookups never read payloads)
    small = torch.zeros(1, 1, 16, 1, 8, dtype=torch.bfloat16)
    keys = [os.urandom(32) for _ in range(512)]
    tier.store_many([(k, *codec.encode(small, key=k, namespace_id=ns, token_start=0, num_tokens=16))
                     for k in keys])
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        assert tier.count_present_prefix(keys) == 512
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"\nlookup of a 512-chunk prompt: median {statistics.median(times) * 1e3:.2f} ms, "
          f"p99 {times[int(len(times) * 0.99)] * 1e3:.2f} ms (300 runs)")
    client.flushall()
    tier.close()
    if server is not None:
        server.stop()


if __name__ == "__main__":
    main()
