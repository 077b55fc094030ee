"""What ``KVCache.load`` hands back: read straight into the result's slices, verified, and in
memory of its own. Dropping it gives the memory back to the system (beyond a few recently
freed maps kept for the next results), instead of leaving it in glibc's heap, where a long
run of loads grew the process by hundreds of MiB."""

from __future__ import annotations

import gc
import os
import threading
from pathlib import Path

import pytest
import torch
from kvhelpers import make_kv, namespace, open_cache, same_bits, tokens

from kvtier.buffer_pool import BufferPool, ResultMemory

KV_SHAPE = (8, 2, 8, 64)  # 16 KiB per bf16 token
CHUNK = 64  # 1 MiB chunks
MIB = 1 << 20


def _anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def _cache(path: Path, backend: str = "files", host_bytes: int = 64 * MIB):
    ns = namespace(kv_shape=KV_SHAPE, chunk_tokens=CHUNK)
    return open_cache(path, backend, ns, host_bytes=host_bytes, write_queue_bytes=32 * MIB)


def test_dropped_load_results_give_their_memory_back(tmp_path: Path) -> None:
    toks = tokens(1, 16 * CHUNK)
    kv = make_kv(toks, kv_shape=KV_SHAPE)
    with _cache(tmp_path / "s") as cache:
        cache.save(toks, kv)
        assert cache.flush(30)
        for n in (CHUNK, 16 * CHUNK):  # warm up: the host tier and the kept maps are filled
            cache.load(toks, max_tokens=n)
        gc.collect()
        before = _anon_bytes()
        pins = []
        for k in range(1, 17):  # results of 1 to 16 MiB, each dropped before the next load
            got = cache.load(toks, max_tokens=k * CHUNK)
            # compared in place, bit for bit: a check that copied the expected slice would
            # itself grow (or pre-grow) glibc's heap and hide what is measured
            assert torch.equal(got.view(torch.int16), kv.narrow(2, 0, k * CHUNK).view(torch.int16))
            # something small and long-lived after each: in glibc's heap, the freed result
            # below it could not be trimmed away
            pins.append(torch.ones(16 * 1024))
            del got
        gc.collect()
        grown = _anon_bytes() - before
        kept = cache.store.results.keep_bytes
    # 136 MiB of results were loaded and dropped; what stays is at most the kept maps (and
    # the pins, 1 MiB); in glibc's heap this grew by about the sum of the results
    assert grown <= kept + 8 * MIB, f"grew {grown / MIB:.0f} MiB"


def test_a_result_is_never_reused_while_any_view_of_it_lives(tmp_path: Path) -> None:
    a, b = tokens(2, 4 * CHUNK), tokens(3, 4 * CHUNK)
    kv_a, kv_b = make_kv(a, kv_shape=KV_SHAPE), make_kv(b, kv_shape=KV_SHAPE)
    with _cache(tmp_path / "s") as cache:
        cache.save(a, kv_a)
        cache.save(b, kv_b)
        assert cache.flush(30)
        got = cache.load(a)
        view = got[3]  # a view alone keeps the memory
        del got
        gc.collect()
        other = cache.load(b)  # same size: would take the map if it had been given back
        assert same_bits(other, kv_b)
        assert same_bits(view, kv_a[3])
        del view, other
        gc.collect()
        mapped = cache.store.results.mapped
        for _ in range(10):  # now a steady stream of results reuses what was freed
            assert same_bits(cache.load(a), kv_a)
        assert cache.store.results.mapped == mapped


