"""The chunk buffer pool: saves and host-tier loads reuse pre-touched buffers (no allocation
per chunk in steady state), a buffer is never handed out while anything still uses it, and
an exhausted pool drops a save instead of allocating."""

from __future__ import annotations

import errno
import gc
import time
from collections.abc import Callable
from concurrent.futures import thread
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import torch
from kvhelpers import CHUNK, make_kv, open_cache, same_bits, tokens

from kvtier.backends import files
from kvtier.buffer_pool import BufferPool
from kvtier.errors import ConfigError

SHAPE = (2, 2, CHUNK, 4, 32)
CHUNK_BYTES = 2 * 2 * CHUNK * 4 * 32 * 2  # bf16


def test_a_slot_returns_only_when_nothing_uses_it() -> None:
    pool = BufferPool(2 * CHUNK_BYTES, pin=False)
    a = pool.acquire(SHAPE, torch.bfloat16)
    b = pool.acquire(SHAPE, torch.bfloat16)
    assert a is not None and b is not None and pool.created == 2
    assert pool.acquire(SHAPE, torch.bfloat16) is None  # full: never allocates past the cap
    a.fill_(1)
    layer = a[1]  # a view keeps the memory in use after the tensor itself is gone
    raw = b.view(torch.uint8).numpy()  # so does a numpy view
    del a, b
    gc.collect()
    assert pool.acquire(SHAPE, torch.bfloat16) is None
    assert bool((layer == 1).all())
    del layer
    c = pool.acquire(SHAPE, torch.bfloat16)
    assert c is not None and pool.created == 2  # reused, not allocated
    del raw
    d = pool.acquire(SHAPE, torch.bfloat16)
    assert d is not None and pool.created == 2
    # a partial chunk fits a full-size slot; a bigger chunk makes bigger slots from then on
    del c
    small = pool.acquire((2, 2, 8, 4, 32), torch.bfloat16)
    assert small is not None and small.shape == (2, 2, 8, 4, 32)
    del small, d
    assert pool.acquire((2, 2, 2 * CHUNK, 4, 32), torch.bfloat16) is not None
    assert pool.chunk_bytes == 2 * CHUNK_BYTES


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (the Ctrl-C, reported)
def test_a_slot_given_back_during_a_ctrl_c_is_not_lost() -> None:
    """A finalizer runs wherever a collection happens, so a Ctrl-C can land in it while it
    hands a slot back. An audit once saw a slot lost that way (the pool one slot smaller
    for good): a slot whose hand-back is interrupted while it takes the lock is applied by
    the pool's next use instead."""
    pool = BufferPool(2 * CHUNK_BYTES, pin=False)
    a = pool.acquire(SHAPE, torch.bfloat16)
    b = pool.acquire(SHAPE, torch.bfloat16)
    assert a is not None and b is not None and pool.acquire(SHAPE, torch.bfloat16) is None
    guard, real = pool._lock, pool._lock.lock

    class InterruptedLock:  # the Ctrl-C arrives as the finalizer takes the lock
        def acquire(self, blocking: bool = True) -> bool:
            guard.lock = real
            raise KeyboardInterrupt

    guard.lock = InterruptedLock()  # type: ignore[assignment]
    del a
    gc.collect()  # (the finalizer's exception is reported, not raised)
    assert guard.lock is real
    c = pool.acquire(SHAPE, torch.bfloat16)
    assert c is not None and pool.created == 2  # the slot came back: reused, not allocated


