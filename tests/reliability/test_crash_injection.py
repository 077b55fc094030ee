"""Crash injection: writers SIGKILLed at random instants, then the store is reopened and
checked whole: every record the index names loads and holds exactly the bytes written,
the index and the payloads agree (nothing listed that cannot load; what a killed writer left
unpublished is swept), and totals match. The writers are the library API (saving under a
small budget, so kills also land in evictions) and the CLI's maintenance commands."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvhelpers import REPO, Expected, Zygote, make_kv, open_cache, seq_tokens, verify_store  # noqa: I001
from relhelpers import fuzz_seed, record, scale

CFG = {"disk_bytes": "3M", "commit_bytes": "128K", "host_bytes": "8M"}


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_library_writer_killed_at_random_instants(zygote: Zygote, tmp_path: Path, backend: str) -> None:
    store, log = tmp_path / "store", tmp_path / "writer.log"
    exp = Expected(log=log)
    seed = fuzz_seed()
    rng = random.Random(seed)
    kills = scale(8, 150)
    checked = saved = 0
    for n in range(kills):
        durability = rng.choice(["process", "power"])
        delay = rng.uniform(0.0, 0.25)
        rep = zygote.request("crash", timeout=60, delay=delay, after="open", kwargs={
            "path": str(store), "backend": backend, "durability": durability,
            "first": n * 100_000, "log": str(log), "cfg": CFG})
        assert rep["killed"], rep
        saved += rep["saved"]
        exp.learn()
        checked += verify_store(store, backend, exp, f"{backend} kill #{n} after {delay * 1000:.0f} ms "
                                f"({durability}, seed {seed})", CFG)
    record(f"crash/library/{backend}", kills=kills, saves_before_kills=saved, records_checked=checked,
           partial_or_corrupt_visible=0)


def _kvtier(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvtier", *args]


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_cli_maintenance_killed_at_random_instants(tmp_path: Path, backend: str) -> None:
    """`kvtier evict`, `verify --remove-corrupt` and `compact`, each killed mid-run: the
    store stays consistent and usable."""
    store = tmp_path / "store"
    exp = Expected(sequences=range(40))
    seed = fuzz_seed()
    rng = random.Random(seed)
    rounds = scale(2, 20)
    kills = checked = 0
    commands = [("evict", "--max-bytes", "200K"), ("verify", "--remove-corrupt"), ("compact",)]
    for n in range(rounds):
        with open_cache(store, backend, disk_bytes="64M") as cache:  # refill what was evicted
            for i in range(40):
                toks = seq_tokens(i)
                cache.save(toks, make_kv(toks))
            assert cache.flush(60)
        for cmd in commands:
            proc = subprocess.Popen(_kvtier(cmd[0], str(store), *cmd[1:]), cwd=REPO,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(rng.uniform(0.05, 0.6))  # the CLI takes ~0.15 s to start
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
            proc.wait()
            checked += verify_store(store, backend, exp, f"{backend} round {n}, {cmd[0]} (seed {seed})",
                                    {"disk_bytes": "64M"})
    record(f"crash/cli/{backend}", commands_run=rounds * len(commands), killed_mid_run=kills,
           records_checked=checked, partial_or_corrupt_visible=0)
