"""Crash injection through vLLM: an engine with the connector, saving and evicting under a
budget, SIGKILLed at random instants. After each kill the store verifies whole (every
record's checksum, the index and the payloads in agreement), and at the end a fresh engine on
the same store gives exactly the output of an engine without the cache (those two in this
process: only an engine that is killed needs a process of its own)."""

from __future__ import annotations

import os
import random
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# (its import also keeps this process's vLLM engines in-process, before vLLM is imported)
from _engine_job import FIXED, engine
from kvhelpers import REPO  # noqa: I001
from relhelpers import fuzz_seed, kvtier_cli, record, scale

from kvtier import CacheConfig, ChunkStore
from kvtier.store import Outcome

JOB = Path(__file__).resolve().parent / "_engine_job.py"


def _start(*args: str, backend: str = "") -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), KVTIER_JOB_BACKEND=backend)
    return subprocess.Popen([sys.executable, str(JOB), *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


def _wait_for(proc: subprocess.Popen[str], word: str, timeout: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(1.0):
                line = proc.stdout.readline()
                if not line:
                    break
                if line.startswith(word):
                    return line
    proc.kill()
    raise AssertionError(f"engine job did not print {word} within {timeout}s (rc={proc.poll()})")


def _run(model: Path, store: Path | None) -> list[tuple[list[int], int]]:
    """The fixed prompts' tokens and how many of their tokens were cached, per prompt."""
    with engine(str(model), None if store is None else str(store)) as eng:
        return [(r.tokens, r.num_cached_tokens) for r in eng.generate(FIXED, max_tokens=6)]


def _check_store(store: Path) -> int:
    """Every record the index names loads (checksums verified); nothing unpublished is left
    once the sweep ran; `kvtier verify` agrees."""
    with ChunkStore(CacheConfig(path=store)) as s:
        entries = list(s.backend.entries())
        for e in entries:
            got = s.load(e.key)
            assert got.outcome is Outcome.HIT, (e.key.hex()[:16], got)
        s.backend.sweep_orphans(grace_s=0)
        assert set(s.backend.payloads.found()) == {(e.key, e.location) for e in entries}
    r = kvtier_cli("verify", store)
    assert r.returncode == 0, r.stdout + r.stderr
    return len(entries)


@pytest.mark.parametrize("backend", ["files", "lmdb"])
def test_engine_killed_at_random_instants(tmp_path: Path, backend: str) -> None:
    from kvtier.testing.tiny_model import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny-llama", seed=0)
    store = tmp_path / "store"
    seed = fuzz_seed()
    rng = random.Random(seed)
    kills = scale(2, 25)
    checked = 0
    for n in range(kills):
        proc = _start("write", str(model), str(store), str(seed + n), backend=backend)
        _wait_for(proc, "READY", 300)
        time.sleep(rng.uniform(0.0, 3.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        checked += _check_store(store)
    expected = _run(model, None)
    cached = _run(model, store)
    assert [r[0] for r in cached] == [r[0] for r in expected], f"outputs differ after {kills} kills (seed {seed})"
    # beyond what vLLM's own prefix cache shares within the batch, the store served tokens
    from_store = sum(int(r[1]) for r in cached) - sum(int(r[1]) for r in expected)
    assert from_store > 0, (cached, expected)
    record(f"crash/vllm_engine/{backend}", kills=kills, records_checked=checked, partial_or_corrupt_visible=0,
           outputs_equal_to_no_cache=True, tokens_from_the_store_after=from_store)
