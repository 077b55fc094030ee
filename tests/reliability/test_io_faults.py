"""I/O faults: EIO injected at the files backend's syscall boundary (opens, renames, syncs,
reads) at random, and a really full disk (a size-limited tmpfs) for both backends. Serving
continues (no exception reaches the caller; failed saves are counted), earlier records stay
readable and correct, and once the faults stop the store takes saves again."""

from __future__ import annotations

import errno
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvhelpers import CHUNK, make_kv, open_cache, same_bits, small_tmpfs, tokens  # noqa: I001
from relhelpers import fuzz_seed, record, scale

from kvtier.backends import files as files_backend


class FaultyOS:
    """``os`` as the files backend sees it, failing chosen calls with EIO at a given rate."""

    CALLS = ("open", "replace", "fdatasync", "fsync", "preadv", "ftruncate")

    def __init__(self, rate: float, rng: random.Random) -> None:
        self.rate = rate
        self.rng = rng
        self.injected = 0

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        if name not in self.CALLS:
            return real

        def faulty(*args: Any, **kwargs: Any) -> Any:
            if self.rate and self.rng.random() < self.rate:
                self.injected += 1
                raise OSError(errno.EIO, f"injected EIO in os.{name}")
            return real(*args, **kwargs)

        return faulty


def test_eio_at_the_syscall_boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seed = fuzz_seed()
    rng = random.Random(seed)
    faulty = FaultyOS(0.0, rng)
    monkeypatch.setattr(files_backend, "os", faulty)
    store = tmp_path / "s"
    early = [tokens(i, 3 * CHUNK) for i in range(6)]
    rounds = scale(3, 40)
    with open_cache(store, "files", host_bytes=0) as cache:
        for toks in early:
            cache.save(toks, make_kv(toks))
        assert cache.flush(30)
        for r in range(rounds):
            faulty.rate = rng.choice([0.05, 0.2, 0.5])
            for i in range(10):
                toks = tokens(1000 * (r + 1) + i, 3 * CHUNK)
                cache.save(toks, make_kv(toks))  # never raises
                toks = rng.choice(early)
                got = cache.load(toks)  # never raises; a fault is a shorter (correct) prefix
                assert same_bits(got, make_kv(toks[: got.shape[2]]))
            assert cache.flush(30)
        faulty.rate = 0.0
        st = cache.stats()
        assert st["io_errors"] > 0 and faulty.injected > 0, st
        for toks in early:  # what was stored before the faults is intact
            got = cache.load(toks)
            assert got.shape[2] == len(toks) and same_bits(got, make_kv(toks)), "an earlier record was lost"
        after = tokens(99_999, 3 * CHUNK)
        cache.save(after, make_kv(after))
        assert cache.flush(30)
        assert cache.lookup(after) == len(after), "saves did not resume after the faults"
    record("io_faults/eio_files", faults_injected=faulty.injected, rounds=rounds, io_errors_counted=st["io_errors"],
           dropped_saves=st["dropped_saves"], exceptions_to_caller=0, earlier_records_lost=0)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 6 MiB tmpfs (needs root: tests run as root here and in CI)."""
    with small_tmpfs(tmp_path, "6m") as mnt:
        yield mnt


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_a_full_disk_is_made_room_on_by_eviction(small_disk: Path, backend: str) -> None:
    """The filesystem fills long before the budget (1G on a 6 MiB disk): the store evicts to
    keep room for its writes instead of failing them, no exception reaches the caller, what
    is stored is always correct, and saves keep landing."""
    store = small_disk / "store"
    n = scale(60, 300)
    with open_cache(store, backend, disk_bytes="1G", commit_bytes="256K") as cache:
        for i in range(n):
            toks = tokens(500 + i, 4 * CHUNK)
            cache.save(toks, make_kv(toks))
            if i % 10 == 9:
                assert cache.flush(30)
        assert cache.flush(60)
        st = cache.stats()
        last = tokens(500 + n - 1, 4 * CHUNK)
        assert cache.lookup(last) == len(last), st  # the newest landed: room was made
        assert st["evicted_disk"] > 0, st
        assert cache.store.backend.evicted_for_space > 0
        served = 0
        for i in range(n):  # whatever is stored is whole and correct; the rest a clean miss
            toks = tokens(500 + i, 4 * CHUNK)
            got = cache.load(toks)
            assert same_bits(got, make_kv(toks[: got.shape[2]]))
            served += got.shape[2]
    record(f"io_faults/full_disk/{backend}", chunks_saved=4 * n, saves_dropped=st["dropped_saves"],
           evicted_to_make_room=st["evicted_disk"], exceptions_to_caller=0, tokens_served_after=served)
