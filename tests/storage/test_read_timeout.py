"""A read that never returns (a hung network mount, a dying disk) costs its caller at most
``read_timeout_s``: the chunk is a miss (``TIMED_OUT``), the record is kept, and while every
I/O thread is held by such reads, later reads fail at once instead of queueing behind them.

The hang is ``diskhelpers.hang_reads``: the backend's own ``read_record`` blocks first where
the test says; everything above it (the I/O pool, the deadline, the outcome, the counters)
is the store's real code, over a real LMDB or real files."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest
import torch
from diskhelpers import hang_reads
from kvhelpers import CHUNK, make_kv, open_cache, tokens

from kvtier import CacheConfig, KVCache
from kvtier.errors import ConfigError
from kvtier.store import ChunkStore, Outcome

TIMEOUT = 0.8


@contextmanager
def _saved(tmp_path: Path, backend: str, n: int = 6) -> Iterator[tuple[KVCache, list[bytes]]]:
    """A store with ``n`` chunks on disk (the host tier emptied), reads timing out after
    ``TIMEOUT``: the cache and the chunks' keys."""
    toks = tokens(3, n * CHUNK)
    with open_cache(tmp_path / "s", backend, read_timeout_s=TIMEOUT, io_threads=2) as cache:
        cache.save(toks, make_kv(toks))
        assert cache.flush(30)
        cache.store.host.clear()
        yield cache, [ref.key for ref in cache.chunks(toks)]


def _stuck(store: ChunkStore, n: int) -> None:
    """Wait until ``n`` reads count as stuck: a read begins a moment after it is asked for,
    so it is past its timeout a moment after its caller's wait ended."""
    deadline = time.monotonic() + TIMEOUT
    while store._stuck_reads() < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store._stuck_reads() == n


def _settle(store: ChunkStore) -> None:
    deadline = time.monotonic() + 10
    while store._reads_since and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not store._reads_since


@pytest.mark.parametrize("backend", ["files", "lmdb"])
def test_a_hung_read_is_a_timed_out_miss_and_the_others_load(tmp_path: Path, backend: str) -> None:
    with _saved(tmp_path, backend) as (cache, keys):
        store = cache.store
        release = hang_reads(store, lambda k: k == keys[1])
        t = time.monotonic()
        got = list(store.load_many(keys))
        took = time.monotonic() - t
        assert [g.outcome for g in got] == [Outcome.HIT, Outcome.TIMED_OUT] + [Outcome.HIT] * 4
        assert "read_timeout_s (0.8 s)" in got[1].why and got[1].tensor is None
        assert TIMEOUT * 0.9 <= took < TIMEOUT + 3.0, took  # (it waited for the hung read: not forever)
        c = store.counters.snapshot()
        assert c["read_timeouts"] == 1 and c["corrupt_records"] == 0 and c["io_errors"] == 0
        _stuck(store, 1)
        release.set()
        _settle(store)
        # kept, not deleted: once the file system answers, the chunk loads
        again = store.load_many([keys[1]])
        assert next(again).outcome is Outcome.HIT


@pytest.mark.parametrize("backend", ["files", "lmdb"])
def test_reads_fail_at_once_while_every_io_thread_is_held(tmp_path: Path, backend: str) -> None:
    """With both I/O threads stuck, a load of many chunks does not wait a timeout per chunk,
    and the next load does not wait at all; the store recovers when the reads return."""
    with _saved(tmp_path, backend) as (cache, keys):
        store = cache.store
        release = hang_reads(store, lambda k: True)
        t = time.monotonic()
        got = list(store.load_many(keys))
        took = time.monotonic() - t
        assert [g.outcome for g in got] == [Outcome.TIMED_OUT] * 6
        assert took < 2 * TIMEOUT + 3.0, took  # (one timeout per chunk would be 6 of them)
        _stuck(store, 2)
        t = time.monotonic()
        late = list(store.load_many(keys[:3]))
        assert time.monotonic() - t < TIMEOUT / 2
        assert [g.outcome for g in late] == [Outcome.TIMED_OUT] * 3
        assert "all 2 I/O threads are held" in late[0].why and "file system hung" in late[0].why
        assert store.counters.snapshot()["read_timeouts"] == 9
        release.set()
        _settle(store)
        assert [g.outcome for g in store.load_many(keys)] == [Outcome.HIT] * 6


