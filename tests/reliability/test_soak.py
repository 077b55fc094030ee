"""Concurrency soak: several processes saving and loading (every load checked bit for bit)
under a budget that keeps evicting, while the CLI lists, verifies and evicts the same store,
for seconds in the normal run and minutes in a long one. Then the whole store is checked."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from kvhelpers import Expected, Zygote, verify_store  # noqa: I001
from relhelpers import kvtier_cli, record, scale

UNIVERSE = 30


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_processes_and_cli_on_one_store(zygote: Zygote, tmp_path: Path, backend: str) -> None:
    store = tmp_path / "s"
    seconds = scale(3, 120)
    cfg = {"disk_bytes": "1M", "commit_bytes": "128K"}
    cli_runs: list[tuple[str, int, str]] = []
    stop = threading.Event()

    def cli_loop() -> None:
        commands = [("ls",), ("verify",), ("evict", "--max-bytes", "600K"), ("stats",)]
        i = 0
        while not stop.is_set():
            cmd = commands[i % len(commands)]
            i += 1
            if not (store / "kvtier-store.json").exists():
                time.sleep(0.05)
                continue
            r = kvtier_cli(cmd[0], store, *cmd[1:])
            cli_runs.append((cmd[0], r.returncode, r.stderr[-300:]))

    t = threading.Thread(target=cli_loop)
    t.start()
    try:
        calls = [{"fn": "mixer", "kwargs": {"path": str(store), "backend": backend, "seed": seed,
                                            "seconds": seconds, "universe": UNIVERSE, "cfg": cfg}}
                 for seed in (1, 2, 3)]
        reps = zygote.request("parallel", calls=calls, timeout=seconds + 120, child_timeout=seconds + 60)
    finally:
        stop.set()
        t.join()
    for rep in reps:
        assert "error" not in rep, rep
        assert not rep["errors"] and not rep["mismatches"], rep
        st = rep["stats"]
        assert st["corrupt_records"] == st["io_errors"] == 0, st
    bad = [(c, rc, err) for c, rc, err in cli_runs if rc != 0]
    assert not bad, bad[:3]
    checked = verify_store(store, backend, Expected(sequences=range(UNIVERSE)), backend, cfg)
    record(f"soak/{backend}", seconds=seconds, processes=3, saves=sum(r["saves"] for r in reps),
           loads=sum(r["loads"] for r in reps), cli_commands=len(cli_runs),
           evictions=sum(r["stats"]["evicted_disk"] for r in reps), records_checked_after=checked,
           errors=0, wrong_loads=0)
