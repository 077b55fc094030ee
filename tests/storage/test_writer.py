"""The store's writer: it prepares the next batch (device copy, checksum) while the
committer writes one; recent uses wait for the committer; and a failed device copy, encode,
remote enqueue or commit loses at most its batch, is counted, and gives the batch's buffers
back before ``flush()`` returns (a buffer still held then makes the next save a dropped
save)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvtier import CacheConfig, ChunkStore

NS = b"n" * 16
SHAPE = (2, 2, 64, 2, 32)  # 32 KiB of bfloat16
NBYTES = torch.Size(SHAPE).numel() * 2


def _key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def _chunk(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i), dtype=torch.bfloat16)


def _store(tmp_path: Path, backend: str, batch_chunks: int) -> ChunkStore:
    return ChunkStore(CacheConfig(path=tmp_path / "s", backend=backend, chunk_tokens=64,
                                  commit_bytes=batch_chunks * NBYTES, write_queue_bytes=16 * NBYTES))


def _one_buffer_store(tmp_path: Path, backend: str = "files") -> ChunkStore:
    # host_bytes=0 and a one-chunk write queue: the pool has exactly one buffer, so a buffer
    # still referenced after flush() makes the next save a dropped save
    return ChunkStore(CacheConfig(path=tmp_path / "s", backend=backend, chunk_tokens=64, host_bytes=0,
                                  commit_bytes=NBYTES, write_queue_bytes=NBYTES))


def _recorded_batches(store: ChunkStore) -> list[list[bytes]]:
    """The keys of each batch the store writes from now on, as the backend receives them."""
    batches: list[list[bytes]] = []
    put_many = store.backend.put_many

    def recording_put_many(items: list) -> object:
        batches.append([it.key for it in items])
        return put_many(items)

    store.backend.put_many = recording_put_many  # type: ignore[method-assign]
    return batches


def _until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_the_next_batch_is_prepared_while_one_is_written(tmp_path: Path, backend: str) -> None:
    store = _store(tmp_path, backend, batch_chunks=2)
    prepared: list[int] = []
    batches = _recorded_batches(store)

    def put(i: int) -> None:
        assert store.put(_key(i), _chunk(i), namespace_id=NS, token_start=0, num_tokens=64,
                         ready=lambda: prepared.append(i))

    store.backend._write_lock.acquire()  # the disk is busy with the first batch
    try:
        put(1)
        assert _until(lambda: store._inflight == 1)  # taken alone: the committer was idle
        put(2)
        time.sleep(0.3)
        assert prepared == [1]  # half a batch is left to grow while the disk is busy
        put(3)
        assert _until(lambda: prepared == [1, 2, 3])  # a whole batch: prepared during the write
        put(4)
        time.sleep(0.3)
        assert prepared == [1, 2, 3]  # one batch ahead at most
    finally:
        store.backend._write_lock.release()
    assert store.flush(10)
    assert prepared == [1, 2, 3, 4]
    assert batches == [[_key(1)], [_key(2), _key(3)], [_key(4)]]  # whole batches, in queue order
    for i in range(1, 5):
        got = store.get(_key(i))
        assert got is not None and torch.equal(got, _chunk(i))
    store.close()
    with ChunkStore(store.config) as again:  # stored, not only held in memory
        assert again.count_present_prefix([_key(i) for i in range(1, 5)]) == 4


def test_close_waits_for_a_prepared_batch(tmp_path: Path) -> None:
    store = _store(tmp_path, "lmdb", batch_chunks=1)
    prepared: list[int] = []
    store.backend._write_lock.acquire()
    try:
        for i in (1, 2):
            assert store.put(_key(i), _chunk(i), namespace_id=NS, token_start=0, num_tokens=64,
                             ready=lambda i=i: prepared.append(i))
        assert _until(lambda: prepared == [1, 2])  # 1 being written, 2 prepared
        closer = threading.Thread(target=store.close)
        closer.start()
        time.sleep(0.2)
        assert closer.is_alive()  # close flushes: it waits for both
    finally:
        store.backend._write_lock.release()
    closer.join(10)
    assert not closer.is_alive()
    assert store.counters.snapshot()["saves_committed"] == 2
    with ChunkStore(store.config) as again:
        assert again.count_present_prefix([_key(1), _key(2)]) == 2


def _failed_copy() -> None:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def _linger_after_release(store: ChunkStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread that released a batch is descheduled right after ``_release`` returns (what
    a busy machine does now and then: see test_buffer_pool's lingering-thread test). Nothing
    of the batch may still be referenced by then: flush() has already been told it is done."""
    real = store._release

    def release_then_linger(batch: list, **kw: object) -> None:
        real(batch, **kw)
        time.sleep(0.3)

    monkeypatch.setattr(store, "_release", release_then_linger)


