"""Closing and failed opens: nothing leaks, nothing is silently lost."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from kvtier import CacheConfig, ChunkStore, ConfigError, KVCache, Namespace


def _chunk() -> torch.Tensor:
    return torch.zeros(1, 2, 64, 1, 8, dtype=torch.bfloat16)


def test_close_without_flush_drops_and_counts_what_is_queued(tmp_path: Path) -> None:
    store = ChunkStore(CacheConfig(path=tmp_path / "s", chunk_tokens=64))
    store.backend._write_lock.acquire()  # the disk "hangs": the writer blocks in its first batch
    try:
        store.put(b"a" * 32, _chunk(), namespace_id=b"n" * 16, token_start=0, num_tokens=64)
        deadline = time.monotonic() + 10
        while store._inflight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store._inflight == 1
        for k in (b"b", b"c", b"d"):
            assert store.put(k * 32, _chunk(), namespace_id=b"n" * 16, token_start=0, num_tokens=64)
        closer = threading.Thread(target=store.close, kwargs={"flush": False})
        closer.start()
        deadline = time.monotonic() + 10
        while store._queue and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        store.backend._write_lock.release()
    closer.join(10)
    assert not closer.is_alive()
    c = store.counters.snapshot()
    assert c["dropped_saves"] == 3 and c["saves_committed"] == 1


def test_failed_open_leaks_no_threads_or_lock(tmp_path: Path) -> None:
    ns = Namespace(model="m", weights_fingerprint="w", dtype="bfloat16", kv_shape=(1, 2, 1, 8),
                   chunk_tokens=64)
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ConfigError, match="chunk_tokens"):
        KVCache.open(tmp_path / "s", ns, CacheConfig(path=tmp_path / "s", chunk_tokens=128))
    time.sleep(0.1)
    assert {t.ident for t in threading.enumerate()} <= before
    # The store lock was released: an exclusive lock (what `kvtier compact` takes) succeeds.
    from kvtier.backends import StoreLock

    StoreLock(tmp_path / "s", exclusive=True).release()