def test_reserve_makes_every_slot_at_once_and_close_lets_them_go() -> None:
    pool = BufferPool(3 * CHUNK_BYTES + 100, pin=False)
    assert pool.reserve(SHAPE, torch.bfloat16) == 3 and pool.created == 3 and pool.free_slots == 3
    held = [pool.acquire(SHAPE, torch.bfloat16, lead=164) for _ in range(3)]
    assert all(t is not None for t in held) and pool.created == 3  # taken, not allocated
    assert pool.acquire(SHAPE, torch.bfloat16) is None  # the cap holds
    assert all(t.untyped_storage().data_ptr() % 4096 == 0 for t in held)  # (each slot page-aligned)
    for i, t in enumerate(held):
        t.fill_(i)
    assert [float(t.float().mean()) for t in held] == [0.0, 1.0, 2.0]  # slots do not overlap
    assert pool.reserve(SHAPE, torch.bfloat16) == 0  # nothing more fits
    pool.close()
    del held
    gc.collect()
    assert pool.free_slots == 0  # a closed pool keeps nothing


@pytest.mark.parametrize("count", [1, 2, 7, 40, 64, 2000])
@pytest.mark.parametrize("chunk", [32 << 20, 1 << 20, 8 << 10])
def test_pinned_slots_come_in_power_of_two_allocations(count: int, chunk: int) -> None:
    """PyTorch's pinned allocator rounds each allocation up to a power of two: one arena of
    1.25 GiB would pin 2 GiB (as its source reads). Pinned slots come from power-of-two allocations, each a page
    more than its slots, together wasting at most a slot and a page per allocation."""
    from kvtier.buffer_pool import arena_pieces

    page = 4096
    size = chunk + page  # (a slot: the chunk in whole pages, and one more)
    pieces = arena_pieces(count, size, pinned=True)
    assert sum(n for _, n in pieces) == count
    assert all(nbytes & (nbytes - 1) == 0 and n >= 1 and n * size + page <= nbytes for nbytes, n in pieces)
    assert len(pieces) <= count.bit_length() + 1
    assert sum(nbytes for nbytes, _ in pieces) <= count * size + len(pieces) * (size + page)
    assert arena_pieces(count, size, pinned=False) == [(count * size + page, count)]  # pageable: one


