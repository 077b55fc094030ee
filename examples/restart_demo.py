"""kvtier demo: a real vLLM engine reuses a long prompt's KV after a restart.

Runs three separate engine processes on the same prompt (a true restart each time):
  1. no connector (the baseline: full prefill),
  2. kvtier on an empty store (prefill, KV saved to disk),
  3. kvtier again, in a fresh process (KV loaded from disk instead of recomputed),
and prints time to first token, cached tokens and whether the outputs are identical.

    python examples/restart_demo.py [--tokens 8192] [--backend files|lmdb] [--workdir .kvtier-demo]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path


def child(args: argparse.Namespace) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from kvtier.testing.engine import Engine, kv_transfer_config

    rng = random.Random(0)
    prompt = [rng.randrange(3, 2000) for _ in range(args.tokens)]
    ktc = kv_transfer_config(args.store, backend=args.backend) if args.store else None
    t_start = time.perf_counter()
    with Engine(args.model, ktc, max_model_len=args.tokens + 64, max_num_batched_tokens=2048,
                kv_cache_memory_bytes=512 << 20, block_size=32) as e:
        ready = time.perf_counter() - t_start
        e.generate([[rng.randrange(3, 2000) for _ in range(64)]], max_tokens=1)  # warm-up
        result, ttft = e.timed_generate(prompt, max_tokens=1)
        rest = e.generate([prompt], max_tokens=16)[0]
        stats = e.worker_connector._store.counters.snapshot() if ktc else {}
    print("DEMO " + json.dumps({"ttft_s": ttft, "cached": result.num_cached_tokens, "tokens": rest.tokens,
                                "engine_start_s": ready, "stats": stats}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="prompt length (default 8192)")
    ap.add_argument("--backend", choices=["files", "lmdb"], default="files")
    ap.add_argument("--workdir", default=".kvtier-demo")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    from kvtier.testing.tiny_model import make_tiny_llama

    work = Path(args.workdir).resolve()
    model = make_tiny_llama(work / "model", layers=4, hidden=512, heads=8, kv_heads=4, vocab=2048,
                            max_len=args.tokens + 64, std=0.05)
    store = work / "store"
    shutil.rmtree(store, ignore_errors=True)
    runs = {}
    for name, store_arg in (("no connector", None), ("kvtier, empty store", store),
                            ("kvtier, after restart", store)):
        print(f"[demo] starting a new engine process: {name} ...", flush=True)
        cmd = [sys.executable, __file__, "--child", "--model", str(model), "--tokens", str(args.tokens),
               "--backend", args.backend] + (["--store", str(store_arg)] if store_arg else [])
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("DEMO ")]
        if out.returncode or not lines:
            sys.exit(f"[demo] engine process failed:\n{out.stderr[-4000:]}")
        runs[name] = json.loads(lines[-1][5:])
    base = runs["no connector"]
    print(f"\nprompt: {args.tokens} tokens, store: {store} ({args.backend})\n")
    print(f"{'run':<24} {'TTFT':>9} {'cached tokens':>14} {'same output':>12}")
    for name, r in runs.items():
        print(f"{name:<24} {r['ttft_s']:>8.3f}s {r['cached']:>14} {str(r['tokens'] == base['tokens']):>12}")
    warm = runs["kvtier, after restart"]
    print(f"\nafter the restart, the prompt's KV came from disk: time to first token "
          f"{base['ttft_s'] / warm['ttft_s']:.1f}x faster than recomputing it "
          f"({warm['stats'].get('hits_disk', 0)} chunks loaded, "
          f"{warm['stats'].get('corrupt_records', 0)} corrupt).")
    if warm["tokens"] != base["tokens"] or warm["cached"] == 0:
        sys.exit("[demo] FAILED: expected identical output and a cache hit")


if __name__ == "__main__":
    main()
