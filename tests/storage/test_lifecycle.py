"""Closing and failed opens: nothing leaks, nothing is silently lost."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from kvtier import CacheConfig, ChunkStore, KVCache, Namespace


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


def test_a_closed_store_refuses_clearly(tmp_path: Path) -> None:
    """A load counted an I/O error ("Attempt to operate on closed/deleted/dropped object"),
    a buffer was handed out for a save that could not be, and a KVCache built on it said
    the store's LMDB database was damaged, to be deleted. Each is a StoreError that says the
    store was closed; the store is intact."""
    from kvtier.errors import StoreError

    path = tmp_path / "s"
    store = ChunkStore(CacheConfig(path=path, chunk_tokens=64))
    key = b"a" * 32
    assert store.put(key, _chunk(), namespace_id=b"n" * 16, token_start=0, num_tokens=64)
    store.close()
    for call in (lambda: store.load(key), lambda: store.get(key), lambda: store.buffer((1, 2, 64, 1, 8), torch.bfloat16),
                 lambda: store.reserve_buffers((1, 2, 64, 1, 8), torch.bfloat16)):
        with pytest.raises(StoreError, match="this store was closed; open it again"):
            call()
    ns = Namespace(model="m", weights_fingerprint="x", dtype="bfloat16", kv_shape=(1, 2, 1, 8), chunk_tokens=64)
    with pytest.raises(StoreError, match="the store was closed; open it again") as info:
        KVCache(store, ns)
    assert "damaged" not in str(info.value)
    assert store.counters.snapshot()["io_errors"] == 0
    with ChunkStore(CacheConfig(path=path, chunk_tokens=64)) as again:
        assert again.load(key).outcome.value == "hit"


@pytest.mark.parametrize(("token_start", "num_tokens", "message"), [
    (-5, 64, r"token_start must be an integer in \[0, 2\*\*64\), got -5"),
    (0, 0, r"num_tokens must be an integer in \[1, 2\*\*32\), got 0"),
    (0, 64.0, r"num_tokens must be an integer .*, got 64.0"),
])
def test_a_put_of_token_counts_no_record_can_hold_is_refused_at_the_call(
        tmp_path: Path, token_start: object, num_tokens: object, message: str) -> None:
    """It was queued, then failed in the writer (counted as an I/O error), far from the call."""
    with ChunkStore(CacheConfig(path=tmp_path / "s", chunk_tokens=64)) as store:
        with pytest.raises(ValueError, match=message):
            store.put(b"a" * 32, _chunk(), namespace_id=b"n" * 16, token_start=token_start,  # type: ignore[arg-type]
                      num_tokens=num_tokens)  # type: ignore[arg-type]
        assert store.flush(10)
        assert store.counters.snapshot()["io_errors"] == 0 and not store.present_each([b"a" * 32])[0]


def test_get_async_with_another_number_of_destinations_is_refused_at_the_call(tmp_path: Path) -> None:
    """It failed inside the future, with zip()'s message."""
    with ChunkStore(CacheConfig(path=tmp_path / "s", chunk_tokens=64)) as store, \
            pytest.raises(ValueError, match=r"get_async: one destination per key \(2 keys, 1 outs\)"):
        store.get_async([b"a" * 32, b"b" * 32], [_chunk()])


def test_failed_open_leaks_no_threads_or_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.backends.base import Backend
    from kvtier.errors import StoreFull

    ns = Namespace(model="m", weights_fingerprint="w", dtype="bfloat16", kv_shape=(1, 2, 1, 8),
                   chunk_tokens=64)

    def full(*args: object) -> None:  # the disk filled between opening and registering
        raise StoreFull("no space left")

    monkeypatch.setattr(Backend, "register_namespace", full)
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(StoreFull):
        KVCache.open(tmp_path / "s", ns, CacheConfig(path=tmp_path / "s", chunk_tokens=64))
    time.sleep(0.1)
    assert {t.ident for t in threading.enumerate()} <= before
    # The store lock was released: an exclusive lock (what `kvtier compact` takes) succeeds.
    from kvtier.backends import StoreLock

    StoreLock(tmp_path / "s", exclusive=True).release()


def test_prefetch_and_async_loads(tmp_path: Path) -> None:
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=64)
    chunks = {bytes([i]) * 32: torch.full((1, 2, 64, 1, 8), float(i), dtype=torch.bfloat16) for i in range(1, 5)}
    with ChunkStore(cfg) as store:
        for k, t in chunks.items():
            store.put(k, t.clone(), namespace_id=b"n" * 16, token_start=0, num_tokens=64)
    with ChunkStore(cfg) as store:  # a restart: nothing in host memory yet
        keys = list(chunks)
        got = store.get_async([*keys[:2], b"\xff" * 32]).result(10)
        assert [g is not None and torch.equal(g, chunks[k]) for g, k in zip(got[:2], keys[:2], strict=True)] == [True, True]
        assert got[2] is None
        assert store.prefetch(keys[2:]).result(10) == 2
        before = store.counters.snapshot()
        for k in keys[2:]:
            assert torch.equal(store.get(k), chunks[k])
        after = store.counters.snapshot()
        assert after["hits_host"] - before["hits_host"] == 2  # served from memory, as prefetched
        assert after["hits_disk"] == before["hits_disk"]