def test_a_reserved_pinned_pool_asks_for_power_of_two_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's pinned path, with pinning itself left out (it needs a CUDA device): every
    allocation it asks for is a power of two, and its slots are distinct, page-aligned and
    usable. 40 slots of 1 MiB chunks: 44 MiB asked for (one arena: 64 MiB)."""
    asked: list[int] = []
    empty = torch.empty

    def unpinned(*args: object, pin_memory: bool = False, **kwargs: object) -> torch.Tensor:
        asked.append(int(args[0]))  # type: ignore[call-overload]
        return empty(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(torch, "empty", unpinned)
    shape = (1, 2, 2048, 4, 32)  # 1 MiB in bf16
    pool = BufferPool(40 << 20, pin=True)
    assert pool.reserve(shape, torch.bfloat16) == 40
    assert all(n & (n - 1) == 0 for n in asked) and sum(asked) == 44 << 20, asked
    taken = [pool.acquire(shape, torch.bfloat16) for _ in range(40)]
    assert all(t is not None and t.data_ptr() % 4096 == 0 for t in taken)
    assert len({t.data_ptr() for t in taken}) == 40 and pool.acquire(shape, torch.bfloat16) is None
    for i, t in enumerate(taken):
        t.fill_(i)
    assert all(bool((t == i).all()) for i, t in enumerate(taken))  # (no two overlap)


def test_a_slot_can_hold_a_whole_record_for_direct_reads() -> None:
    """``lead``: the tensor starts that far into a page-aligned storage that has room for
    the record's header before it and whole pages after it (what O_DIRECT needs)."""
    pool = BufferPool(2 * CHUNK_BYTES, pin=False)
    t = pool.acquire(SHAPE, torch.bfloat16, lead=164)
    assert t is not None and t.shape == SHAPE and t.is_contiguous()
    st = t.untyped_storage()
    assert st.data_ptr() % 4096 == 0 and t.storage_offset() * 2 == 164
    assert st.nbytes() >= -(-(164 + CHUNK_BYTES) // 4096) * 4096
    plain = pool.acquire(SHAPE, torch.bfloat16)  # the cap counts chunks, not the spare pages
    assert plain is not None and plain.untyped_storage().data_ptr() % 4096 == 0
    assert pool.allocated_bytes == 2 * CHUNK_BYTES
    with pytest.raises(ValueError, match="lead"):
        pool.acquire(SHAPE, torch.bfloat16, lead=163)  # not a whole element


def test_the_host_tier_gives_buffers_back_when_the_pool_is_full() -> None:
    pool = BufferPool(2 * CHUNK_BYTES, pin=False)
    held = [pool.acquire(SHAPE, torch.bfloat16), pool.acquire(SHAPE, torch.bfloat16)]

    def reclaim() -> bool:
        if not held:
            return False
        held.pop(0)
        return True

    assert pool.acquire(SHAPE, torch.bfloat16, reclaim=reclaim) is not None
    assert len(held) == 1 and pool.created == 2


def test_saves_and_loads_reuse_buffers_in_steady_state(tmp_path: Path) -> None:
    store = tmp_path / "s"
    with open_cache(store, "files", host_bytes=4 * CHUNK_BYTES, write_queue_bytes=4 * CHUNK_BYTES) as cache:
        for seed in range(20):  # 20 x 2 chunks through an 8-chunk pool
            toks = tokens(seed, 2 * CHUNK)
            cache.save(toks, make_kv(toks))
            assert cache.flush(30)
        assert cache.store.pool.created <= 8
        assert cache.stats()["dropped_saves"] == 0
    with open_cache(store, "files", host_bytes=4 * CHUNK_BYTES, write_queue_bytes=4 * CHUNK_BYTES) as cache:
        for seed in range(20):
            toks = tokens(seed, 2 * CHUNK)
            for c in cache.chunks(toks):
                assert same_bits(cache.store.get(c.key), make_kv(toks[c.start:c.end], start=c.start))
        assert cache.store.pool.created <= 8  # host-tier loads came from the pool too
        assert cache.stats()["hits_disk"] == 40


def test_a_save_is_dropped_when_every_buffer_is_queued(tmp_path: Path) -> None:
    with open_cache(tmp_path / "s", "lmdb", host_bytes=0, write_queue_bytes=2 * CHUNK_BYTES) as cache:
        cache.store.backend._write_lock.acquire()  # the disk "hangs": queued buffers stay in use
        try:
            for seed in range(4):
                toks = tokens(seed, CHUNK)
                cache.save(toks, make_kv(toks))
            assert cache.store.pool.created <= 2
            assert cache.stats()["dropped_saves"] >= 1
        finally:
            cache.store.backend._write_lock.release()
        assert cache.flush(30)


def test_a_flush_gives_the_buffers_back(tmp_path: Path) -> None:
    """Regression: the writer thread kept its last batch referenced while it waited for the
    next, so a save right after flush() found the pool full and was dropped (15 of 64 chunks
    in a run of the prefetch benchmark's store build)."""
    with open_cache(tmp_path / "s", "files", host_bytes=0, write_queue_bytes=2 * CHUNK_BYTES) as cache:
        for seed in range(12):  # each round fills the whole pool (the queue's 2 chunks)
            toks = tokens(seed, 2 * CHUNK)
            cache.save(toks, make_kv(toks))
            assert cache.flush(30)
        stats = cache.stats()
    assert stats["dropped_saves"] == 0 and stats["disk_records"] == 24


def test_a_lingering_io_thread_keeps_no_chunk_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a pool thread that wrote a chunk still held its work item (with the
    chunk's buffer among the call's arguments) while it signalled the result to the event
    loop, so on a busy machine the batch could finish, flush() return, and the next save
    find the pool full (3 of 30 runs of the test above with the cores busy, stacks taken at
    the drop). Here every pool thread lingers after each call, and there are threads enough
    that the others go on meanwhile."""
    real_run = thread._WorkItem.run

    def run_then_linger(self: thread._WorkItem) -> None:  # type: ignore[name-defined]
        real_run(self)
        time.sleep(0.2)  # descheduled before it drops the work item

    monkeypatch.setattr(thread._WorkItem, "run", run_then_linger)
    real_write = files._write_view
    full = [True]  # the first batch's writes fail: the errors' tracebacks held the buffers too

    def write_view(*args: object) -> int:
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real_write(*args)

    monkeypatch.setattr(files, "_write_view", write_view)
    with open_cache(tmp_path / "s", "files", host_bytes=0, write_queue_bytes=2 * CHUNK_BYTES,
                    io_threads=16) as cache:
        for seed in range(4):
            toks = tokens(seed, 2 * CHUNK)
            cache.save(toks, make_kv(toks))
            assert cache.flush(30)
            full[0] = False
        stats = cache.stats()
    # the 2 chunks whose writes failed are dropped (and counted); every later save is kept
    assert stats["dropped_saves"] == 2 and stats["disk_records"] == 6


def test_a_reservation_the_host_cannot_hold_is_refused_before_anything_is_allocated(
        beyond_this_machine: int, forbid_pool_allocations: Callable[[], AbstractContextManager[None]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's pool of twice the machine's memory and swap: refused with what to change,
    before any allocation (which the kernel may let through, and then kill the process that
    touches it; here an allocation fails the test instead); the pool has made no slot and
    still counts none. ``KVTIER_HOST_MEMORY_CHECK=off`` (a host that can free more than it
    says) skips the check."""
    pool = BufferPool(beyond_this_machine, pin=False)
    with forbid_pool_allocations(), pytest.raises(ConfigError) as err:
        pool.reserve((1 << 30,), torch.uint8)  # (1 GiB chunks)
    msg = str(err.value)
    assert "can take" in msg and "Lower host_bytes, write_queue_bytes or remote_queue_bytes" in msg, msg
    assert "KVTIER_HOST_MEMORY_CHECK=off" in msg
    assert pool.created == 0 and pool.allocated_bytes == 0
    monkeypatch.setenv("KVTIER_HOST_MEMORY_CHECK", "off")
    with forbid_pool_allocations(), pytest.raises(AssertionError, match="the check let it through"):
        BufferPool(beyond_this_machine, pin=False).reserve((1 << 30,), torch.uint8)


def test_a_reservation_whose_allocation_fails_says_what_to_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the allocation itself fails (cudaHostAlloc refusing to pin, which only a GPU
    machine can do for real; here PyTorch's error stands in for it): a ConfigError with the
    allocator's own words and what to change, and the slots it counted given back. A lazy
    allocation (a library cache, one slot at a time) keeps PyTorch's error, and so does a
    failure that is not for lack of memory."""
    error = "CUDA error: out of memory"

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError(error)

    monkeypatch.setattr(torch, "empty", refuse)
    pool = BufferPool(40 << 20, pin=True)
    with pytest.raises(ConfigError, match="allocating 32.0 MiB failed: CUDA error: out of memory") as err:
        pool.reserve((1 << 20,), torch.uint8)
    assert "Lower host_bytes" in str(err.value) and "in all (pinned)" in str(err.value)
    assert pool.allocated_bytes == 0 and pool.created == 0
    lazy = BufferPool(40 << 20, pin=True)
    with pytest.raises(RuntimeError, match="out of memory") as err:
        lazy.acquire((1 << 20,), torch.uint8)
    assert not isinstance(err.value, ConfigError) and lazy.allocated_bytes == 0
    error = "Cannot re-initialize CUDA in forked subprocess"
    with pytest.raises(RuntimeError, match="re-initialize") as err:
        BufferPool(40 << 20, pin=True).reserve((1 << 20,), torch.uint8)
    assert not isinstance(err.value, ConfigError)