@pytest.mark.parametrize("backend", ["files", "lmdb"])
def test_a_caller_that_gave_up_leaves_no_wait_for_the_next(tmp_path: Path, backend: str) -> None:
    """A caller that stops at its first timed-out chunk (the connector's load, ``KVCache.load``)
    leaves its other reads running on the hung storage, unwaited for: they still count as
    holding their threads, so the next load fails at once instead of waiting a timeout
    (measured before this was counted: a full timeout per load, for good)."""
    with _saved(tmp_path, backend) as (cache, keys):
        store = cache.store
        release = hang_reads(store)
        with closing(store.load_many(keys)) as first:
            assert next(first).outcome is Outcome.TIMED_OUT
        _stuck(store, 2)  # (the other read, given up on by no one, counts too)
        t = time.monotonic()
        assert [g.outcome for g in store.load_many(keys[3:])] == [Outcome.TIMED_OUT] * 3
        assert time.monotonic() - t < TIMEOUT / 2
        release.set()
        _settle(store)


def test_chunks_in_memory_load_while_the_disk_hangs(tmp_path: Path) -> None:
    """What the host tier holds needs no read: it loads while every I/O thread is held."""
    with _saved(tmp_path, "files") as (cache, keys):
        store = cache.store
        assert next(store.load_many([keys[0]])).outcome is Outcome.HIT  # (now in the host tier)
        release = hang_reads(store)
        assert [g.outcome for g in store.load_many(keys[1:])] == [Outcome.TIMED_OUT] * 5
        _stuck(store, 2)
        t = time.monotonic()
        assert [g.outcome for g in store.load_many(keys[:2])] == [Outcome.HIT, Outcome.TIMED_OUT]
        assert time.monotonic() - t < TIMEOUT / 2
        release.set()
        _settle(store)


def test_reads_a_caller_stopped_taking_are_cancelled(tmp_path: Path) -> None:
    """A caller that stops taking results (a request aborted mid-load) leaves no reads queued:
    the ones not begun are cancelled."""
    with _saved(tmp_path, "files") as (cache, keys):
        store = cache.store
        began: list[bytes] = []
        release = hang_reads(store, lambda k: began.append(k) is None and len(began) <= 2)
        results = store.load_many(keys)
        first = next(results)  # two reads begin and hang; up to 4 queue behind them
        assert first.outcome is Outcome.TIMED_OUT
        results.close()
        release.set()
        _settle(store)
        time.sleep(0.2)
        assert len(began) == 2, began  # the queued ones never ran


@pytest.mark.parametrize("value", [0, -1, 3601, float("nan"), float("inf"), "10", True, None])
def test_a_bad_read_timeout_is_refused(tmp_path: Path, value: object) -> None:
    with pytest.raises(ConfigError, match=r"read_timeout_s: must be a number of seconds above 0 and at most 3600"):
        CacheConfig(path=tmp_path / "s", read_timeout_s=value)  # type: ignore[arg-type]


def test_the_library_load_returns_the_prefix_before_a_hung_read(tmp_path: Path) -> None:
    """``KVCache.load`` (through the host tier) of a prompt whose third chunk's read hangs
    returns its first two chunks, bit for bit, after one timeout."""
    with _saved(tmp_path, "lmdb") as (cache, keys):
        release = hang_reads(cache.store, lambda k: k == keys[2])
        toks = tokens(3, 6 * CHUNK)
        t = time.monotonic()
        got = cache.load(toks)
        took = time.monotonic() - t
        release.set()
        assert got.shape[2] == 2 * CHUNK
        assert torch.equal(got.view(torch.int16), make_kv(toks).narrow(2, 0, 2 * CHUNK).view(torch.int16))
        assert took < TIMEOUT + 3.0, took
        _settle(cache.store)