def test_a_failed_device_copy_gives_its_buffer_back_before_flush_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed device copy drops its batch (counted) and nothing else. The error's
    traceback holds ``_prepare``'s frame (the chunk, its record): the batch is released only
    once the error is gone."""
    store = _one_buffer_store(tmp_path)
    _linger_after_release(store, monkeypatch)
    t = store.buffer(SHAPE, torch.bfloat16)
    assert t is not None
    assert store.put(_key(1), t, namespace_id=NS, token_start=0, num_tokens=64, ready=_failed_copy)
    del t
    assert store.flush(10)
    again = store.buffer(SHAPE, torch.bfloat16)  # the save right after the flush
    assert again is not None, "the failed batch's buffer was still in use after flush() returned"
    again.copy_(_chunk(2))
    assert store.put(_key(2), again, namespace_id=NS, token_start=0, num_tokens=64)
    del again
    assert store.flush(10)
    c = store.counters.snapshot()
    assert c["dropped_saves"] == 1 and c["io_errors"] == 1 and c["saves_committed"] == 1
    assert store.present_each([_key(1), _key(2)]) == [False, True]
    store.close()


def test_a_failed_device_copy_never_costs_the_next_save_its_buffer(tmp_path: Path) -> None:
    """The same race unaided: it dropped about 1 save in 100 rounds when the release ran
    inside the except block."""
    store = _one_buffer_store(tmp_path)
    dropped = 0
    for i in range(1500):
        t = store.buffer(SHAPE, torch.bfloat16)
        if t is None:
            dropped += 1
            time.sleep(0.005)
            continue
        store.put(_key(i), t, namespace_id=NS, token_start=0, num_tokens=64, ready=_failed_copy)
        del t
        assert store.flush(10)
    store.close()
    assert dropped == 0


def _landing_later(t: torch.Tensor, value: float) -> Callable[[], object]:
    """A device copy into ``t`` still in flight: it lands (``t`` filled with ``value``) in
    0.2 s; the returned ``ready`` waits for it."""
    landed = threading.Event()

    def land() -> None:
        time.sleep(0.2)
        t.fill_(value)
        landed.set()

    threading.Thread(target=land, daemon=True).start()
    return lambda: landed.wait(10)


@pytest.mark.parametrize("how", ["load into out", "load", "load_many"])
def test_a_hit_on_a_chunk_whose_device_copy_is_landing_waits_for_it(tmp_path: Path, how: str) -> None:
    """A chunk saved while its device copy is in flight is a host-tier hit at once (a later
    request in the same process): the reader gets the copy's bytes, never the buffer's
    earlier ones."""
    store = _store(tmp_path, "files", 1)
    t = store.buffer(SHAPE, torch.bfloat16)
    assert t is not None
    t.zero_()
    assert store.put(_key(1), t, namespace_id=NS, token_start=0, num_tokens=64, ready=_landing_later(t, 7.0))
    del t
    if how == "load into out":
        out = torch.empty(SHAPE, dtype=torch.bfloat16)
        assert store.load(_key(1), out).outcome.value == "hit"
        got = out.clone()
    elif how == "load":
        loaded = store.load(_key(1))
        assert loaded.tensor is not None
        got = loaded.tensor.clone()
    else:
        with contextlib.closing(store.load_many([_key(1)])) as reads:
            loaded = next(reads)
            assert loaded.tensor is not None
            got = loaded.tensor.clone()
        del loaded
    assert torch.equal(got, _chunk(7)), f"read the buffer before its copy landed (first value {got.flatten()[0]})"
    assert store.flush(10)
    store.close()


@pytest.mark.parametrize("read_first", [True, False], ids=["read while queued", "read once dropped"])
def test_a_chunk_whose_device_copy_failed_is_never_a_hit(tmp_path: Path, read_first: bool) -> None:
    """Its buffer's bytes are unknown: neither the write queue nor the host tier serves it,
    before or after the writer dropped it."""
    store = _store(tmp_path, "files", 1)
    t = store.buffer(SHAPE, torch.bfloat16)
    assert t is not None
    t.copy_(_chunk(3))  # (what the buffer held before: a hit would return these bytes)
    release = threading.Event()

    def failing_copy() -> None:
        release.wait(10)
        _failed_copy()

    assert store.put(_key(1), t, namespace_id=NS, token_start=0, num_tokens=64, ready=failing_copy)
    del t
    release.set()
    if read_first:
        assert store.load(_key(1)).outcome.value == "miss"
    assert store.flush(10)
    assert store.load(_key(1)).outcome.value == "miss"
    assert store.counters.snapshot()["dropped_saves"] == 1
    assert len(store.host) == 0
    store.close()


class _RemoteThatRaises:
    """A remote tier whose enqueue fails (a bug, a MemoryError): only what ChunkStore calls."""

    def enqueue(self, key: bytes, header: bytes, payload: memoryview) -> bool:
        raise RuntimeError("remote enqueue failed (injected)")

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self, timeout: float = 30.0) -> None:
        pass


def test_a_failed_remote_enqueue_is_counted(tmp_path: Path) -> None:
    """A remote tier that fails to queue a chunk costs only the upload: the chunk is still
    stored locally (it was neither stored nor counted as dropped before)."""
    store = _one_buffer_store(tmp_path)
    store.remote = _RemoteThatRaises()  # type: ignore[assignment]
    assert store.put(_key(1), torch.zeros(SHAPE, dtype=torch.bfloat16), namespace_id=NS,
                     token_start=0, num_tokens=64)
    assert store.flush(10)
    c = store.counters.snapshot()
    store.close()
    assert c["saves_queued"] == c["saves_committed"] + c["dropped_saves"] == 1, c


def test_a_failed_commit_frees_the_buffer_before_flush_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The committer lets go of a batch's records (views of the pool buffer) before it
    releases the batch, whatever ``_commit`` did (here: its remote enqueue failed)."""
    store = _one_buffer_store(tmp_path)
    store.remote = _RemoteThatRaises()  # type: ignore[assignment]
    _linger_after_release(store, monkeypatch)
    t = store.buffer(SHAPE, torch.bfloat16)
    assert t is not None
    assert store.put(_key(1), t, namespace_id=NS, token_start=0, num_tokens=64)
    del t
    assert store.flush(10)
    again = store.buffer(SHAPE, torch.bfloat16)
    assert again is not None, "the batch's buffer was still in use after flush() returned"
    del again
    store.close()


