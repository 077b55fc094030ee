#!/usr/bin/env python
"""Host time the model's thread spends in kvtier's save hooks, per step, side by side.

    .venv/bin/python benchmarks/hook_host_bench.py                       # this checkout
    .venv/bin/python benchmarks/hook_host_bench.py --against /tmp/old    # and another, alternating
    .venv/bin/python benchmarks/hook_host_bench.py --writer              # the writer's cost to the model's thread

On a GPU the hooks only enqueue copies, so what they cost the forward pass is the host time
spent in them: planning, indexing ops and copies enqueued, handing the chunks to the store.
The first three hooks are reported on their own: they run while the device has only the
first layer's work queued (the first), about a layer more (the second) or two (the third,
which plans the step), so their time, unlike the later hooks', can idle the device. With the
PyTorch operations each issues, counted in one more step, untimed (``top_level_ops``): a
profiler trace slows the host by each one.
This measures that time on the CPU with a KV cache so small (one KV head, head_dim 8) that the
copies themselves cost little (a gather from the strided ``kv_last`` layout still runs element
by element on the CPU, about 30 µs per layer of 16 chunks here as 16-byte elements, 50 as
8-byte ones, where a GPU only launches a kernel), for a
Llama-3-8B-like step: 32 layers, ``--chunks``
256-token chunks saved (every layer's ``save_kv_layer``, then ``wait_for_save``), the store's
writer running as in a server. Median and 90th percentile over ``--steps`` steps, because
what varies is contention with the store's threads (the GIL, the queue's lock). With
``--against DIR`` (another kvtier checkout, e.g. ``git worktree add /tmp/old HEAD~3``) both
run in turn, ``--rounds`` times each, in fresh processes. ``--copy-bytes`` sets the worker's
grouping of layers per copy (default: its own; on the CPU one layer per copy; ``8388608`` as
on a GPU).

``--writer`` measures something else: what the store's threads cost the model's thread
outside kvtier's hooks. vLLM's forward pass is, on the host, a loop of PyTorch operations
that enqueue kernels; each lets go of the GIL, and each time one of the store's threads
takes it (after each system call, to run Python), the model's thread may have to wait for
it. A loop of tiny operations runs with the store idle (``IDLE_LOOP_OPS`` of them), then
for as long as the store (``--backend``) writes ``--chunks`` chunks of a Llama-3-8B rank
(32 MiB each) handed to it. Per loop: its operations' median, 99th and 99.9th percentile
and worst, and, on Linux, how often and how long the loop's thread slept for the GIL (a
voluntary context switch of that thread during a tiny CPU add can only be that): in all,
as a share of the loop, and per chunk written. Where it can, it keeps the loop's thread on
one CPU and the store's threads on the others (``pinned`` in the JSON), so that what it
counts is the GIL, not a shared core. Each round runs in a fresh process; with
``--against DIR`` the two checkouts take turns.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the hooks reported one by one: those that may plan the step, with little compute queued
FIRST_HOOKS = ("first", "second", "third")


def measure(chunks: int, steps: int, copy_bytes: int | None) -> dict[str, float]:
    import torch

    from kvtier import CacheConfig
    from kvtier.store import ChunkStore
    from kvtier.testing.worker_rig import Geometry, make_worker
    from kvtier.vllm.metadata import KVTierMetadata, SaveSpec

    torch.set_num_threads(1)
    g = Geometry(layers=32, kv_heads=1, head_dim=8, block_size=16, chunk_tokens=256,
                 num_blocks=chunks * 16, dtype=torch.bfloat16)
    per = g.chunk_tokens // g.block_size
    with tempfile.TemporaryDirectory(prefix="kvtier-hook-bench-") as d:
        cfg = CacheConfig(path=Path(d) / "s", chunk_tokens=g.chunk_tokens, host_bytes=4 * chunks * g.chunk_bytes,
                          write_queue_bytes=4 * chunks * g.chunk_bytes)
        with ChunkStore(cfg) as store:
            args = {} if copy_bytes is None else {"copy_bytes": copy_bytes}
            worker, caches = make_worker(store, g, "kv_last", "cpu", **args)
            hooks, finish = [], []
            first: list[list[float]] = [[] for _ in FIRST_HOOKS]  # each of the first hooks' times
            names = list(caches)

            def step_meta() -> KVTierMetadata:
                return KVTierMetadata(saves=[SaveSpec("r", (os.urandom(32),), 0, g.chunk_tokens,
                                                      list(range(j * per, (j + 1) * per))) for j in range(chunks)])

            for step in range(steps + 5):  # (the first five warm up)
                meta = step_meta()
                t0 = time.perf_counter()
                marks = [t0]
                for name in names[: len(FIRST_HOOKS)]:
                    worker.save_layer(meta, name)
                    marks.append(time.perf_counter())
                for name in names[len(FIRST_HOOKS):]:
                    worker.save_layer(meta, name)
                t1 = time.perf_counter()
                worker.finish_saves(meta)
                t2 = time.perf_counter()
                if step >= 5:
                    for times, a, b in zip(first, marks, marks[1:], strict=False):
                        times.append(b - a)
                    hooks.append(t1 - t0)
                    finish.append(t2 - t1)
                store.flush(60)
                worker.get_finished(set())
            meta = step_meta()  # one more step, untimed: the first hooks' operations counted
            ops = {f"{nth}_hook_ops": top_level_ops(functools.partial(worker.save_layer, meta, name))
                   for nth, name in zip(FIRST_HOOKS, names, strict=False)}
            for name in names[len(FIRST_HOOKS):]:
                worker.save_layer(meta, name)
            worker.finish_saves(meta)
            worker.close()

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3

    total = [a + b for a, b in zip(hooks, finish, strict=True)]
    return {**{f"{nth}_hook_ms": statistics.median(t) * 1e3 for nth, t in zip(FIRST_HOOKS, first, strict=True)},
            "save_layer_ms": statistics.median(hooks) * 1e3, "wait_for_save_ms": statistics.median(finish) * 1e3,
            "wait_for_save_p90_ms": pct(finish, 0.9), "step_ms": statistics.median(total) * 1e3,
            "step_p90_ms": pct(total, 0.9), **ops}


IDLE_LOOP_OPS = 20_000
OPS_PER_CHECK = 100  # the loop asks whether the store is done writing after this many


def op_loop(done: Callable[[int], bool]) -> dict[str, float | None]:
    """The model's thread, on the host: tiny PyTorch operations, each letting go of the GIL,
    ``OPS_PER_CHECK`` at a time until ``done(operations so far)``. Their times, and how
    often and how long this thread slept for the GIL meanwhile: a thread that waits for the
    GIL sleeps, a voluntary context switch of its own (Linux counts them per thread), and a
    tiny CPU add sleeps for nothing else (None where the system does not count them)."""
    import torch

    a, b, c = torch.ones(64), torch.ones(64), torch.empty(64)
    per_thread = getattr(resource, "RUSAGE_THREAD", None)

    def switches() -> int:
        return resource.getrusage(per_thread).ru_nvcsw if per_thread is not None else 0

    times: list[float] = []
    waits, waited = 0, 0.0
    start = time.perf_counter()
    while True:
        for _ in range(OPS_PER_CHECK):
            s0 = switches()
            t = time.perf_counter()
            torch.add(a, b, out=c)
            d = time.perf_counter() - t
            slept = switches() - s0
            times.append(d)
            if slept:
                waits += slept
                waited += d
        if done(len(times)):
            break
    total = time.perf_counter() - start
    times.sort()

    def q(f: float) -> float:
        return times[min(len(times) - 1, int(f * len(times)))] * 1e6

    got = per_thread is not None
    return {"loop_ms": total * 1e3, "ops": len(times), "op_p50_us": q(0.5), "op_p99_us": q(0.99),
            "op_p999_us": q(0.999), "op_max_us": times[-1] * 1e6,
            "gil_waits": waits if got else None, "gil_wait_ms": waited * 1e3 if got else None,
            "gil_wait_share": waited / total if got else None}


def writer_interference(chunks: int, rounds: int, backend: str) -> list[dict[str, float | str | bool | None]]:
    """Per round: the model's thread's loop with the store idle, then while it writes."""
    import torch

    from kvtier import CacheConfig
    from kvtier.store import ChunkStore

    torch.set_num_threads(1)
    shape, dtype = (32, 2, 256, 8, 128), torch.bfloat16  # (a Llama-3-8B rank's 256-token chunk)
    chunk_bytes = math.prod(shape) * dtype.itemsize
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

    def pin() -> bool:
        """This thread on the first CPU, every other thread of the process on the others
        (again before each loop: the store starts threads as it needs them)."""
        if len(cpus) < 2:
            return False
        me = threading.get_native_id()
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
                os.sched_setaffinity(int(task), cpus[:1] if int(task) == me else cpus[1:])
        return True

    rows: list[dict[str, float | str | bool | None]] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-writer-bench-") as d:
        cfg = CacheConfig(path=Path(d) / "s", chunk_tokens=256, host_bytes=2 * chunks * chunk_bytes,
                          write_queue_bytes=chunks * chunk_bytes, backend=backend)
        with ChunkStore(cfg) as store:
            store.reserve_buffers(shape, dtype)
            op_loop(lambda ops: ops >= IDLE_LOOP_OPS)  # (warm-up)
            for r in range(rounds):
                pinned = pin()
                rows.append({"round": r + 1, "store": "idle", **op_loop(lambda ops: ops >= IDLE_LOOP_OPS),
                             "pinned": pinned})
                for i in range(chunks):
                    buf = store.buffer(shape, dtype)
                    assert buf is not None
                    buf.fill_(r * chunks + i)
                    store.put(os.urandom(32), buf, namespace_id=bytes(16), token_start=0, num_tokens=256)
                del buf
                pinned = pin()
                m = op_loop(lambda ops: store.flush(0))  # (until it has written all it was handed)
                per_chunk = None if m["gil_wait_ms"] is None else m["gil_wait_ms"] * 1e3 / chunks
                rows.append({"round": r + 1, "store": "writing", **m, "gil_wait_us_per_chunk": per_chunk,
                             "pinned": pinned})
    return rows


def top_level_ops(call: Callable[[], object]) -> int:
    """How many PyTorch operations ``call`` issues (ATen ops not called by another one): on a
    GPU each is at least one enqueued launch or copy, and under a profiler each costs the
    host more, so a hook's count says how much a trace inflates it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def run_child(tree: Path, extra: list[str], chunks: int) -> object:
    """This script, ``--one``, in a fresh process on the kvtier at ``tree``; its JSON."""
    cmd = [sys.executable, str(HERE / "hook_host_bench.py"), "--one", "--chunks", str(chunks), *extra]
    # (``tree`` first; what the path held stays after it: e.g. the dependencies
    # scripts/gpu-check.sh installs into a folder of their own)
    path = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    out = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": path}, cwd=tree, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_writer_table(rows: list[dict[str, object]], chunks: int, backend: str) -> None:
    pinned = all(m["pinned"] for m in rows)
    where = ("the loop's thread on one CPU, the store's threads on the others" if pinned
             else "threads not pinned: the counts include a shared core")
    print(f"tiny PyTorch operations on the model's thread: {IDLE_LOOP_OPS:,} with the store idle, and for as long "
          f"as the store ({backend}) writes {chunks} chunks of 32 MiB handed to it ({where})\n")
    print("| round | code | store | loop (ms) | operations | GIL waits | time waiting for the GIL (ms; share of the loop) "
          "| per chunk written (µs) | per operation: median / p99 / p99.9 / worst (µs) |")
    print("|---|---|---|---|---|---|---|---|---|")

    def num(v: object, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    for m in rows:
        share = "" if m["gil_wait_share"] is None else f"; {m['gil_wait_share']:.1%}"
        print(f"| {m['round']} | {m['code']} | {m['store']} | {m['loop_ms']:.1f} | {m['ops']:,} "
              f"| {num(m['gil_waits'], 'd')} | {num(m['gil_wait_ms'], '.2f')}{share} "
              f"| {num(m.get('gil_wait_us_per_chunk'), '.0f') if m['store'] == 'writing' else ''} "
              f"| {m['op_p50_us']:.1f} / {m['op_p99_us']:.1f} / {m['op_p999_us']:.0f} / {m['op_max_us']:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=16, help="chunks saved per step (default 16: a 4,096-token prefill)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--copy-bytes", type=int)
    ap.add_argument("--against", help="another kvtier checkout to run side by side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--writer", action="store_true",
                    help="measure the store's writer's cost to the model's thread instead (see above)")
    ap.add_argument("--backend", choices=("files", "lmdb"), default="files", help="the store's backend (--writer)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child run: JSON out
    args = ap.parse_args()
    if args.writer and args.one:
        print(json.dumps(writer_interference(args.chunks, args.rounds, args.backend)))
        return
    if args.one:
        print(json.dumps(measure(args.chunks, args.steps, args.copy_bytes)))
        return
    trees = [("this checkout", HERE.parent)] + ([("--against", Path(args.against).resolve())] if args.against else [])
    if args.writer:  # each round a fresh process per tree, in turn
        wrows = [{"code": label, **m, "round": r + 1} for r in range(args.rounds) for label, tree in trees
                 for m in run_child(tree, ["--writer", "--rounds", "1", "--backend", args.backend], args.chunks)]
        print_writer_table(wrows, args.chunks, args.backend)
        if args.json:
            Path(args.json).write_text(json.dumps(wrows, indent=1))
        return
    rows = []
    for r in range(args.rounds):
        for label, tree in trees:
            extra = ["--steps", str(args.steps)]
            if args.copy_bytes is not None and label == "this checkout":
                extra += ["--copy-bytes", str(args.copy_bytes)]
            rows.append((r + 1, label, run_child(tree, extra, args.chunks)))
    print(f"{args.chunks} chunks per step, 32 layers, {args.steps} steps per run (host time, ms)\n")
    print("| round | code | " + " | ".join(f"{nth} save_kv_layer (median; ops)" for nth in FIRST_HOOKS)
          + " | save_kv_layer, all layers (median) | wait_for_save (median / p90) | step (median / p90) |")
    print("|---|---|" + "---|" * len(FIRST_HOOKS) + "---|---|---|")
    for r, label, m in rows:
        hooks = "".join(f"| {m[f'{nth}_hook_ms']:.3f}; {m[f'{nth}_hook_ops']:.0f} " for nth in FIRST_HOOKS)
        print(f"| {r} | {label} {hooks}"
              f"| {m['save_layer_ms']:.2f} | {m['wait_for_save_ms']:.2f} / {m['wait_for_save_p90_ms']:.2f} "
              f"| {m['step_ms']:.2f} / {m['step_p90_ms']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps([{"round": r, "code": label, **m} for r, label, m in rows], indent=1))


if __name__ == "__main__":
    main()
