"""benchmarks/storage_bench.py's A/B baselines switch kvtier internals off by name (the
writer pipeline, in-place writes, LMDB's bounded transactions): each still runs and stores
every chunk, so a rename cannot quietly break the benchmark. Speed is not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvhelpers import REPO

RESULT_PREFIX = "RESULT "


@pytest.mark.parametrize(("backend", "baseline"), [("files", "serial"), ("lmdb", "serial"),
                                                   ("files", "staged"), ("lmdb", "one_txn")])
def test_a_baseline_store_runs(tmp_path: Path, backend: str, baseline: str) -> None:
    params = {"dir": str(tmp_path / "s"), "backend": backend, "durability": "power",
              "compression": "none", "layers": 2, "kv_heads": 1, "head_dim": 64, "chunk_tokens": 16,
              "n_chunks": 4, "seed": 7, "io_threads": 2, baseline: True}
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "storage_bench.py"), "--worker",
                          "kv_store", "--params", json.dumps(params)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    line = next(ln for ln in reversed(res.stdout.splitlines()) if ln.startswith(RESULT_PREFIX))
    out = json.loads(line[len(RESULT_PREFIX):])
    assert "failed" not in out and out["stats"]["saves_committed"] == 4