def test_keys_sharing_their_first_bytes_in_one_batch_are_all_stored(tmp_path: Path) -> None:
    """The files backend's temp names are unique within a process, not only by the key's
    first 8 bytes (two such keys in one batch wrote the same temp file)."""
    store = ChunkStore(CacheConfig(path=tmp_path / "s", backend="files", chunk_tokens=64))
    keys = [b"\x07" * 8 + bytes([i]) * 24 for i in range(4)]
    chunks = [torch.full(SHAPE, float(i), dtype=torch.bfloat16) for i in range(4)]
    store.backend._write_lock.acquire()  # the first goes alone, the other three in one batch
    try:
        for k, t in zip(keys, chunks, strict=True):
            assert store.put(k, t, namespace_id=NS, token_start=0, num_tokens=64)
    finally:
        store.backend._write_lock.release()
    assert store.flush(10)
    assert store.counters.snapshot()["saves_committed"] == 4
    store.close()
    with ChunkStore(store.config) as again:
        for k, t in zip(keys, chunks, strict=True):
            got = again.get(k)
            assert got is not None and torch.equal(got, t)


def test_recent_uses_wait_for_the_committer(tmp_path: Path) -> None:
    """A use recorded while a batch is being written goes to the index once the committer
    is idle (or with the next batch), not as an index commit of its own during the write."""
    store = _store(tmp_path, "files", batch_chunks=1)
    assert store.put(_key(1), _chunk(1), namespace_id=NS, token_start=0, num_tokens=64)
    assert store.flush(10)
    touched: list[list[bytes]] = []
    touch = store.backend.touch

    def recording_touch(keys: object, now_ns: int) -> None:
        touched.append(list(keys))  # type: ignore[call-overload]
        touch(touched[-1], now_ns)

    store.backend.touch = recording_touch  # type: ignore[method-assign]
    store.backend._write_lock.acquire()  # the disk is busy with the next batch
    try:
        assert store.put(_key(2), _chunk(2), namespace_id=NS, token_start=0, num_tokens=64)
        assert _until(lambda: store._committing)
        got = store.get(_key(1))  # a use of chunk 1
        assert got is not None and torch.equal(got, _chunk(1))
        time.sleep(1.5)  # the writer wakes at least once a second
        assert touched == []
    finally:
        store.backend._write_lock.release()
    assert store.flush(10)
    assert _until(lambda: touched == [[_key(1)]])
    store.close()


