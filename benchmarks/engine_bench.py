"""End-to-end vLLM benchmark: time to first token after a restart, and overhead without reuse.

Compares, side by side in one run on the same tiny local model (random weights, CPU backend):
  * TTFT of a long prompt with no connector (full prefill),
  * kvtier on an empty store (prefill + save), then a fresh engine on the same store (load),
  * vLLM's ExampleConnector (save, then load in a fresh engine),
  * throughput on a workload with no reuse (distinct prompts), with and without kvtier,
  * a conversation's second turn (the first turn, its answer and a new message) in a fresh
    engine: TTFT with no connector, with kvtier saving prompts only (the default), and with
    ``save_decode_chunks`` (the answer's chunks saved too); and the first turn's generation
    time with each, which is what saving the answer costs,
  * a workload under KV-memory pressure: prompts whose prefixes are stored, answered at
    length by more requests than vLLM's KV memory holds, so that vLLM preempts some while
    they decode and recomputes them when they resume (its own prefix cache off, as when
    their freed blocks were reused): the time it takes with no connector, with kvtier (a
    resumed request loads its prompt again) and with ``save_decode_chunks`` (its answer's
    chunks too).
Each "fresh engine" is a new engine in this process (vLLM in-process mode); the store's files
may still be in the page cache (warm) unless --drop-caches is given (needs root).

    .venv/bin/python benchmarks/engine_bench.py [--tokens 8192] [--drop-caches] [--only pressure ...]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
SECTIONS = ("restart", "no-reuse", "conversation", "pressure")


def drop_caches(enabled: bool) -> str:
    if not enabled:
        return "warm"
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "cold"
    except OSError:
        return "warm (drop_caches refused)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3, help="TTFT samples per configuration")
    ap.add_argument("--no-reuse-prompts", type=int, default=16)
    ap.add_argument("--drop-caches", action="store_true")
    ap.add_argument("--turn-tokens", type=int, default=2048, help="the conversation's first prompt")
    ap.add_argument("--answer-tokens", type=int, default=1024, help="the first turn's answer")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="the workloads to run (default: all)")
    ap.add_argument("--pressure-prompts", type=int, default=4, help="requests of the KV-pressure workload")
    ap.add_argument("--backends", nargs="+", default=["files"], choices=["files", "lmdb"],
                    help="kvtier backends to run side by side (default: files, the default backend)")
    args = ap.parse_args()

    from vllm.config import KVTransferConfig

    from kvtier.testing.engine import Engine, kv_transfer_config
    from kvtier.testing.tiny_model import make_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="kvtier-engine-bench-"))
    model = make_tiny_llama(work / "model", layers=4, hidden=512, heads=8, kv_heads=4, vocab=2048,
                            max_len=args.tokens + 64, std=0.05)
    rng = random.Random(0)
    opts = {"max_model_len": args.tokens + 64, "max_num_batched_tokens": args.tokens + 64,  # ExampleConnector needs whole-prompt prefill
            "kv_cache_memory_bytes": 512 << 20, "enable_prefix_caching": False}
    prompts = [[rng.randrange(3, 2000) for _ in range(args.tokens)] for _ in range(args.repeat)]
    warm = [rng.randrange(3, 2000) for _ in range(64)]

    def ttfts(engine: Engine) -> tuple[list[float], list[int], list[list[int]]]:
        engine.generate([warm], max_tokens=1)
        times, cached, outs = [], [], []
        for p in prompts:
            r, t = engine.timed_generate(p, max_tokens=1)
            times.append(t)
            cached.append(r.num_cached_tokens)
            outs.append(r.tokens)
        return times, cached, outs

    rows: list[tuple[str, float, int, bool]] = []
    tput: dict[str, list[float]] = {}
    if "restart" in args.only:
        with Engine(model, **opts) as e:
            base_t, _, base_out = ttfts(e)
        rows.append(("no connector (prefill)", statistics.median(base_t), 0, True))

        for backend in args.backends:
            store = work / f"kvtier-store-{backend}"
            tag = f"kvtier ({backend})"
            with Engine(model, kv_transfer_config(store, backend=backend), **opts) as e:
                t, c, o = ttfts(e)
            rows.append((f"{tag}, empty store (prefill + save)", statistics.median(t), c[0], o == base_out))
            state = drop_caches(args.drop_caches)
            with Engine(model, kv_transfer_config(store), **opts) as e:
                t, c, o = ttfts(e)
            rows.append((f"{tag}, fresh engine ({state} store)", statistics.median(t), c[0], o == base_out))
            state = drop_caches(args.drop_caches)
            with Engine(model, kv_transfer_config(store, load_async=False), **opts) as e:
                t, c, o = ttfts(e)
            rows.append((f"{tag} load_async=false, fresh engine ({state} store)", statistics.median(t), c[0],
                         o == base_out))

        ex_dir = work / "example-store"
        ex_cfg = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                  kv_connector_extra_config={"shared_storage_path": str(ex_dir)})
        with Engine(model, ex_cfg, **opts) as e:
            t, c, o = ttfts(e)
        rows.append(("ExampleConnector, empty store", statistics.median(t), c[0], o == base_out))
        state = drop_caches(args.drop_caches)
        with Engine(model, ex_cfg, **opts) as e:
            t, c, o = ttfts(e)
        rows.append((f"ExampleConnector, fresh engine ({state})", statistics.median(t), c[0], o == base_out))

    if "no-reuse" in args.only:
        distinct = [[rng.randrange(3, 2000) for _ in range(1024)] for _ in range(args.no_reuse_prompts)]
        tput = {"no connector": [], **{f"kvtier ({b})": [] for b in args.backends}}
        for rnd in range(args.repeat):  # interleaved rounds: this machine's speed drifts
            for name in tput:
                backend = name[len("kvtier ("):-1] if name.startswith("kvtier") else None
                cfg = kv_transfer_config(work / f"noreuse-{backend}-{rnd}", backend=backend) if backend else None
                with Engine(model, cfg, **opts) as e:
                    e.generate([warm], max_tokens=1)
                    t0 = time.perf_counter()
                    e.generate(distinct, max_tokens=32)
                    tput[name].append(len(distinct) * (1024 + 32) / (time.perf_counter() - t0))

    conv = conversation(model, work, opts, warm, args) if "conversation" in args.only else []
    pressed = pressure(model, work, warm, args) if "pressure" in args.only else []

    if rows:
        base = rows[0][1]
        print(f"\nprompt {args.tokens} tokens, median of {args.repeat}; model: 4 layers, hidden 512, "
              "8 heads (4 KV), bf16, CPU backend\n")
        print("| configuration | TTFT (s) | vs no connector | cached tokens | same output |")
        print("|---|---|---|---|---|")
        for name, t, c, same in rows:
            print(f"| {name} | {t:.3f} | {base / t:.2f}x | {c} | {same} |")
    if tput:
        print(f"\n| no-reuse workload ({args.no_reuse_prompts} x 1024-token prompts, 32 new tokens) "
              "| tokens/s, median (range) | vs no connector |")
        print("|---|---|---|")
        ref = statistics.median(tput["no connector"])
        for name, v in tput.items():
            print(f"| {name} | {statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f}) | "
                  f"{statistics.median(v) / ref:.3f}x |")
    if conv:
        first = conv[0][1]
        turn2 = args.turn_tokens + args.answer_tokens + 256
        print(f"\n| conversation: second turn ({turn2} tokens: a {args.turn_tokens}-token turn, its "
              f"{args.answer_tokens}-token answer, 256 new) after a restart, median of {args.repeat} | TTFT (s) "
              "| vs no connector | cached tokens | same output | first turn's generation (s) | vs no connector |")
        print("|---|---|---|---|---|---|---|")
        for name, t, c, same, gen in conv:
            print(f"| {name} | {t:.3f} | {first / t:.2f}x | {c} | {same} | {gen:.2f} | {gen / conv[0][4]:.3f}x |")
    if pressed:
        print(f"\n| KV-memory pressure ({args.pressure_prompts} x {args.turn_tokens}-token prompts stored before, "
              f"{args.answer_tokens // 2} new tokens each, KV memory for about 1.6 of them), median of "
              f"{args.repeat} | seconds | vs no connector | preemptions | tokens loaded | tokens computed "
              "| same output |")
        print("|---|---|---|---|---|---|---|")
        for name, t, n_pre, loaded, done, same in pressed:
            print(f"| {name} | {t:.2f} | {pressed[0][1] / t:.2f}x | {n_pre} | {loaded} | {done} | {same} |")
    shutil.rmtree(work, ignore_errors=True)


def pressure(model: Path, work: Path, warm: list[int],
             args: argparse.Namespace) -> list[tuple[str, float, int, int, int, bool]]:
    """Requests preempted for lack of KV memory while they decode: (name, seconds for the
    whole batch, preemptions, tokens kvtier loaded, tokens the model computed (in the first
    round), same output as without a connector),
    medians of ``args.repeat`` interleaved rounds. The prompts' prefixes were saved by an
    earlier engine (a shared document, a system prompt)."""
    from kvtier.testing.engine import Engine, kv_transfer_config, observe

    rng = random.Random(2)
    prompts = [[rng.randrange(3, 2000) for _ in range(args.turn_tokens)] for _ in range(args.pressure_prompts)]
    new_tokens = args.answer_tokens // 2
    per_request = args.turn_tokens + new_tokens
    # float32, so that the output does not depend on the schedule (bf16 matmuls round
    # differently for different batches, and preemptions change them): a difference is a KV
    # error. 8 KiB per token for this model (4 layers x 4 KV heads x 64 x K and V).
    opts = {"max_model_len": per_request + 64, "max_num_batched_tokens": args.turn_tokens + 64,
            "kv_cache_memory_bytes": int(1.6 * per_request) * 8192, "enable_prefix_caching": False,
            "dtype": "float32"}
    configs = {"no connector": None, "kvtier (prompts stored)": {},
               "kvtier, save_decode_chunks": {"save_decode_chunks": True}}
    samples: dict[str, list[tuple[float, int, int, int, bool]]] = {name: [] for name in configs}
    base: list[list[int]] | None = None
    for rnd in range(args.repeat):
        for name, extra in configs.items():
            cfg = None
            if extra is not None:
                cfg = kv_transfer_config(work / f"pressure-{rnd}-{list(configs).index(name)}", **extra)
                with Engine(model, cfg, **opts) as e:  # the prompts, saved earlier
                    e.generate(prompts, max_tokens=1)
                    e.worker_connector._store.flush()
            with Engine(model, cfg, **opts) as e:
                preempted: list[object] = []
                computed = [0]  # tokens the model computed: prefills, recomputes and decodes

                def scheduled(out: Any, *a: object, _c: list[int] = computed, **k: object) -> None:
                    _c[0] += out.total_num_scheduled_tokens

                observe(e.scheduler, "_preempt_request", lambda _, request, *a, _l=preempted, **k: _l.append(request))
                observe(e.scheduler, "schedule", scheduled)
                e.generate([warm], max_tokens=1)
                computed[0] = 0
                side = e.scheduler_connector._sched if cfg is not None else None
                before = side.hit_tokens if side is not None else 0
                t0 = time.perf_counter()
                out = [r.tokens for r in e.generate(prompts, max_tokens=new_tokens)]
                t = time.perf_counter() - t0
                loaded = side.hit_tokens - before if side is not None else 0
            base = base or out
            samples[name].append((t, len(preempted), loaded, computed[0], out == base))
    return [(name, statistics.median(x[0] for x in v), v[0][1], v[0][2], v[0][3], all(x[4] for x in v))
            for name, v in samples.items()]


def conversation(model: Path, work: Path, opts: dict, warm: list[int],
                 args: argparse.Namespace) -> list[tuple[str, float, int, bool, float]]:
    """The second turn of a conversation after a restart: (name, TTFT, cached tokens, same
    output as without a connector, seconds the first turn's generation took), medians of
    ``args.repeat`` interleaved rounds (this machine's speed drifts)."""
    from kvtier.testing.engine import Engine, kv_transfer_config

    rng = random.Random(1)
    turn1 = [rng.randrange(3, 2000) for _ in range(args.turn_tokens)]
    new = [rng.randrange(3, 2000) for _ in range(256)]
    configs = {"no connector": None, "kvtier, prompts saved (default)": {},
               "kvtier, save_decode_chunks": {"save_decode_chunks": True}}
    samples: dict[str, list[tuple[float, int, bool, float]]] = {name: [] for name in configs}
    answer: list[int] | None = None
    base: list[int] | None = None
    for rnd in range(args.repeat):
        for name, extra in configs.items():
            store = work / f"conversation-{rnd}-{list(configs).index(name)}"
            with Engine(model, None if extra is None else kv_transfer_config(store, **extra), **opts) as e:
                e.generate([warm], max_tokens=1)
                t0 = time.perf_counter()
                got = e.generate([turn1], max_tokens=args.answer_tokens)[0].tokens
                gen = time.perf_counter() - t0
                if e.worker_connector is not None:
                    e.worker_connector._store.flush()
            answer = answer or got
            turn2 = turn1 + answer + new
            drop_caches(args.drop_caches)
            with Engine(model, None if extra is None else kv_transfer_config(store, **extra),
                        **opts) as e:  # "after a restart"
                e.generate([warm], max_tokens=1)
                r, t = e.timed_generate(turn2)
            base = base or r.tokens
            samples[name].append((t, r.num_cached_tokens, got == answer and r.tokens == base, gen))
    return [(name, statistics.median(x[0] for x in v), v[0][1], all(x[2] for x in v),
             statistics.median(x[3] for x in v)) for name, v in samples.items()]


if __name__ == "__main__":
    main()