def test_freed_maps_beyond_the_kept_bytes_are_unmapped() -> None:
    mem = ResultMemory(keep_bytes=3 * MIB)
    shape, dtype = (MIB // 2,), torch.bfloat16  # 1 MiB each
    live = [mem.empty(shape, dtype).fill_(i) for i in range(5)]
    assert mem.mapped == 5
    del live
    gc.collect()
    assert mem._kept == 3 * MIB  # the three most recently freed are kept, two unmapped
    again = [mem.empty(shape, dtype) for _ in range(4)]
    assert mem.mapped == 6 and mem._kept == 0
    del again
    small = mem.empty((100,), dtype)  # below a map's worth: an ordinary tensor
    assert mem.mapped == 6 and small.numel() == 100



@pytest.mark.parametrize("backend", ["files", "lmdb"])
def test_a_bulk_load_reads_into_the_result_and_stops_at_a_corrupt_chunk(
        tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no host tier, ``load`` decodes every chunk straight into its slice of the result,
    one read per layer and K/V (no staging): bit-exact, and a flipped byte in the third
    chunk ends the result after the second, counted as corrupt."""
    from test_corruption import read_raw, write_raw

    from kvtier.backends.files import _FileReader
    from kvtier.backends.payloads import ViewReader

    def staged(self: object) -> memoryview:
        raise AssertionError("a record was staged whole")

    for reader in (_FileReader, ViewReader):  # a staged read fails the load, and the test
        monkeypatch.setattr(reader, "whole", staged)

    toks = tokens(4, 6 * CHUNK)
    kv = make_kv(toks, kv_shape=KV_SHAPE)
    store = tmp_path / "s"
    with _cache(store, backend, host_bytes=0) as cache:
        cache.save(toks, kv)
        assert cache.flush(30)
        assert same_bits(cache.load(toks), kv)
        bad = cache.chunks(toks)[2].key
    rec = bytearray(read_raw(store, backend, bad))
    rec[len(rec) // 2] ^= 0x10
    write_raw(store, backend, bad, bytes(rec))
    with _cache(store, backend, host_bytes=0) as cache:
        got = cache.load(toks)
        assert got.shape[2] == 2 * CHUNK and same_bits(got, kv.narrow(2, 0, 2 * CHUNK))
        assert cache.stats()["corrupt_records"] == 1


def test_a_file_record_is_read_into_runs_in_one_scattered_read(tmp_path: Path) -> None:
    from kvtier.backends.files import _FileReader
    from kvtier.backends.payloads import ThreadBuffer
    from kvtier.errors import RecordError

    data = bytes(range(256)) * 1024  # 256 KiB
    f = tmp_path / "rec"
    f.write_bytes(data)
    fd = os.open(f, os.O_RDONLY)
    try:
        reader = _FileReader(fd, ThreadBuffer(), max_record_bytes=1 << 30)
        runs = [memoryview(bytearray(n)) for n in (100, 65536, 3)]
        reader.fill_runs(runs, 1000)
        assert b"".join(bytes(r) for r in runs) == data[1000 : 1000 + 65639]
        with pytest.raises(RecordError, match="ends before"):  # the record is shorter than the runs
            reader.fill_runs([memoryview(bytearray(4096)), memoryview(bytearray(4096))], len(data) - 5000)
    finally:
        os.close(fd)


def _drop_inside_lock(lock: object, holder: list[torch.Tensor]) -> bool:
    """Drop the last reference to a pooled tensor on a thread that holds the pool's lock,
    as a garbage collection may (from Python 3.12 it runs inside any locked section); True
    if that thread got out."""
    def run() -> None:
        with lock:  # type: ignore[attr-defined]
            holder.clear()  # its finalizer runs here, on this thread
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(5)
    return not th.is_alive()


def test_memory_freed_inside_the_lock_comes_back_without_a_deadlock() -> None:
    mem = ResultMemory(keep_bytes=4 * MIB)
    assert _drop_inside_lock(mem._lock, [mem.empty((MIB // 2,), torch.bfloat16)]), "deadlocked"
    assert mem._kept == MIB  # handed back when the lock was left
    again = mem.empty((MIB // 2,), torch.bfloat16)
    assert mem.mapped == 1 and again.numel() == MIB // 2

    pool = BufferPool(4 * MIB)
    assert _drop_inside_lock(pool._lock, [pool.acquire((MIB // 2,), torch.bfloat16)]), "deadlocked"
    assert pool.free_slots == 1
    assert pool.acquire((MIB // 2,), torch.bfloat16) is not None and pool.created == 1


def test_a_result_cannot_grow_in_place(tmp_path: Path) -> None:
    """As KVCache.load documents: the result's memory is its own map, which cannot be
    resized; growing it raises (torch leaves that tensor's sizes changed, so the test
    checks the memory through another view)."""
    toks = tokens(4, 4 * CHUNK)
    kv = make_kv(toks, kv_shape=KV_SHAPE)
    with _cache(tmp_path / "s") as cache:
        cache.save(toks, kv)
        assert cache.flush(30)
        got = cache.load(toks)
        other = got[:]  # a second view of the same memory
        with pytest.raises(RuntimeError):
            got.resize_(got.shape[0] + 1, *got.shape[1:])
        assert same_bits(other, kv)  # the memory is intact
