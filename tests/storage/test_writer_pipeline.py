"""The writer prepares the next batch (device copy, checksum) while the committer writes one."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvtier import CacheConfig, ChunkStore

NS = b"n" * 16
SHAPE = (2, 2, 64, 2, 32)  # 32 KiB of bfloat16


def _chunk(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i), dtype=torch.bfloat16)


def _store(tmp_path: Path, backend: str, batch_chunks: int) -> ChunkStore:
    nbytes = _chunk(0).numel() * 2
    return ChunkStore(CacheConfig(path=tmp_path / "s", backend=backend, chunk_tokens=64,
                                  commit_bytes=batch_chunks * nbytes, write_queue_bytes=16 * nbytes))


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
    batches: list[int] = []
    put_many = store.backend.put_many

    def recording_put_many(items: list) -> object:
        batches.append(len(items))
        return put_many(items)

    store.backend.put_many = recording_put_many  # type: ignore[method-assign]

    def put(i: int) -> None:
        assert store.put(bytes([i]) * 32, _chunk(i), namespace_id=NS, token_start=0, num_tokens=64,
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
    assert prepared == [1, 2, 3, 4] and batches == [1, 2, 1]
    for i in range(1, 5):
        got = store.get(bytes([i]) * 32)
        assert got is not None and torch.equal(got, _chunk(i))
    store.close()
    with ChunkStore(store.config) as again:  # stored, not only held in memory
        assert again.count_present_prefix([bytes([i]) * 32 for i in range(1, 5)]) == 4


def test_a_failed_device_copy_drops_its_batch_and_frees_its_buffer(tmp_path: Path) -> None:
    store = _store(tmp_path, "files", batch_chunks=1)
    pooled = store.buffer(SHAPE, torch.bfloat16)
    assert pooled is not None
    pooled.copy_(_chunk(1))

    def failed_copy() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    assert store.put(b"\x01" * 32, pooled, namespace_id=NS, token_start=0, num_tokens=64, ready=failed_copy)
    store.host.clear()  # only the write queue holds the buffer now
    del pooled
    assert store.put(b"\x02" * 32, _chunk(2), namespace_id=NS, token_start=0, num_tokens=64)
    assert store.flush(10)
    c = store.counters.snapshot()
    assert c["dropped_saves"] == 1 and c["io_errors"] == 1 and c["saves_committed"] == 1
    assert store.count_present_prefix([b"\x02" * 32]) == 1
    assert store.present_each([b"\x01" * 32]) == [False]
    assert store.pool.free_slots == store.pool.created  # the failed chunk's buffer is back
    store.close()


def test_close_waits_for_a_prepared_batch(tmp_path: Path) -> None:
    store = _store(tmp_path, "lmdb", batch_chunks=1)
    prepared: list[int] = []
    store.backend._write_lock.acquire()
    try:
        for i in (1, 2):
            assert store.put(bytes([i]) * 32, _chunk(i), namespace_id=NS, token_start=0, num_tokens=64,
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
        assert again.count_present_prefix([b"\x01" * 32, b"\x02" * 32]) == 2
