"""Bounded resources: the persistent tier stays within its byte budget and evicts least
recently used records first; the host tier is an LRU within its budget; a full write queue
drops saves (counted) and never blocks the caller."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
from kvhelpers import CHUNK, config, make_kv, open_cache, same_bits, tokens

from kvtier import ChunkStore, KVCache, codec
from kvtier.backends.base import EVICT_LOW_WATERMARK
from kvtier.store import Outcome

CHUNK_BYTES = 2 * 2 * CHUNK * 4 * 32 * 2  # one bf16 chunk
RECORD = codec._FIXED.size + 8 * 5 + 8 + CHUNK_BYTES  # header + payload of one chunk


@pytest.fixture(params=["lmdb", "files"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def _seq(name: str, i: int) -> np.ndarray:
    return tokens({"A": 1000, "B": 2000}[name] + i, CHUNK)


def test_disk_budget_evicts_least_recently_used(tmp_path: Path, backend: str) -> None:
    store = tmp_path / "s"
    with open_cache(store, backend) as cache:  # the budget counts disk blocks or LMDB pages
        occupied = cache.store.backend.payloads.occupied(RECORD)
    budget = int(15.5 * occupied)  # 15 records fit; the 16th triggers eviction down to 90 % (13)

    def present(cache: KVCache, name: str, i: int) -> bool:
        """On disk (the host tier may still hold an evicted record)."""
        (ref,) = cache.chunks(_seq(name, i))
        return cache.store.backend.count_present_prefix([ref.key]) == 1

    with open_cache(store, backend, disk_bytes=budget) as cache:
        for i in range(15):  # one commit each: distinct last-use times, A0 oldest
            toks = _seq("A", i)
            cache.save(toks, make_kv(toks))
            assert cache.flush(10)
        assert cache.stats()["disk_records"] == 15 and cache.stats()["evicted_disk"] == 0

    with open_cache(store, backend, disk_bytes=budget) as cache:
        for i in (0, 1, 2):  # use the three oldest: they become the most recently used
            toks = _seq("A", i)
            assert same_bits(cache.load(toks), make_kv(toks))
        for j in range(10):
            toks = _seq("B", j)
            cache.save(toks, make_kv(toks))
            assert cache.flush(10)
            st = cache.stats()
            assert st["disk_bytes"] <= budget, st
            if j == 0:  # the first save over budget must already respect the loads above
                gone = [i for i in range(15) if not present(cache, "A", i)]
                assert gone == [3, 4, 5], f"evicted {gone}; LRU must spare the records just loaded"
        st = cache.stats()
        assert st["evicted_disk"] == 12 and st["disk_records"] == 13, st
        assert all(present(cache, "A", i) for i in (0, 1, 2))
        assert not any(present(cache, "A", i) for i in range(3, 15))
        assert all(present(cache, "B", j) for j in range(10))
        for j in range(10, 13):  # now the loaded ones are the oldest: they go next
            toks = _seq("B", j)
            cache.save(toks, make_kv(toks))
            assert cache.flush(10)
        assert not any(present(cache, "A", i) for i in (0, 1, 2))
        assert cache.stats()["disk_bytes"] <= budget
    with ChunkStore(config(store, backend, disk_bytes=budget)) as s:  # the on-disk truth
        records, nbytes = s.backend.usage()
        entries = list(s.backend.entries())
        assert (records, nbytes) == (len(entries), sum(e.size for e in entries)) == (13, 13 * RECORD)


def test_within_one_commit_the_least_recently_saved_go_first(tmp_path: Path, backend: str) -> None:
    """Saves that land in one group commit got one time: eviction then chose among them by
    key, at random (an audit kept prompts 0, 6 and 8 of ten). They are now ordered."""
    store = tmp_path / "s"
    with open_cache(store, backend) as cache:
        occupied = cache.store.backend.payloads.occupied(RECORD)
    with open_cache(store, backend, disk_bytes=int(8.5 * occupied)) as cache:
        prompts = [_seq("A", i) for i in range(20)]
        for toks in prompts:  # no flush between: one or a few commits
            cache.save(toks, make_kv(toks))
        assert cache.flush(30)
        kept = [i for i, toks in enumerate(prompts) if cache.lookup(toks)]
        assert cache.stats()["evicted_disk"] > 0
    assert kept == list(range(20 - len(kept), 20)), kept  # the newest, whatever their keys


def test_eviction_visits_a_chunk_moved_up_by_its_relatives_before_newer_chunks(tmp_path: Path,
                                                                               backend: str) -> None:
    """A chain's head is as recent as its newest chunk, so the walk moves it up the order
    and visits it again. It used to go on first through the rows it had already read, and
    evict a newer prompt (here the hot one) before the older chains' heads (a vLLM test
    lost two of a hot prompt's four chunks this way)."""
    store = tmp_path / "s"
    old = [tokens(3000 + i, 3 * CHUNK) for i in range(4)]
    hot = tokens(4000, 3 * CHUNK)
    with open_cache(store, backend) as cache:
        for toks in [*old, hot]:
            cache.save(toks, make_kv(toks))
            assert cache.flush(10)
        backend_ = cache.store.backend
        t0 = time.time_ns() - 10**9
        for i, toks in enumerate(old):  # each chunk of an old chain a little newer than its parent
            for j, ref in enumerate(cache.chunks(toks)):
                backend_.touch([ref.key], t0 + 10 * i + j)
        backend_.touch([ref.key for ref in cache.chunks(hot)], t0 + 1000)
        occupied = backend_.payloads.occupied(RECORD)
        backend_.evict_lru(6 * occupied)  # room for two prompts: the hot one and the newest old one
        assert cache.lookup(hot) == 3 * CHUNK
        assert cache.lookup(old[3]) == 3 * CHUNK
        assert [cache.lookup(toks) for toks in old[:3]] == [0, 0, 0]