def test_an_offline_save_larger_than_the_queue_waits_for_room(tmp_path: Path) -> None:
    """A server's save drops what the write queue cannot hold (its loop must not wait for
    the disk); ``KVCache.save(..., wait=)`` waits for the writer to make room instead, so a
    long prompt through a one-chunk queue is stored whole."""
    from kvhelpers import CHUNK, make_kv, open_cache, tokens

    toks = tokens(1, 9 * CHUNK)
    chunk_bytes = make_kv(toks[:CHUNK]).numel() * 2
    slow = {"write_queue_bytes": chunk_bytes, "durability": "power"}  # one chunk; a sync per commit
    with open_cache(tmp_path / "a", "files", **slow) as cache:
        cache.save(toks, make_kv(toks))
        assert cache.flush(30)
        assert cache.stats()["dropped_saves"] > 0 and cache.lookup(toks) < len(toks)
    # (no host tier: the pool is the queue's one chunk, which the caller must not keep)
    with open_cache(tmp_path / "b", "files", **slow, host_bytes=0) as cache:
        assert cache.save(toks, make_kv(toks), wait=30) == len(toks)
        assert cache.flush(30)
        assert cache.stats()["dropped_saves"] == 0 and cache.lookup(toks) == len(toks)


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_puts_in_a_put_batch_wake_the_writer_once_and_go_as_one_batch(tmp_path: Path, backend: str) -> None:
    """A step's saves handed over in ``put_batch()`` wake the writer once, at the end: it
    takes them all as one batch. Put one by one with the committer idle, the first chunk
    goes alone (woken at once, the writer takes what is queued then)."""
    store = _store(tmp_path, backend, batch_chunks=16)
    batches = _recorded_batches(store)
    woken = threading.Event()

    def ready() -> None:
        woken.set()

    with store.put_batch():
        for i in range(8):
            assert store.put(_key(i), _chunk(i), namespace_id=NS, token_start=0, num_tokens=64, ready=ready)
        assert not woken.wait(0.3)  # not woken: nothing is taken before the block ends
    assert store.flush(10)
    assert batches == [[_key(i) for i in range(8)]]
    for i in range(8):
        got = store.get(_key(i))
        assert got is not None and torch.equal(got, _chunk(i))
    store.close()


