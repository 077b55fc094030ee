"""Several processes saving and loading one store at once (overlapping keys, concurrent
eviction), and processes forked after the store was opened: no errors, no corruption,
every load bit-identical, every record left on disk verifies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvhelpers import Expected, Zygote, verify_store

UNIVERSE = 30  # sequences i in [0, 30): shared prefixes, so the processes' keys overlap


def _check_report(rep: dict[str, Any], who: str) -> None:
    assert "error" not in rep, f"{who}: {rep.get('error')}"
    assert not rep["errors"], f"{who}: {rep['errors'][:2]}"
    assert not rep["mismatches"], f"{who}: loads returned wrong KV for sequences {rep['mismatches']}"
    assert rep["saves"] > 0 and rep["loads"] > 0, f"{who}: {rep}"
    st = rep["stats"]
    assert st["corrupt_records"] == st["io_errors"] == st["incompatible_records"] == 0, f"{who}: {st}"


@pytest.mark.parametrize("backend", ["lmdb", "files"])
@pytest.mark.parametrize("disk", ["64M", "1M"], ids=["roomy", "evicting"])
def test_processes_share_a_store(zygote: Zygote, tmp_path: Path, backend: str, disk: str) -> None:
    store = tmp_path / "s"
    cfg = {"disk_bytes": disk, "commit_bytes": "128K"}
    calls = [{"fn": "mixer", "kwargs": {"path": str(store), "backend": backend, "seed": seed,
                                        "seconds": 1.2, "universe": UNIVERSE, "cfg": cfg}}
             for seed in (1, 2, 3)]
    reps = zygote.request("parallel", calls=calls, timeout=60)
    for n, rep in enumerate(reps):
        _check_report(rep, f"process {n}")
    assert len({r["pid"] for r in reps}) == 3
    if disk == "64M":  # loads found what other processes saved
        assert sum(r["stats"]["hits_disk"] for r in reps) > 0, reps
    else:
        assert sum(r["stats"]["evicted_disk"] for r in reps) > 0, reps
    found = verify_store(store, backend, Expected(sequences=range(UNIVERSE)), backend, cfg)
    assert found > 0


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_fork_after_open(zygote: Zygote, tmp_path: Path, backend: str) -> None:
    """A process opens the cache, fills it, then forks while a thread of it is reading;
    parent and children keep using the same cache object (the LMDB environment must be
    reopened in each child), or a child opens its own on the same path."""
    store = tmp_path / "s"
    cfg = {"commit_bytes": "128K"}
    rep = zygote.request("call", fn="fork_family", timeout=90, kwargs={
        "path": str(store), "backend": backend, "seconds": 1.0, "universe": 20, "children": 3,
        "cfg": cfg})
    assert "error" not in rep, rep["error"]
    _check_report(rep["parent"], "parent")
    for n, child in enumerate(rep["children"]):
        _check_report(child, f"child {n}")
        assert child["env_reopened"], f"child {n} used the parent's LMDB environment"
        assert child["hit_tokens"] > 0  # it found what the parent saved before forking
    assert [c["inherited"] for c in rep["children"]] == [True, False, True]
    assert len({rep["parent"]["pid"], *(c["pid"] for c in rep["children"])}) == 4
    verify_store(store, backend, Expected(sequences=range(20)), backend, cfg)
