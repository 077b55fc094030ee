#!/usr/bin/env python
"""What the proposed files-backend fix would achieve here: O_DIRECT from a pre-touched pool.

    .venv/bin/python benchmarks/proto_odirect.py [--rounds 3] [--dir DIR]   # ~1 minute

Not kvtier code: a ~60-line stand-in for the store and load paths proposed in
docs/benchmarks.md ("Findings"), measured side by side with the raw disk, to show the
targets are reachable on this disk with that design:

- store: copy each chunk out of the KV tensor into a buffer from a small pool of
  page-aligned, already-touched buffers (4 KiB header slot + payload), checksum it (xxh3-128),
  write it with ``O_DIRECT`` to a temp file, ``fdatasync``, rename into place; one directory
  fsync per batch. ``--threads`` writers.
- load: ``O_DIRECT`` read of each record into a pool buffer, verify the checksum, copy the
  payload into its slice of a (pre-touched) destination tensor. ``--threads`` readers.

It uses the benchmark's chunk shape (32 MiB) and data, and checks every loaded byte.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import GIB, evict, fill_kv  # noqa: E402

HEADER = 4096  # header slot: keeps the payload 4 KiB-aligned for O_DIRECT


class Proto:
    def __init__(self, root: Path, layers: int, heads: int, dim: int, ct: int, n: int, pool: int) -> None:
        self.root, self.ct, self.n = root, ct, n
        self.shape = (layers, 2, ct, heads, dim)
        self.chunk = layers * 2 * ct * heads * dim * 2
        self.kv = fill_kv(torch.empty(layers, 2, n * ct, heads, dim, dtype=torch.bfloat16), 7, ct)
        self.out = torch.zeros_like(self.kv)  # a connector loads into vLLM's (touched) KV cache
        self.bufs = [mmap.mmap(-1, HEADER + self.chunk) for _ in range(pool)]
        for b in self.bufs:
            b.write(b"\x01" * len(b))  # touch once: a pool is allocated at start-up
        self.views = [torch.frombuffer(b, dtype=torch.bfloat16, offset=HEADER,
                                       count=self.chunk // 2).view(self.shape) for b in self.bufs]

    def _parallel(self, threads: int, job: Callable[[int, int], None]) -> float:
        lock, nxt = threading.Lock(), [0]

        def worker(slot: int) -> None:
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= self.n:
                    return
                job(slot, i)

        t0 = time.perf_counter()
        ts = [threading.Thread(target=worker, args=(s,)) for s in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return time.perf_counter() - t0

    def store(self, threads: int) -> float:
        shutil.rmtree(self.root, ignore_errors=True)
        (self.root / "tmp").mkdir(parents=True)
        os.sync()

        def job(slot: int, i: int) -> None:
            buf = self.bufs[slot]
            self.views[slot].copy_(self.kv.narrow(2, i * self.ct, self.ct))
            buf[:16] = xxhash.xxh3_128_digest(memoryview(buf)[HEADER:])
            tmp = self.root / "tmp" / f"{i}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
            try:
                os.write(fd, buf)
                os.fdatasync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.root / f"{i}.kvt")

        dt = self._parallel(threads, job)
        t0 = time.perf_counter()
        fd = os.open(self.root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        return dt + time.perf_counter() - t0

    def load(self, threads: int) -> float:
        evict(self.root)

        def job(slot: int, i: int) -> None:
            buf = self.bufs[slot]
            fd = os.open(self.root / f"{i}.kvt", os.O_RDONLY | os.O_DIRECT)
            try:
                got = os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)
            if got != HEADER + self.chunk or xxhash.xxh3_128_digest(memoryview(buf)[HEADER:]) != buf[:16]:
                raise RuntimeError(f"chunk {i} failed verification")
            self.out.narrow(2, i * self.ct, self.ct).copy_(self.views[slot])

        return self._parallel(threads, job)

    def raw_write(self, direct: bool) -> float:
        path = self.root.with_name(self.root.name + "-raw")
        buf = self.bufs[0]
        os.sync()
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
        try:
            for _ in range(self.n):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        return time.perf_counter() - t0

    def raw_read(self, direct: bool) -> float:
        path = self.root.with_name(self.root.name + "-raw")
        evict(path)
        buf = self.bufs[0]
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        off = 0
        try:
            while (got := os.preadv(fd, [buf], off)) > 0:
                off += got
        finally:
            os.close(fd)
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="directory on the disk to test (default: a new temp dir)")
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvtier-proto-"))
    p = Proto(work / "store", 32, 8, 128, 256, args.chunks, max(args.threads))
    total = p.chunk * args.chunks
    rows: dict[str, list[float]] = {}

    def rec(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(total / seconds / GIB)

    try:
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
            rec("raw write, buffered + fsync", p.raw_write(direct=False))
            rec("raw write, O_DIRECT", p.raw_write(direct=True))
            for t in args.threads:
                rec(f"proto store, {t} writer(s)", p.store(t))
            rec("raw read cold, buffered", p.raw_read(direct=False))
            rec("raw read cold, O_DIRECT", p.raw_read(direct=True))
            for t in args.threads:
                rec(f"proto cold load, {t} reader(s)", p.load(t))
        ok = torch.equal(p.out.view(torch.int16), p.kv.view(torch.int16))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{args.chunks} × {p.chunk >> 20} MiB chunks, {args.rounds} interleaved rounds, median (min–max) GiB/s; "
          f"load avg {' '.join(f'{x:.1f}' for x in os.getloadavg())}; loaded bytes verified: {ok}\n")
    print("| | GiB/s | ÷ raw O_DIRECT |\n|---|---|---|")
    for k, v in rows.items():
        ref = med["raw write, O_DIRECT"] if "write" in k or "store" in k else med["raw read cold, O_DIRECT"]
        print(f"| {k} | {med[k]:.2f} ({min(v):.2f}–{max(v):.2f}) | {med[k] / ref:.2f}× |")


if __name__ == "__main__":
    main()