def test_a_lowered_budget_holds_without_waiting_for_a_save(tmp_path: Path, backend: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer opened with a lower disk_bytes evicts down to it at once (least recently
    used first), not at its first commit: a server that only loads may never save (the
    store stayed at 359% of its budget in the operator audit). It evicts in steps, so as not
    to hold the index's write lock for a whole store's worth."""
    import kvtier.store
    from kvtier.backends import Backend

    commits = []
    real = Backend.evict_lru
    monkeypatch.setattr(Backend, "evict_lru", lambda self, target: commits.append(target) or real(self, target))
    store = tmp_path / "s"
    with open_cache(store, backend) as cache:
        for i in range(12):  # one commit each: A0 the least recently used
            toks = _seq("A", i)
            cache.save(toks, make_kv(toks))
            assert cache.flush(10)
        occupied = cache.store.backend.occupied()
    monkeypatch.setattr(kvtier.store, "_ENFORCE_STEP_BYTES", 2 * occupied // 12)  # two records a step
    with open_cache(store, backend, disk_bytes=occupied // 2) as cache:
        def kept_now() -> list[int]:
            return [i for i in range(12) if cache.lookup(_seq("A", i))]

        # done once under the low watermark, and counted (after the payloads are removed):
        # half the budget is passed a step before the eviction ends
        low = int(occupied // 2 * EVICT_LOW_WATERMARK)
        deadline = time.monotonic() + 20
        while ((cache.store.backend.occupied() > low or cache.stats()["evicted_disk"] != 12 - len(kept_now()))
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert cache.store.backend.occupied() <= low
        kept = kept_now()
        assert kept == list(range(12 - len(kept), 12)) and 0 < len(kept) < 6, kept  # the newest
        assert cache.stats()["evicted_disk"] == 12 - len(kept) and cache.stats()["saves_committed"] == 0
        assert len(commits) >= 3, commits


def test_host_tier_is_an_lru_within_budget(tmp_path: Path, backend: str) -> None:
    kv = {i: make_kv(tokens(i, CHUNK)) for i in range(5)}
    keys = {i: bytes([i]) * 32 for i in range(5)}
    with ChunkStore(config(tmp_path / "s", backend, host_bytes=3 * CHUNK_BYTES)) as store:
        def put(i: int) -> None:
            assert store.put(keys[i], kv[i].clone(), namespace_id=bytes(16), token_start=0,
                             num_tokens=CHUNK)
            assert store.flush(10)

        for i in range(3):
            put(i)
        assert store.get(keys[0]) is not None  # 0 is now the most recent; 1 the least
        put(3)
        assert [k in store.host for k in (keys[0], keys[1], keys[2], keys[3])] == [True, False, True, True]
        assert store.host.nbytes <= 3 * CHUNK_BYTES and store.counters.evicted_host == 1
        assert same_bits(store.get(keys[1]), kv[1])  # evicted from RAM, still on disk
        assert store.counters.hits_disk == 1 and keys[1] in store.host and keys[2] not in store.host
        assert store.host.nbytes <= 3 * CHUNK_BYTES
        big = make_kv(tokens(9, 4 * CHUNK))  # bigger than the whole host budget: not kept in RAM
        assert store.put(b"\x09" * 32, big, namespace_id=bytes(16), token_start=0, num_tokens=4 * CHUNK)
        assert store.flush(10)
        assert b"\x09" * 32 not in store.host and len(store.host) == 3
        assert same_bits(store.get(b"\x09" * 32), big)


def test_full_write_queue_drops_saves_without_blocking(tmp_path: Path, backend: str) -> None:
    with open_cache(tmp_path / "s", backend, write_queue_bytes=4 * CHUNK_BYTES) as cache:
        store = cache.store
        kv = make_kv(tokens(0, CHUNK))
        keys = [bytes([i]) * 32 for i in range(12)]
        store.backend._write_lock.acquire()  # the disk "hangs": the writer thread blocks in put_many
        try:
            accepted, slowest = [], 0.0
            for k in keys:
                t0 = time.monotonic()
                accepted.append(store.put(k, kv.clone(), namespace_id=bytes(16), token_start=0,
                                          num_tokens=CHUNK))
                slowest = max(slowest, time.monotonic() - t0)
            assert accepted == [True] * 4 + [False] * 8
            assert store.counters.dropped_saves == 8
            assert slowest < 0.5, f"put() blocked for {slowest:.3f}s"
            toks = tokens(1, 3 * CHUNK)
            t0 = time.monotonic()
            assert cache.save(toks, make_kv(toks)) == 0  # library API: nothing queued, no wait
            assert time.monotonic() - t0 < 0.5
            assert store.counters.dropped_saves == 11
            t0 = time.monotonic()
            assert store.flush(timeout=0.2) is False  # a bounded wait is honoured
            assert time.monotonic() - t0 < 2.0
        finally:
            store.backend._write_lock.release()
        assert store.flush(10)
        on_disk = [store.backend.count_present_prefix([k]) for k in keys]
        assert on_disk == [1] * 4 + [0] * 8
        assert cache.lookup(toks) == 0
        assert cache.stats()["saves_committed"] == 4


def test_payloads_a_removal_could_not_free_are_freed_by_the_next(tmp_path: Path, backend: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Evicted records' bytes are removed after the index commit that hid them. If that
    removal fails (a full disk: LMDB needs free pages to commit it), the batch is still
    stored and counted so, and the bytes are freed by the next removal that works, or at
    the latest by the store's close: nothing else names them (the orphan sweep runs only
    after a writer died)."""
    import errno
    import os

    import lmdb

    from kvtier.backends import files as files_backend
    from kvtier.backends.lmdb import LmdbPayloads

    store = tmp_path / "s"
    with open_cache(store, backend) as cache:
        occupied = cache.store.backend.payloads.occupied(RECORD)
    with open_cache(store, backend, disk_bytes=int(10.5 * occupied)) as cache:
        b = cache.store.backend

        def stored_payloads() -> int:
            return sum(1 for _ in b.payloads.found())

        for i in range(10):
            cache.save(_seq("A", i), make_kv(_seq("A", i)))
        assert cache.flush(30)
        real_unlink = os.unlink

        def full_disk_unlink(path: str, *a: object, **kw: object) -> None:
            if str(path).endswith(".kvt"):
                raise OSError(errno.EIO, "Input/output error", path)
            real_unlink(path, *a, **kw)

        def full_disk_remove(self: LmdbPayloads, records: list) -> None:
            raise lmdb.DiskError("mdb_txn_commit: No space left on device")

        with monkeypatch.context() as m:
            if backend == "files":
                m.setattr(files_backend.os, "unlink", full_disk_unlink)
            else:
                m.setattr(LmdbPayloads, "_remove", full_disk_remove)
            for i in range(5):
                cache.save(_seq("B", i), make_kv(_seq("B", i)))
            assert cache.flush(30)
            stats = cache.store.counters.snapshot()
            assert stats["saves_committed"] == 15 and stats["dropped_saves"] == 0 and stats["io_errors"] == 0
            assert all(cache.lookup(_seq("B", i)) == CHUNK for i in range(5))
            assert stored_payloads() > b.usage()[0]  # evicted, not yet removed
        cache.save(_seq("B", 5), make_kv(_seq("B", 5)))  # the disk has room again
        assert cache.flush(30)
        assert stored_payloads() == b.usage()[0]
        # With no removal after it, the store's close tries once more (no other process
        # knows of them: they stayed on the disk for good)
        with monkeypatch.context() as m:
            if backend == "files":
                m.setattr(files_backend.os, "unlink", full_disk_unlink)
            else:
                m.setattr(LmdbPayloads, "_remove", full_disk_remove)
            for i in range(6, 9):
                cache.save(_seq("B", i), make_kv(_seq("B", i)))
            assert cache.flush(30)
            assert stored_payloads() > b.usage()[0]
    with open_cache(store, backend) as cache:
        b = cache.store.backend
        assert stored_payloads() == b.usage()[0]


def test_shard_directories_emptied_by_removals_are_removed(tmp_path: Path) -> None:
    """The files backend's record directories (two levels, 65,792 at most, about 257 MiB on
    ext4 whatever the store holds) go when removals empty them; a writer whose directory is
    removed between its creation and the rename creates it again."""
    store = tmp_path / "s"
    with open_cache(store, "files") as cache:
        for i in range(20):
            toks = _seq("A", i)
            cache.save(toks, make_kv(toks))
        assert cache.flush(30)
        data = store / "files"
        assert len([d for d in data.rglob("*") if d.is_dir()]) > 20
        b = cache.store.backend
        assert b.evict_lru(0)[0] == 20
        assert sorted(p.name for p in data.iterdir()) == ["tmp"], "emptied shard directories were left"

        payloads = b.payloads
        shard_dirs = payloads._shard_dirs
        raced = []

        def make_then_lose(record: str, *, create: bool) -> set[str]:  # another process empties and removes it
            changed = shard_dirs(record, create=create)
            if create and not raced:
                raced.append(record)
                payloads._remove_empty({os.path.dirname(record)})
            return changed

        payloads._shard_dirs = make_then_lose
        toks = _seq("B", 0)
        cache.save(toks, make_kv(toks))
        assert cache.flush(30)
        assert raced and cache.stats()["dropped_saves"] == 0
        assert b.present_each([ref.key for ref in cache.chunks(toks)]) == [True]  # on disk
        assert same_bits(cache.load(toks), make_kv(toks))


def test_a_shard_directory_that_is_a_link_out_of_the_store_is_never_written_read_or_emptied(
        tmp_path: Path) -> None:
    """A store prepared by someone else may hold a symlink where a record directory belongs.
    kvtier writes no record through it (the save is dropped and counted), reads none through
    it (an I/O error, not a hit), and its removals delete nothing behind it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    kv = make_kv(tokens(7, CHUNK))
    first, second = b"\xab\xcd" + bytes(30), b"\xab\xcd" + b"\x01" * 30  # (one shard)
    with ChunkStore(config(tmp_path / "s", "files")) as store:
        assert store.put(first, kv.clone(), namespace_id=bytes(16), token_start=0, num_tokens=CHUNK)
        assert store.flush(30)
        shard = store.backend.payloads.path_of(first, store.backend.lookup(first).location).parent
    shard.rename(outside / "shard")  # the record now lies outside, behind a link
    shard.symlink_to(outside / "shard", target_is_directory=True)
    behind = sorted((outside / "shard").iterdir())
    assert len(behind) == 1
    with ChunkStore(config(tmp_path / "s", "files")) as store:
        got = store.load(first)
        assert got.tensor is None and got.outcome == Outcome.IO_ERROR and "link out of the store" in got.why
        assert store.put(second, kv.clone(), namespace_id=bytes(16), token_start=0, num_tokens=CHUNK)
        assert store.flush(30)
        assert store.counters.snapshot()["dropped_saves"] == 1
        assert store.backend.lookup(second) is None
        store.backend.evict_lru(0)
    assert sorted((outside / "shard").iterdir()) == behind  # nothing written there, nothing removed
    assert same_bits(codec.decode(behind[0].read_bytes(), expect_key=first)[1], kv)
