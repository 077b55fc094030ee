"""prefetch reads (and verifies) the most recently used records up to a budget, deletes
nothing, and counts what fails verification. (Its effect on the page cache is measured in
benchmarks/prefetch_bench.py, not asserted.)"""

from __future__ import annotations

import json

import pytest
from clihelpers import Built, cli, corrupt, entries, run_main

from kvtier.backends import EntryInfo
from kvtier.backends.base import most_recent


def test_most_recent_first_within_the_budget() -> None:
    es = [EntryInfo(bytes([i]) * 32, size, atime, b"n" * 16)
          for i, (size, atime) in enumerate([(10, 5), (20, 9), (30, 7), (40, 1)])]
    assert [e.atime_ns for e in most_recent(es, 55)] == [9, 7]  # 20 + 30; the next 10 would pass 55
    assert [e.atime_ns for e in most_recent(es, 60)] == [9, 7, 5]
    assert [e.atime_ns for e in most_recent(es, 1000)] == [9, 7, 5, 1]
    assert most_recent(es, 5) == []


def test_prefetch_reads_the_budget_and_counts_corruption(fresh_store: Built,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    b = fresh_store
    before = entries(b.path, b.backend)
    everything = cli("prefetch", b.path, "--max-bytes", "1G", "--json")
    assert everything.returncode == 0, everything.stderr
    rep = json.loads(everything.stdout)
    assert rep["records"] == b.total_chunks and rep["corrupt_or_unreadable"] == 0
    assert rep["bytes"] == sum(size for size, _ in before.values())
    # A budget of about half: exactly the records most_recent picks, no more bytes than asked.
    half = rep["bytes"] // 2
    part = json.loads(run_main(capsys, "prefetch", b.path, "--max-bytes", str(half), "--json").stdout)
    expect = most_recent([EntryInfo(k, size, atime, b"") for k, (size, atime) in before.items()], half)
    assert part["records"] == len(expect) < b.total_chunks
    assert 0 < part["bytes"] == sum(e.size for e in expect) <= half
    # One corrupt record among those read: counted, reported, not deleted.
    key = max(before, key=lambda k: (before[k][1], k))  # the most recently used
    corrupt(b.path, b.backend, key, "payload")
    bad = json.loads(run_main(capsys, "prefetch", b.path, "--max-bytes", "1G", "--json").stdout)
    assert bad["corrupt_or_unreadable"] == 1 and bad["records"] == b.total_chunks - 1
    table = run_main(capsys, "prefetch", b.path, "--max-bytes", "1G")
    assert table.returncode == 0 and "1 record(s) failed verification" in table.stdout
    assert set(entries(b.path, b.backend)) == set(before)


def test_prefetch_bad_budget_is_a_usage_error(fresh_store: Built, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_main(capsys, "prefetch", fresh_store.path, "--max-bytes", "lots")
    assert r.returncode == 2 and r.stderr.startswith("kvtier: error: --max-bytes")


@pytest.mark.parametrize("fresh_store", ["files"], indirect=True)
def test_prefetch_through_dali_reads_and_verifies_the_same_records(fresh_store: Built,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """DALI's CPU file reader (the ``dali`` extra, installed by scripts/dev-env.sh)."""
    b = fresh_store
    plain = json.loads(run_main(capsys, "prefetch", b.path, "--max-bytes", "1G", "--json").stdout)
    dali = json.loads(run_main(capsys, "prefetch", b.path, "--max-bytes", "1G", "--json",
                               "--reader", "dali").stdout)
    assert (dali["records"], dali["bytes"]) == (plain["records"], plain["bytes"]) == (b.total_chunks, plain["bytes"])
    before = entries(b.path, b.backend)
    key = max(before, key=lambda k: (before[k][1], k))
    corrupt(b.path, b.backend, key, "payload")
    bad = json.loads(run_main(capsys, "prefetch", b.path, "--max-bytes", "1G", "--json", "--reader", "dali").stdout)
    assert bad["corrupt_or_unreadable"] == 1 and bad["records"] == b.total_chunks - 1


@pytest.mark.parametrize("fresh_store", ["lmdb"], indirect=True)
def test_prefetch_through_dali_needs_the_files_backend(fresh_store: Built, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_main(capsys, "prefetch", fresh_store.path, "--max-bytes", "1G", "--reader", "dali")
    assert r.returncode == 2 and "--reader dali reads record files" in r.stderr and "Traceback" not in r.stderr