@pytest.mark.parametrize("backend", ["files", "lmdb"])
@pytest.mark.parametrize("saver", ["main", "a thread that outlives it"])
def test_saves_queued_when_the_interpreter_exits_are_committed(tmp_path: Path, backend: str, saver: str) -> None:
    """A cache never closed (or closed by an engine's own exit hooks) still commits what it
    queued: at exit Python stops thread pools before atexit handlers run, and the files
    backend writes through one (it kept 1 of 8 chunks; 0 of 40 prompts saved by a thread
    that ran on after the main one ended)."""
    import subprocess
    import sys

    path = tmp_path / "s"
    save = "c.save(list(range(2048)), torch.randn(2, 2, 2048, 2, 32).to(torch.bfloat16))"
    if saver != "main":
        save = f"threading.Thread(target=lambda: (time.sleep(0.5), {save})).start()"
    script = f"""
import threading, time, torch
from kvtier import CacheConfig, KVCache, Namespace
ns = Namespace(model="m", weights_fingerprint="x", dtype="bfloat16", kv_shape=(2, 2, 2, 32))
c = KVCache.open({str(path)!r}, ns, CacheConfig(path={str(path)!r}, backend={backend!r}, chunk_tokens=256))
{save}
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "could not be written" not in r.stderr, r.stderr
    ns = Namespace(model="m", weights_fingerprint="x", dtype="bfloat16", kv_shape=(2, 2, 2, 32))
    with KVCache.open(path, ns, CacheConfig(path=path, chunk_tokens=256), readonly=True) as c:
        assert c.lookup(list(range(2048))) == 2048


@pytest.mark.parametrize("backend", ["files", "lmdb"])
def test_loads_racing_close_get_a_store_error(tmp_path: Path, backend: str) -> None:
    """A load in another thread while the cache closes gets StoreError ("closed"), never the
    I/O pool's CancelledError or RuntimeError, and never wrong data."""
    from kvhelpers import make_kv, namespace, same_bits
    from kvhelpers import tokens as rand_tokens

    from kvtier.errors import StoreError

    toks = rand_tokens(7, 40 * 16)
    kv = make_kv(toks)
    seen: dict[str, int] = {}
    for r in range(6):
        path = tmp_path / f"s{r}"
        ns = namespace(chunk_tokens=16)
        cfg = CacheConfig(path=path, backend=backend, chunk_tokens=16, io_threads=2,
                          host_bytes=0 if r % 2 else "1M")  # 0: every load is a bulk load
        cache = KVCache.open(path, ns, cfg, tail_granularity=16)
        cache.save(toks, kv, wait=10)
        assert cache.flush(30)
        stop = threading.Event()

        def loads(c: KVCache = cache, stop: threading.Event = stop) -> None:
            while not stop.is_set():
                try:
                    out = c.load(toks)
                    assert same_bits(out, kv[:, :, : out.shape[2]]), "wrong data"
                    name = "ok"
                except StoreError:
                    name = "StoreError"
                except Exception as exc:  # what the test is about
                    name = type(exc).__name__
                seen[name] = seen.get(name, 0) + 1

        threads = [threading.Thread(target=loads) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.05 + 0.05 * r)
        cache.close()
        time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
    assert set(seen) <= {"ok", "StoreError"}, seen
    assert seen.get("StoreError", 0) > 0


def test_the_exit_flush_waits_again_only_for_a_store_that_made_progress(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The exit flush runs twice (before the pools stop, and after the threads that outlive
    the main one are joined). A store whose first flush timed out while its writer was still
    committing (such a thread saving) is flushed again; one that made no progress in a whole
    close_timeout_s (a hung disk) is not waited for twice. (Giving up on any timeout kept 216
    of 400 prompts a thread saved past the exit.)"""
    from kvtier.store import _flush_stores_at_exit

    with ChunkStore(CacheConfig(path=tmp_path / "s", close_timeout_s=0.1)) as store:
        waits: list[float] = []

        def committing(timeout: float) -> bool:
            waits.append(timeout)
            store.counters.add(saves_committed=1)
            return False

        monkeypatch.setattr(store, "flush", committing)
        _flush_stores_at_exit()
        _flush_stores_at_exit()
        assert len(waits) == 2

        def stuck(timeout: float) -> bool:
            waits.append(timeout)
            return False

        monkeypatch.setattr(store, "flush", stuck)
        _flush_stores_at_exit()
        _flush_stores_at_exit()
        assert len(waits) == 3
        monkeypatch.undo()


@pytest.mark.parametrize("pool", ["running", "shut down"])
def test_a_write_helper_that_raises_runtimeerror_is_not_run_again(tmp_path: Path, pool: str) -> None:
    """The files backend runs a helper on its own thread when the interpreter's pools refuse
    work (a pool that is shut down raises RuntimeError); an error the helper itself raised
    must surface as it is, not be retried (the retry had no arguments left and hid it under
    a TypeError)."""
    with ChunkStore(CacheConfig(path=tmp_path / "s", backend="files")) as store:
        payloads = store.backend.payloads
        payloads._pool = ThreadPoolExecutor(1)
        if pool == "shut down":
            payloads._pool.shutdown()
        runs = []

        def fails(x: int) -> None:
            runs.append(x)
            raise RuntimeError("the helper's own error")

        try:
            with pytest.raises(RuntimeError, match="the helper's own error"):
                payloads._on_pool(fails, [1]).result()
        finally:
            payloads._pool.shutdown()
            payloads._pool = None
        assert runs == [1]
