"""The store's shared index as the one source of truth, with real processes and real files:
what one process evicts, no other process still promises; budgets hold across writers;
eviction keeps chains and tensor-parallel rank tuples whole and respects leases; a record
over one process's size limit is another process's, never deleted as corrupt."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

import pytest
from kvhelpers import CHUNK, Zygote, config, make_kv, open_cache, same_bits, tokens

from kvtier import ChunkStore, codec
from kvtier.backends import Backend, PutItem
from kvtier.backends.index import NO_KEY, chain_key
from kvtier.store import Outcome
from kvtier.store_view import StoreView

TOKS = tokens(5, 6 * CHUNK)


@pytest.fixture(params=["lmdb", "files"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def test_eviction_by_another_process_is_seen_at_once(zygote: Zygote, tmp_path: Path, backend: str) -> None:
    """A scheduler view and a worker's store, both open before another process evicts, report
    only what is left, and everything they report loads; the worker does not skip saving a
    chunk that is gone from the store but still in its own memory."""
    store = tmp_path / "s"
    with open_cache(store, backend) as cache:
        cache.save(TOKS, make_kv(TOKS))
        assert cache.flush(30)
        keys = [c.key for c in cache.chunks(TOKS)]
        spans = [(c.start, c.key) for c in cache.chunks(TOKS)]
        view = StoreView(config(store, backend))
        try:
            assert view.count_present_chain(keys[0], spans) == 6
            half = cache.store.backend.occupied() // 2
            rep = zygote.request("call", fn="evict_store",
                                 kwargs={"path": str(store), "backend": backend, "target_bytes": half})
            assert rep["evicted"] == 3, rep
            # the chain's tail went first: the head still serves a 3-chunk prefix
            assert view.count_present_chain(keys[0], spans) == 3
            assert cache.store.count_present_prefix(keys) == 3
            assert cache.lookup(TOKS) == 3 * CHUNK
            for k in keys[:3]:
                assert cache.store.load(k).outcome is Outcome.HIT
            # the evicted chunks are still in this process's host tier, but not stored: saved again
            assert keys[5] in cache.store.host
            assert cache.save(TOKS, make_kv(TOKS)) == 3 * CHUNK
            assert cache.flush(30)
            assert view.count_present_chain(keys[0], spans) == 6
        finally:
            view.close()
    with open_cache(store, backend) as cache:
        assert same_bits(cache.load(TOKS), make_kv(TOKS))


def _item(key: bytes, i: int, parent: bytes | None = None, group: bytes | None = None) -> PutItem:
    kv = make_kv(tokens(100 + i, CHUNK))
    header, payload = codec.encode(kv, key=key, namespace_id=bytes(16), token_start=0, num_tokens=CHUNK)
    return PutItem(key, header, payload, bytes(16), group=group, parent=parent)


def _key(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def test_a_chunk_whose_parent_is_gone_by_its_commit_is_left_out(tmp_path: Path, backend: str) -> None:
    """A save planned while the chunk it extends was stored, committed after that chunk was
    evicted, could never be found (a lookup walks a prompt's chunks from its first): it is
    left out and its payload removed, instead of outliving its chain as a chain of its own
    (the engine audit found such chunks holding a small budget while their prompts missed)."""
    with ChunkStore(config(tmp_path / "s", backend)) as store:
        b = store.backend
        a0, a1, a2, gone = (_key(n) for n in ("a0", "a1", "a2", "gone"))
        res = b.put_many([_item(a1, 1, parent=gone), _item(a0, 0), _item(a2, 2, parent=a1)])
        assert [e.key for e in res.unreachable] == [a1, a2]  # a2 extends a1, which is left out too
        assert b.present_each([a0, a1, a2]) == [True, False, False]
        assert b.usage()[0] == 1
        # with its parent stored (or published before it in the same commit) it is kept
        res = b.put_many([_item(a1, 1, parent=a0), _item(a2, 2, parent=a1)])
        assert res.unreachable == [] and b.present_each([a0, a1, a2]) == [True, True, True]
    if backend == "files":  # no payload file was left behind for the chunks left out
        assert len(list((tmp_path / "s" / "files").rglob("*.kvt"))) == 3
    with ChunkStore(config(tmp_path / "s", backend)) as store:  # through the write queue: counted
        kv = make_kv(tokens(7, CHUNK))
        assert store.put(_key("late"), kv, namespace_id=bytes(16), token_start=CHUNK, num_tokens=CHUNK,
                         parent=gone, head=a0)
        assert store.flush(30)
        st = store.stats()
        assert st["saves_unreachable"] == 1 and st["saves_committed"] == 0 and st["disk_records"] == 3


def test_eviction_keeps_chains_and_rank_tuples_whole(tmp_path: Path, backend: str) -> None:
    """LRU alone would evict a chain's old head and strand its newer tail, or split a chunk's
    ranks; the index evicts a tail before its head and every rank of a chunk together."""
    with ChunkStore(config(tmp_path / "s", backend)) as store:
        b = store.backend
        a0, a1, a2, x, r0, r1, y = (_key(n) for n in ("a0", "a1", "a2", "x", "r0", "r1", "y"))
        b.put_many([_item(a0, 0), _item(a1, 1, parent=a0), _item(a2, 2, parent=a1), _item(x, 3),
                    _item(r0, 4, group=r0), _item(r1, 5, group=r0), _item(y, 6)])
        # last uses: the head a0 oldest, its tail newest; rank 0 of a chunk old, rank 1 new
        for t, k in enumerate((a0, r0, x, y, a1, a2, r1), start=1):
            b.touch([k], t)
        one, size = b.occupied() // 7, b.lookup(x).size
        # Evicting one record's worth: a0 and r0 are the oldest, but each is as recent as
        # its newest relative, so x goes.
        assert b.evict_lru(6 * one) == (1, size)
        present = {k for k in (a0, a1, a2, x, r0, r1, y) if b.count_present_prefix([k])}
        assert present == {a0, a1, a2, r0, r1, y}
        # Down to two records: y (last use 4) goes, then the whole chain (as recent as its
        # tail, 6), before the rank pair (7).
        n, _ = b.evict_lru(2 * one)
        present = {k for k in (a0, a1, a2, r0, r1, y) if b.count_present_prefix([k])}
        assert present == {r0, r1}, present
        assert n == 4
        # The pair goes together, never one rank alone.
        assert b.evict_lru(one)[0] == 2
        assert b.usage() == (0, 0)


def test_a_leased_chain_survives_eviction_until_the_lease_ends(zygote: Zygote, tmp_path: Path,
                                                               backend: str) -> None:
    """Chunks promised to a load (a lease on the last one) are kept, with the head they
    extend, whatever another process evicts; an expired lease protects nothing."""
    store = tmp_path / "s"
    other = tokens(6, 2 * CHUNK)
    with open_cache(store, backend) as cache:
        cache.save(TOKS, make_kv(TOKS))
        cache.save(other, make_kv(other))
        assert cache.flush(30)
        keys = [c.key for c in cache.chunks(TOKS)]
        spans = [(c.start, c.key) for c in cache.chunks(TOKS)]
        view = StoreView(config(store, backend))
        try:
            mine = view.lease(keys[-1:], 60.0)  # (written on the view's own thread, as releases are)
            assert mine.result(10)
            rep = zygote.request("call", fn="evict_store",
                                 kwargs={"path": str(store), "backend": backend, "target_bytes": 0})
            assert rep["evicted"] == 2, rep  # only the unleased prompt
            assert view.count_present_chain(keys[0], spans) == 6
            assert view.lease(keys[-1:], 0.0).result(10) == {}  # a lease only ever grows: this changes nothing
            assert zygote.request("call", fn="evict_store", kwargs={
                "path": str(store), "backend": backend, "target_bytes": 0})["evicted"] == 0
            # A second load of the prompt (another server) leases it too and ends first: the
            # first's lease is in force again. Once that ends too, eviction takes the chain.
            # (Releases run on the view's own thread: wait for each to land.)
            second = view.lease(keys[-1:], 90.0)
            view.release(second)
            _wait_for_lease(view.backend, keys[-1], mine.result()[keys[-1]][0])
            assert zygote.request("call", fn="evict_store", kwargs={
                "path": str(store), "backend": backend, "target_bytes": 0})["evicted"] == 0
            view.release(mine)
            _wait_for_lease(view.backend, keys[-1], 0)
            assert zygote.request("call", fn="evict_store", kwargs={
                "path": str(store), "backend": backend, "target_bytes": 0})["evicted"] == 6
        finally:
            view.close()
        # a lease is a time: once it has passed, the chain can go
        b = cache.store.backend
        short = [c.key for c in cache.chunks(other)]
        cache.save(TOKS, make_kv(TOKS))
        cache.save(other, make_kv(other))
        assert cache.flush(30)
        held = b.lease(keys[-1:], 60.0)
        b.lease(short[-1:], 0.05)
        time.sleep(0.1)
        assert b.evict_lru(b.occupied() - 2 * (b.occupied() // 8))[0] == 2
        assert b.count_present_prefix(short) == 0 and b.count_present_prefix(keys) == 6
        # Ended in either order, a release leaves the key leased until the longest lease
        # another holder still has, and free once none has
        k = keys[-1]
        first, later = b.lease(keys[-1:], 90.0), b.lease(keys[-1:], 120.0)
        b.release(first)
        assert b.lookup(k).lease_until_ns == later[k][0]
        b.release(later)
        assert b.lookup(k).lease_until_ns == held[k][0]  # the 60 s lease is still held
        b.release(held)
        assert b.lookup(k).lease_until_ns == 0
        first, later = b.lease(keys[-1:], 90.0), b.lease(keys[-1:], 120.0)
        b.release(later)
        assert b.lookup(k).lease_until_ns == first[k][0]
        b.release(first)
        assert b.lookup(k).lease_until_ns == 0
        assert b.evict_lru(0)[0] == 6


def test_two_servers_loading_one_prompt_free_it_when_both_are_done(zygote: Zygote, tmp_path: Path,
                                                                    backend: str) -> None:
    """Two servers promise one prompt to a load at once, and the one that leased it first
    finishes first: once the second finishes too, eviction may take the prompt at once (it
    used to stay leased until the first lease's end, up to 120 s); the index keeps no row of
    a finished or evicted lease."""
    store = tmp_path / "s"
    with open_cache(store, backend) as cache:
        cache.save(TOKS, make_kv(TOKS))
        assert cache.flush(30)
        keys = [c.key for c in cache.chunks(TOKS)]
        k = keys[-1]
        b = cache.store.backend

        def evict_all() -> int:
            return zygote.request("call", fn="evict_store", kwargs={
                "path": str(store), "backend": backend, "target_bytes": 0})["evicted"]

        def other_server(**kw: object) -> dict:
            return zygote.request("call", fn="lease_keys", kwargs={
                "path": str(store), "backend": backend, "keys": [k.hex()], **kw})

        mine = b.lease([k], 60.0)
        theirs = other_server(seconds=90.0)["held"]
        assert b.lookup(k).lease_until_ns == theirs[k.hex()][0]
        b.release(mine)  # the first to lease finishes first
        assert b.lookup(k).lease_until_ns == theirs[k.hex()][0]
        assert evict_all() == 0
        other_server(seconds=0.0, release=theirs)
        assert b.lookup(k).lease_until_ns == 0
        assert _lease_rows(b) == 0
        assert evict_all() == 6
        # a server that dies holding a lease: it runs out by itself, and eviction, or the
        # next release of the key, drops its row
        cache.save(TOKS, make_kv(TOKS))
        assert cache.flush(30)
        other_server(seconds=0.2)
        b.release(b.lease([k], 0.1))
        assert _lease_rows(b) == 1
        time.sleep(0.25)
        assert evict_all() == 6
        assert _lease_rows(b) == 0
        # a damaged row (bit rot) is dropped by the next release of its key, not raised
        cache.save(TOKS, make_kv(TOKS))
        assert cache.flush(30)
        with b.index.env.txn(write=True) as txn:
            txn.put(k, b"\x01\x02\x03", db=b.index._leases)
        held = b.lease([k], 60.0)
        b.release(held)
        assert b.lookup(k).lease_until_ns == 0 and _lease_rows(b) == 0


def test_an_index_from_before_the_leases_database_opens_and_leases(tmp_path: Path, backend: str) -> None:
    """A store whose index an older kvtier wrote (no ``leases`` database) opens read-only as
    before (the CLI), and a writer's open adds the database."""
    import lmdb

    from kvtier.backends.index import INDEX_DIR, StoreIndex

    store = tmp_path / "s"
    with open_cache(store, backend) as cache:
        cache.save(TOKS, make_kv(TOKS))
        assert cache.flush(30)
        keys = [c.key for c in cache.chunks(TOKS)]
    env = lmdb.open(str(store / INDEX_DIR), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"leases", txn=txn, dupsort=True), delete=True)
    env.close()
    index = StoreIndex(store, readonly=True)
    try:
        assert index.present_prefix(keys) == 6
    finally:
        index.close()
    with ChunkStore(config(store, backend)) as writer:
        b = writer.backend
        held = b.lease(keys[-1:], 60.0)
        assert _lease_rows(b) == 1
        b.release(held)
        assert b.lookup(keys[-1]).lease_until_ns == 0
        # an older kvtier's lease (the entry's time, no row; here 100 s) outlives the release
        # of a newer, longer one taken after it, and of a shorter one
        k, old_until = keys[-1], time.time_ns() + 100 * 10**9
        with b.index.env.txn(write=True) as txn:
            txn.put(k, dataclasses.replace(b.lookup(k), lease_until_ns=old_until).pack(), db=b.index._entries)
        for seconds in (120.0, 30.0):
            b.release(b.lease([k], seconds))
            assert b.lookup(k).lease_until_ns == old_until, seconds


def _lease_rows(backend: Backend) -> int:
    index = backend.index
    with index.env.txn() as txn:
        return txn.stat(index._leases)["entries"]


def test_a_lease_never_waits_for_the_index_writer(tmp_path: Path, backend: str) -> None:
    """vLLM's scheduler leases the chunks it promises to a load. The lease is an index write,
    which waits for any other commit (another server's eviction, at its budget): it is
    written on the view's own thread, and lease() returns at once; it lands once the writer
    is free, and a release asked meanwhile comes after it."""
    import threading

    store = tmp_path / "s"
    with open_cache(store, backend) as cache:
        cache.save(TOKS, make_kv(TOKS))
        assert cache.flush(30)
        k = cache.chunks(TOKS)[-1].key
    view = StoreView(config(store, backend))
    try:
        env = view.backend.index.env.env_now()
        holding, free = threading.Event(), threading.Event()

        def hold_the_writer() -> None:  # (another commit, a long one)
            with env.begin(write=True):
                holding.set()
                free.wait(10)

        holder = threading.Thread(target=hold_the_writer)
        holder.start()
        assert holding.wait(10)
        held = view.lease([k], 60.0)
        second = view.lease([k], 90.0)
        view.release(second)
        # (returned while the other commit still holds the writer: free is set only below)
        assert holder.is_alive()
        time.sleep(0.2)
        assert not held.done() and view.backend.lookup(k).lease_until_ns == 0
        free.set()
        holder.join(10)
        assert held.result(10)
        _wait_for_lease(view.backend, k, held.result()[k][0])  # the 90 s lease came and went
    finally:
        view.close()


def _wait_for_lease(backend: Backend, key: bytes, until_ns: int) -> None:
    deadline = time.monotonic() + 10
    while backend.lookup(key).lease_until_ns != until_ns and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.lookup(key).lease_until_ns == until_ns


def _record_file_bytes(store: Path) -> int:
    """Bytes of the record files on disk now (files come and go meanwhile)."""
    total = 0
    # (os.walk, not rglob: a record directory a removal emptied may go while it is walked)
    for dirpath, _, names in os.walk(store / "files"):
        for name in names:
            if name.endswith(".kvt"):
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    continue
    return total


def test_writers_in_several_processes_share_one_budget(zygote: Zygote, tmp_path: Path, backend: str) -> None:
    """Four writer processes (two servers with two tensor-parallel ranks each) under one
    budget: the bytes the index publishes stay within it, the files on disk within it plus
    each writer's batch in flight; and in every snapshot taken while they evict, each chunk
    of an earlier server is whole on both ranks and has its chain's head."""
    store = tmp_path / "s"
    budget = 2 << 20
    batch = 128 << 10
    roomy = {"disk_bytes": "64M", "commit_bytes": batch}
    tight = {"disk_bytes": budget, "commit_bytes": batch}
    # Server 1 fills most of the budget: 8 prompts x 3 chunks x 2 ranks (about 1.7 MiB).
    first = [{"fn": "ranked_writer", "kwargs": {"path": str(store), "backend": backend, "server": 1,
                                                 "rank": r, "tp": 2, "prompts": list(range(8)), "cfg": roomy}}
             for r in (0, 1)]
    for rep in zygote.request("parallel", calls=first, timeout=120):
        assert "error" not in rep, rep
    with ChunkStore(config(store, backend, **roomy), readonly=True) as s:
        full = {e.key: e for e in s.backend.entries()}
    assert len(full) == 48
    ranks = {}
    for k, e in full.items():
        ranks.setdefault(e.group, set()).add(k)
    assert all(len(v) == 2 for v in ranks.values())

    # Four processes then write under the tight budget at once; sample the store meanwhile.
    samples: list[tuple[int, int]] = []
    problems: list[str] = []
    seen_partial = [0]
    stop = threading.Event()

    def check(present: set[bytes]) -> None:
        mine = present & full.keys()
        if 0 < len(mine) < len(full):
            seen_partial[0] += 1
        for k in mine:
            e = full[k]
            if not ranks[e.group] <= present:
                problems.append(f"rank tuple split: {k.hex()[:8]}")
            if e.parent != NO_KEY and e.parent not in present:
                problems.append(f"chain head gone before its tail: {k.hex()[:8]}")

    def sample() -> None:
        with ChunkStore(config(store, backend, **tight), readonly=True) as s:
            while not stop.is_set():
                on_disk = _record_file_bytes(store) if backend == "files" else 0
                samples.append((s.backend.occupied(), on_disk))
                check({e.key for e in s.backend.entries()})
                time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    start = time.time() + 0.5
    calls = [{"fn": "ranked_writer", "kwargs": {"path": str(store), "backend": backend, "server": srv,
                                                 "rank": r, "tp": 2, "prompts": list(range(20)),
                                                 "cfg": tight, "start_at": start}}
             for srv in (2, 3) for r in (0, 1)]
    sampler.start()
    try:
        reps = zygote.request("parallel", calls=calls, timeout=180)
    finally:
        stop.set()
        sampler.join()
    for rep in reps:
        assert "error" not in rep, rep
    assert sum(r["stats"]["evicted_disk"] for r in reps) > 0
    assert not problems, problems[:5]
    assert seen_partial[0] > 0, "no snapshot caught the first server's chunks partly evicted"
    assert max(occ for occ, _ in samples) <= budget, max(samples)
    if backend == "files":
        assert max(disk for _, disk in samples) <= budget + 4 * batch, max(samples)
    with ChunkStore(config(store, backend, **tight), readonly=True) as s:
        check({e.key for e in s.backend.entries()})
        assert s.backend.occupied() <= budget
    assert not problems, problems[:5]


def test_a_smaller_record_limit_keeps_larger_records(tmp_path: Path, backend: str) -> None:
    """A process with a smaller max_record_bytes skips a larger (intact) record as too large,
    and never deletes it; `kvtier verify --remove-corrupt` keeps it too."""
    from kvtier.cli.main import main

    store = tmp_path / "s"
    toks = tokens(9, CHUNK)
    with open_cache(store, backend) as cache:
        cache.save(toks, make_kv(toks))
        (ref,) = cache.chunks(toks)
    record = 8 + CHUNK * 512 * 2  # well over 4 KiB
    assert record > 8 << 10
    # (a store, not a KVCache: a KVCache whose chunks cannot fit its limit is refused)
    with ChunkStore(config(store, backend, max_record_bytes="8K")) as small:
        got = small.load(ref.key)
        assert got.outcome is Outcome.TOO_LARGE and got.tensor is None
        assert "max_record_bytes" in got.why
        st = small.counters.snapshot()
        assert st["oversized_records"] == 1 and st["corrupt_records"] == 0 and st["misses"] == 1
        assert small.backend.count_present_prefix([ref.key]) == 1
    # the CLI reads the store's recorded settings (the last writer's: 8K) and keeps the record
    assert main(["verify", str(store), "--remove-corrupt", "--json"]) == 0
    with open_cache(store, backend) as cache:
        assert cache.store.load(ref.key).outcome is Outcome.HIT
        assert same_bits(cache.load(toks), make_kv(toks))


def test_settings_are_stored_with_the_store(tmp_path: Path, backend: str, caplog: pytest.LogCaptureFixture
                                            ) -> None:
    """The budget and limits every process uses are the ones recorded in the store; a writer
    that changes them says so."""
    from kvtier.backends import stored_config

    store = tmp_path / "s"
    with open_cache(store, backend, disk_bytes="3M", max_record_bytes="2M"):
        pass
    cfg = stored_config(store, backend)
    assert (cfg.disk_bytes, cfg.max_record_bytes, cfg.chunk_tokens) == (3 << 20, 2 << 20, CHUNK)
    with caplog.at_level("WARNING", logger="kvtier"), open_cache(store, backend, disk_bytes="5M") as c:
        assert c.store.backend.budget() == 5 << 20
    assert "disk_bytes 3145728 -> 5242880" in caplog.text
    # A writer that opened with a roomy budget obeys the one a later writer recorded: each
    # commit reads it from the store.
    with open_cache(store, backend, disk_bytes="64M") as roomy:
        with open_cache(store, backend, disk_bytes="200K"):
            pass
        for i in range(20):
            toks = tokens(300 + i, CHUNK)
            roomy.save(toks, make_kv(toks))
            assert roomy.flush(30)
        assert roomy.stats()["evicted_disk"] > 0
        assert roomy.store.backend.occupied() <= 200 << 10


def test_a_writer_opened_with_defaults_keeps_the_stores_settings(
        tmp_path: Path, backend: str, caplog: pytest.LogCaptureFixture) -> None:
    """A server restarted (or a second one started) with only a path must not replace the
    budget the servers chose with the 64G default: every writer evicts down to the store's
    budget, so that would throw most of a large store away."""
    from kvtier.backends import stored_config
    from kvtier.vllm.settings import ConnectorSettings

    store = tmp_path / "s"
    with open_cache(store, backend, disk_bytes="3M", compression="zstd"):
        pass
    only_path = ConnectorSettings.from_extra_config(
        {"path": str(store), "backend": backend, "chunk_tokens": CHUNK}).cache
    assert only_path.disk_bytes == 64 << 30 and "disk_bytes" not in only_path.chosen
    with caplog.at_level("WARNING", logger="kvtier"), ChunkStore(only_path) as st:
        assert st.backend.budget() == 3 << 20
    # how it writes is recorded as it is (what warm-up and the CLI follow); the budget is kept
    assert "compression 'zstd' -> 'none'" in caplog.text and "disk_bytes" not in caplog.text
    cfg = stored_config(store, backend)
    assert (cfg.disk_bytes, cfg.compression) == (3 << 20, "none")
    # warm-up follows how the servers write, and copies no limit it would then put back
    # over one a server changed while warm-up's engine started
    from kvtier.warmup import with_store_settings

    assert with_store_settings({"path": str(store)}) == {
        "path": str(store), "chunk_tokens": CHUNK, "compression": "none", "durability": "process"}
    # chosen settings survive a copy with another path (what KVCache.open makes)
    assert config(store, backend).replaced(path=tmp_path / "t").chosen == {
        "path", "backend", "chunk_tokens", "io_threads"}
    # a new store records the first writer's values, defaults included (tools read them)
    fresh = tmp_path / "fresh"
    with ChunkStore(config(fresh, backend)):
        pass
    assert stored_config(fresh, backend).disk_bytes == 64 << 30


def test_stats_report_each_budget_beside_its_usage(tmp_path: Path, backend: str) -> None:
    """stats() gave usage only, so a user or a dashboard could not tell how full a store is.
    Each budget is reported beside its usage: the host tier's and the write queue's from the
    config; the disk's from the store (the one every writer evicts to, also for a process
    opened without disk_bytes), with what it bounds (occupied bytes); after close too."""
    store, toks = tmp_path / "s", tokens(6, 3 * CHUNK)
    with open_cache(store, backend, disk_bytes="3M", host_bytes="2M", write_queue_bytes="1M") as cache:
        cache.save(toks, make_kv(toks))
        assert cache.flush(30)
        st = cache.stats()
        assert (st["host_budget_bytes"], st["queue_budget_bytes"], st["disk_budget_bytes"]) == (
            2 << 20, 1 << 20, 3 << 20)
        assert 0 < st["host_bytes"] <= st["host_budget_bytes"] and st["disk_records"] == 3
        assert (st["remote_queued_bytes"], st["remote_queue_budget_bytes"]) == (0, 0)  # no remote tier
        # the budget bounds whole blocks or pages, more than the record bytes
        assert st["disk_occupied_bytes"] == cache.store.backend.occupied() > st["disk_bytes"] > 0
    cache = open_cache(store, backend)  # disk_bytes not given: the store's 3M holds, not 64G
    assert cache.store.config.disk_bytes == 64 << 30
    before = cache.stats()
    cache.close()
    after = cache.stats()
    disk = ("disk_records", "disk_bytes", "disk_occupied_bytes", "disk_budget_bytes")
    assert [after[k] for k in disk] == [before[k] for k in disk] == [
        3, st["disk_bytes"], st["disk_occupied_bytes"], 3 << 20]
    assert (after["host_budget_bytes"], after["queue_budget_bytes"]) == (1 << 30, 256 << 20)


def test_warmup_takes_chunk_tokens_from_the_models_own_servers(tmp_path: Path, backend: str) -> None:
    """The recorded chunk_tokens is the newest writer's, which may be a library user who
    opened the store with the default: warm-up follows the namespaces the model's servers
    registered instead (else its keys would not be theirs)."""
    from kvhelpers import namespace

    from kvtier import CacheConfig
    from kvtier.warmup import with_store_settings

    store = tmp_path / "s"
    open_cache(store, backend, ns=namespace(model="served", chunk_tokens=CHUNK)).close()
    ChunkStore(CacheConfig(path=store)).close()  # a default opener: records chunk_tokens 256
    assert CHUNK != 256
    assert with_store_settings({"path": str(store)})["chunk_tokens"] == 256  # (newest writer)
    assert with_store_settings({"path": str(store)}, "served")["chunk_tokens"] == CHUNK
    assert with_store_settings({"path": str(store)}, "never-served")["chunk_tokens"] == 256
    assert with_store_settings({"path": str(store), "chunk_tokens": 32}, "served")["chunk_tokens"] == 32
    # servers of that model with two chunk sizes: no telling which; the newest writer's
    open_cache(store, backend, ns=namespace(model="served", chunk_tokens=2 * CHUNK)).close()
    assert with_store_settings({"path": str(store)}, "served")["chunk_tokens"] == 2 * CHUNK


def test_orphan_payloads_of_a_killed_writer_are_swept(tmp_path: Path, backend: str) -> None:
    """A payload written but never published (its writer died before the index commit) is
    invisible, and the sweep removes it once it is older than the grace period."""
    store = tmp_path / "s"
    with ChunkStore(config(store, backend)) as s:
        b = s.backend
        item = _item(_key("orphan"), 1)
        old = (int(time.time()) - 3600) << 32 | 7  # written an hour ago
        assert b.payloads.write_many([item], [old]) == [None]
        young = (int(time.time())) << 32 | 8
        assert b.payloads.write_many([item], [young]) == [None]
        assert b.count_present_prefix([item.key]) == 0 and b.lookup(item.key) is None
        assert b.sweep_orphans() == 1  # the young one may be a live writer's: kept
        assert set(b.payloads.found()) == {(item.key, young)}
        assert b.sweep_orphans(grace_s=0) == 1
        assert set(b.payloads.found()) == set()


def test_a_killed_writer_is_swept_after_and_a_clean_history_costs_no_scan(
        zygote: Zygote, tmp_path: Path, backend: str) -> None:
    """Opening a store scans for orphans only when a writer of it was killed (it never
    unregistered); then its unpublished payload goes at once, since its writer is gone."""
    store = tmp_path / "s"
    with open_cache(store, backend):
        pass  # a clean open and close leaves no writer registered
    rep = zygote.request("call", fn="killed_mid_commit", kwargs={"path": str(store), "backend": backend})
    assert "error" not in rep, rep
    with ChunkStore(config(store, backend, io_threads=1)) as s:
        deadline = time.monotonic() + 10
        while s.counters.snapshot()["orphans_removed"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.counters.snapshot()["orphans_removed"] == 1
        assert set(s.backend.payloads.found()) == set()
        # an orphan of a gone writer that never registered: a clean history, so no sweep
        item = _item(_key("left"), 3)
        gone = (int(time.time()) << 32) | ((rep["writer"] & ((1 << 22) - 1)) << 10)
        assert s.backend.payloads.write_many([item], [gone]) == [None]
    with ChunkStore(config(store, backend)) as s:
        time.sleep(0.2)
        assert s.counters.snapshot()["orphans_removed"] == 0
        assert set(s.backend.payloads.found()) == {(item.key, gone)}
        # a pid not alive here may be a live writer's in another pid namespace (a container
        # sharing the store): only a writer this host registered and found dead goes at once
        assert s.backend.sweep_orphans() == 0
        assert s.backend.sweep_orphans(gone_writers={rep["writer"]}) == 1


def _writer_row(index: object, scope: bytes, pid: int, beat_s: float) -> bytes:
    """Register a writer of pid scope ``scope`` whose row was last refreshed at ``beat_s``."""
    from kvtier.backends.index import _BE64, _WRITER

    key = _WRITER + scope + pid.to_bytes(4, "little")
    with index.env.txn(write=True) as txn:  # type: ignore[attr-defined]
        txn.put(key, _BE64.pack(int(beat_s * 1e9)), db=index._info)  # type: ignore[attr-defined]
    return key


def _writer_keys(index: object) -> set[bytes]:

    with index.env.txn() as txn:  # type: ignore[attr-defined]
        return {key for _, key, _ in index._writer_rows(txn)}  # type: ignore[attr-defined]


def test_a_killed_containers_writer_goes_stale_and_its_orphans_are_swept(tmp_path: Path, backend: str) -> None:
    """A writer killed with its container (a restarted pod) is registered in a pid namespace
    that no longer exists, so its pid is never judged. Its row stops being refreshed: once
    stale, the next writer drops it and sweeps what it left unpublished. A row refreshed
    recently (a live writer elsewhere, idle or not) is kept, and costs no scan."""
    from kvtier.backends.index import WRITER_STALE_S

    store = tmp_path / "s"
    with open_cache(store, backend):
        pass
    item = _item(_key("left by the pod"), 4)
    orphan = ((int(time.time()) - 3600) << 32) | (4242 << 10)  # its last batch, never published
    with ChunkStore(config(store, backend)) as s:
        assert s.backend.payloads.write_many([item], [orphan]) == [None]
        live = _writer_row(s.backend.index, b"\x02" * 8, 77, time.time() - 60)
    with ChunkStore(config(store, backend)) as s:  # the live one elsewhere: nothing to sweep
        time.sleep(0.2)
        assert s.counters.snapshot()["orphans_removed"] == 0
        assert live in _writer_keys(s.backend.index)
        stale = _writer_row(s.backend.index, b"\x01" * 8, 4242, time.time() - WRITER_STALE_S - 60)
    with ChunkStore(config(store, backend)) as s:
        deadline = time.monotonic() + 10
        while s.counters.snapshot()["orphans_removed"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.counters.snapshot()["orphans_removed"] == 1
        assert (item.key, orphan) not in set(s.backend.payloads.found())
        assert _writer_keys(s.backend.index) >= {live} and stale not in _writer_keys(s.backend.index)


def test_a_running_writer_refreshes_its_row_and_notices_a_crash_without_a_restart(
        tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Servers run for weeks: the writer thread refreshes its registration while idle (else
    its live row would look stale to others) and judges the others' rows as it does, so a
    crash elsewhere is cleaned up without waiting for a restart."""
    import kvtier.store as store_mod
    from kvtier.backends.index import _WRITER, WRITER_STALE_S, pid_scope

    monkeypatch.setattr(store_mod, "WRITER_BEAT_S", 0.1)
    with ChunkStore(config(tmp_path / "s", backend)) as s:
        index = s.backend.index
        mine = _WRITER + pid_scope() + os.getpid().to_bytes(4, "little")

        def my_beat() -> int:
            with index.env.txn() as txn:
                return next(t for _, k, t in index._writer_rows(txn) if k == mine)

        first = my_beat()
        item = _item(_key("left by a crash"), 6)
        orphan = ((int(time.time()) - 3600) << 32) | (4343 << 10)
        assert s.backend.payloads.write_many([item], [orphan]) == [None]
        stale = _writer_row(index, b"\x03" * 8, 4343, time.time() - WRITER_STALE_S - 60)
        deadline = time.monotonic() + 10
        while s.counters.snapshot()["orphans_removed"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.counters.snapshot()["orphans_removed"] == 1
        assert stale not in _writer_keys(index) and my_beat() > first


def test_a_forked_child_registers_only_once_it_saves(zygote: Zygote, tmp_path: Path, backend: str) -> None:
    """Children forked from a server (a worker pool) that only read and leave without
    closing must not look like killed writers: each would set off a scan of every payload
    in the parent's next beat. A child registers before its first save, and unregisters on
    a clean close."""
    rep = zygote.request("call", fn="forked_readers", timeout=90,
                         kwargs={"path": str(tmp_path / "s"), "backend": backend})
    assert "error" not in rep, rep
    reader, saver = rep["children"]
    assert reader["loaded"] == saver["loaded"] > 0  # both used the inherited store
    assert saver["registered_while_saving"] is True
    # neither child's row is left: the reader never registered, the saver unregistered
    assert reader["writer_rows_after"] == saver["writer_rows_after"] == [rep["parent"]]


def test_a_stalled_writer_judges_no_row_stale(tmp_path: Path, backend: str) -> None:
    """When every writer was held up (a hung disk, a tool holding the index's write lock),
    the first to beat again must not take the others' overdue rows for dead writers and
    sweep their payloads: its own overdue beat says it was held up too. At registration, a
    row under this process's own pid is an earlier process's that was killed."""
    from kvtier.backends.index import _WRITER, WRITER_BEAT_S, WRITER_STALE_S, pid_scope

    with ChunkStore(config(tmp_path / "s", backend)) as s:
        index = s.backend.index
        mine = _WRITER + pid_scope() + os.getpid().to_bytes(4, "little")
        _writer_row(index, mine[len(_WRITER):-4], os.getpid(), time.time() - 3 * WRITER_BEAT_S)
        other = _writer_row(index, b"\x04" * 8, 99, time.time() - WRITER_STALE_S - 60)
        assert index.beat() is None and other in _writer_keys(index)
        assert index.beat() == [] and other not in _writer_keys(index)  # on time now: judged
        assert index.beat(first=True) == []  # "our" row at registration: a killed namesake's


def test_one_failed_record_does_not_drop_its_batch(tmp_path: Path) -> None:
    """Files: a record whose file cannot be written fails alone; its neighbours are stored."""
    store = tmp_path / "s"
    with ChunkStore(config(store, "files")) as s:
        b = s.backend
        good, bad = _item(_key("good"), 1), _item(_key("bad"), 2)
        shard = b.payloads.path_of(bad.key, 0).parent
        shard.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        shard.write_bytes(b"")  # a file where the record's directory must go
        res = b.put_many([good, bad])
        assert [it.key for it in res.stored] == [good.key]
        assert [it.key for it, _ in res.failed] == [bad.key]
        assert b.count_present_prefix([good.key]) == 1 and b.count_present_prefix([bad.key]) == 0
        assert b.read(good.key, len) == good.size


def test_close_is_bounded_when_the_disk_hangs(tmp_path: Path) -> None:
    """A writer stuck in I/O does not hang shutdown: close returns after close_timeout_s,
    the unwritten saves counted as dropped."""
    store = ChunkStore(config(tmp_path / "s", "lmdb", close_timeout_s=0.5))
    store.backend._write_lock.acquire()  # the disk "hangs": the writer blocks in its first batch
    try:
        for i in range(3):
            store.put(_key(f"k{i}"), make_kv(tokens(i, CHUNK)), namespace_id=bytes(16), token_start=0,
                      num_tokens=CHUNK)
        t0 = time.monotonic()
        store.close()
        assert time.monotonic() - t0 < 3.0
        assert store.counters.snapshot()["dropped_saves"] >= 1
    finally:
        store.backend._write_lock.release()


def test_store_marker_of_the_previous_layout_is_refused_with_advice(tmp_path: Path, backend: str) -> None:
    from kvtier.backends import MARKER
    from kvtier.errors import StoreFormatError

    store = tmp_path / "s"
    with open_cache(store, backend):
        pass
    marker = json.loads((store / MARKER).read_text())
    marker["layout_version"] = 1
    (store / MARKER).write_text(json.dumps(marker))
    with pytest.raises(StoreFormatError, match="before the shared index.*delete the directory"):
        ChunkStore(config(store, backend))
    assert os.path.exists(store / MARKER)


def test_a_prompt_is_looked_up_in_chain_order(tmp_path: Path, backend: str) -> None:
    """The scheduler's lookup path (a prompt's chunks read where the index keeps them side by
    side) answers as key-by-key lookups do, after eviction too, and for a chunk saved with
    its parent but without its chain's head."""
    store = tmp_path / "s"
    with open_cache(store, backend) as cache:
        cache.save(TOKS, make_kv(TOKS))
        assert cache.flush(30)
        refs = cache.chunks(TOKS)
        spans = [(r.start, r.key) for r in refs]
        keys = [r.key for r in refs]
        view = StoreView(config(store, backend))
        try:
            assert view.count_present_chain(keys[0], spans) == 6
            b = cache.store.backend
            # the chunks sit side by side in the chain order, under their head
            index = b.index
            with index.env.txn() as txn:
                placed = [bytes(k) for k in txn.cursor(db=index._chains).iternext(values=False)]
            assert placed == sorted(chain_key(keys[0], s, k) for s, k in spans)
            b.evict_lru(b.occupied() // 2)
            assert view.count_present_chain(keys[0], spans) == 3 == b.count_present_prefix(keys)
            kv = make_kv(TOKS[3 * CHUNK:4 * CHUNK], start=3 * CHUNK)
            assert cache.store.put(keys[3], kv, namespace_id=cache.namespace.id, token_start=3 * CHUNK,
                                   num_tokens=CHUNK, parent=keys[2])
            assert cache.flush(30)
            assert b.lookup(keys[3]).head == keys[0]
            assert view.count_present_chain(keys[0], spans) == 4 == b.count_present_prefix(keys)
            # saved with neither parent nor head: not in its chain's place, found by key
            kv = make_kv(TOKS[4 * CHUNK:5 * CHUNK], start=4 * CHUNK)
            assert cache.store.put(keys[4], kv, namespace_id=cache.namespace.id, token_start=4 * CHUNK,
                                   num_tokens=CHUNK)
            assert cache.flush(30)
            assert b.lookup(keys[4]).head == keys[4]
            assert view.count_present_chain(keys[0], spans) == 5 == b.count_present_prefix(keys)
        finally:
            view.close()


def test_a_lease_survives_the_key_being_published_again(tmp_path: Path, backend: str) -> None:
    """Two servers that both found a chunk absent both save it: the first copy stays (a load
    promised it between the two publishes may be reading it) and the second is left out,
    its payload removed. A copy that replaces the first (its writer could not load it) keeps
    the lease a scheduler gave the first, so eviction does not take the chunk from under the
    load."""
    with open_cache(tmp_path / "s", backend) as cache:
        cache.save(TOKS, make_kv(TOKS))
        assert cache.flush(30)
        keys = [c.key for c in cache.chunks(TOKS)]
        b = cache.store.backend
        b.lease(keys[-1:], 60.0)  # a scheduler promised the chain to a load
        old = b.lookup(keys[-1])
        cache.store.host.clear()
        tensor = cache.store.load(keys[-1]).tensor
        header, payload = codec.encode(tensor, key=keys[-1], namespace_id=old.namespace_id,
                                       token_start=old.token_start, num_tokens=old.num_tokens)
        item = PutItem(keys[-1], header, payload, old.namespace_id, group=old.group, parent=old.parent,
                       head=old.head, token_start=old.token_start, num_tokens=old.num_tokens)
        before = set(b.payloads.found())
        res = b.put_many([item])  # the second server's copy of the same chunk
        assert [e.key for e in res.left_out] == [keys[-1]]
        assert b.lookup(keys[-1]).location == old.location  # the first copy stays ...
        assert set(b.payloads.found()) == before  # ... and the second's payload is gone
        assert b.lookup(keys[-1]).atime_ns > old.atime_ns  # (a save is a use)
        b.put_many([dataclasses.replace(item, replace=True)])  # one that replaces it
        assert b.lookup(keys[-1]).location != old.location
        assert b.evict_lru(0)[0] == 0  # the leased chain (all of it) is kept
        assert b.count_present_prefix(keys) == 6


def test_a_second_copy_at_the_first_copys_location_removes_nothing(tmp_path: Path, backend: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Two writers of one key can meet at one location (the same pid in two containers, in the
    same second): the copy left out is then the very payload the index names, and stays."""
    import kvtier.backends.base as base

    monkeypatch.setattr(base, "new_location", lambda: (int(time.time()) << 32) | 12345)
    with ChunkStore(config(tmp_path / "s", backend)) as store:
        b = store.backend
        k = _key("same-place")
        b.put_many([_item(k, 1)])
        where = b.lookup(k).location
        b.put_many([_item(k, 1)])
        assert b.lookup(k).location == where
        assert b.read(k, bytes) is not None  # (the left-out copy's removal would remove it)


def test_a_copy_that_knows_the_chunks_chain_replaces_one_that_does_not(tmp_path: Path, backend: str) -> None:
    """A chunk promoted from the remote tier is stored without its parent or rank group: a
    later save that knows them replaces it, so that eviction keeps its chain whole."""
    with ChunkStore(config(tmp_path / "s", backend)) as store:
        b = store.backend
        head, tail, rank1 = _key("head"), _key("tail"), _key("rank1")
        b.put_many([_item(head, 0), _item(tail, 1), _item(rank1, 2)])  # no relations known
        res = b.put_many([_item(tail, 1, parent=head), _item(rank1, 2, group=head)])
        assert not res.left_out
        assert b.lookup(tail).parent == head and b.lookup(rank1).group == head
        res = b.put_many([_item(tail, 1, parent=head)])  # knows no more than what is stored
        assert [e.key for e in res.left_out] == [tail]


def test_temp_files_are_judged_by_their_writers_pid_only_where_that_pid_means_something(tmp_path: Path) -> None:
    """Files backend, on open: a temp file of a writer of this host and pid namespace goes
    once that writer is gone; one of another scope (a container sharing the store: its pids
    mean nothing here) only once older than the orphan grace period."""
    import subprocess

    from kvtier.backends.index import ORPHAN_GRACE_S, pid_scope

    store = tmp_path / "s"
    with open_cache(store, "files"):
        pass
    child = subprocess.Popen(["true"])
    child.wait()
    dead = child.pid  # a pid of this scope that is gone
    tmp = store / "files" / "tmp"
    mine = tmp / f"{pid_scope().hex()}-{dead}-0-{'ab' * 8}.tmp"
    other_young = tmp / f"{'0' * 16}-{dead}-0-{'cd' * 8}.tmp"
    other_old = tmp / f"{'0' * 16}-{dead}-1-{'ef' * 8}.tmp"
    for f in (mine, other_young, other_old):
        f.write_bytes(b"x" * 4096)
    old = time.time() - ORPHAN_GRACE_S - 60
    os.utime(other_old, (old, old))
    with ChunkStore(config(store, "files")):
        pass
    assert sorted(f.name for f in tmp.iterdir()) == [other_young.name]


def test_a_pid_found_dead_here_that_another_scope_registered_is_not_swept_at_once(tmp_path: Path,
                                                                                  backend: str) -> None:
    """Identical containers on one machine share a store and often the same pids: a writer
    found dead in this pid scope may have the pid of a live one in another, whose fresh,
    unpublished payload carries that pid too. It waits out the grace period."""
    import subprocess

    from kvtier.backends.index import _WRITER

    child = subprocess.Popen(["true"])
    child.wait()
    pid = child.pid  # gone here
    with ChunkStore(config(tmp_path / "s", backend)) as s:
        b = s.backend
        with b.index.env.txn(write=True) as txn:  # a writer of another container, same pid
            txn.put(_WRITER + b"\x01" * 8 + pid.to_bytes(4, "little"), b"\0" * 8, db=b.index._info)
        item = _item(_key("fresh"), 5)
        fresh = (int(time.time()) << 32) | ((pid & ((1 << 22) - 1)) << 10)
        assert b.payloads.write_many([item], [fresh]) == [None]
        assert b.sweep_orphans(gone_writers={pid}) == 0
        assert set(b.payloads.found()) == {(item.key, fresh)}