@pytest.fixture
def slow_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer looks at its queue unprompted every 30 s, not every second: a put that
    did not wake it waits that long, which no bound below allows (and no loaded machine
    makes a prompt wake-up take)."""
    import kvtier.store

    monkeypatch.setattr(kvtier.store, "WRITER_POLL_S", 30.0)


@pytest.mark.usefixtures("slow_poll")
def test_a_put_that_waits_for_room_in_a_put_batch_wakes_the_writer_first(tmp_path: Path) -> None:
    """Inside ``put_batch()`` a put with ``wait_until`` that finds the queue full wakes the
    writer before it waits (else it would wait for the writer's poll, or its whole
    deadline), and every chunk is stored."""
    store = ChunkStore(CacheConfig(path=tmp_path / "s", chunk_tokens=64, commit_bytes=NBYTES,
                                   write_queue_bytes=2 * NBYTES))
    waits: list[float] = []
    with store.put_batch():
        for i in range(6):
            t = time.monotonic()
            assert store.put(_key(i), _chunk(i), namespace_id=NS, token_start=0, num_tokens=64,
                             wait_until=time.monotonic() + 30)
            waits.append(time.monotonic() - t)
    assert store.flush(10)
    assert store.count_present_prefix([_key(i) for i in range(6)]) == 6
    # the queue holds two: four puts waited, each for a commit, not for a poll of the writer
    assert max(waits) < 10, waits
    store.close()


@pytest.mark.usefixtures("slow_poll")
@pytest.mark.parametrize("ending", ["flush", "close"])
def test_a_flush_or_close_inside_a_put_batch_wakes_the_writer(tmp_path: Path, ending: str) -> None:
    """``flush`` and ``close`` wait for the writer: inside ``put_batch()`` they wake it for
    the puts the block held back, rather than wait for its poll (a ``close`` with a timeout
    shorter than that dropped them)."""
    store = ChunkStore(CacheConfig(path=tmp_path / "s", chunk_tokens=64, commit_bytes=16 * NBYTES,
                                   write_queue_bytes=16 * NBYTES))
    assert store.flush(10)  # (the writer idle, in its poll)
    with store.put_batch():
        for i in range(4):
            assert store.put(_key(i), _chunk(i), namespace_id=NS, token_start=0, num_tokens=64)
        if ending == "flush":
            assert store.flush(10)
        else:
            store.close(timeout=10)
    if ending == "close":
        assert store.counters.snapshot()["dropped_saves"] == 0
        store = ChunkStore(CacheConfig(path=tmp_path / "s", chunk_tokens=64))
    assert store.count_present_prefix([_key(i) for i in range(4)]) == 4
    store.close()


@pytest.mark.usefixtures("slow_poll")
def test_a_process_forked_inside_a_put_batch_wakes_its_own_writer(tmp_path: Path) -> None:
    """A child forked inside ``put_batch()`` gets a store of its own (its own writer); the
    parent's open block is not the child's, so the child's puts wake its writer at once
    instead of waiting for its poll."""
    store = ChunkStore(CacheConfig(path=tmp_path / "s", chunk_tokens=64))
    assert store.flush(10)
    with store.put_batch():
        pid = os.fork()
        if pid == 0:  # the child: a put, seen stored well before the writer's poll would see it
            code = 1
            try:
                t = time.monotonic()
                store.put(_key(9), _chunk(9), namespace_id=NS, token_start=0, num_tokens=64)
                while time.monotonic() - t < 10 and not store.backend.present_each([_key(9)])[0]:
                    time.sleep(0.01)
                code = 0 if store.backend.present_each([_key(9)])[0] else 3
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while not (done := os.waitpid(pid, os.WNOHANG))[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        if not done[0]:  # (a child that hangs fails the test, never the suite)
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    assert done[0] and os.waitstatus_to_exitcode(done[1]) == 0, "the child hung or failed"
    store.close()
