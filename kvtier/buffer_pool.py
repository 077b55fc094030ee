"""Host buffers for chunks, allocated once and reused: no allocation per chunk in steady state.

Allocating a fresh 32 MiB buffer per chunk is slow where it matters: fresh pages are touched
at a fraction of memory speed (0.35 GiB/s on the VMs this was measured on), and pinned
allocations with CUDA take tens of milliseconds each. The pool hands out slots of one size
(the largest chunk asked for, in whole pages plus one, page-aligned), pre-touched when
created (pinned with CUDA), up to a byte cap, either as they are first needed or all at
once (:meth:`BufferPool.reserve`, what a serving worker does when it starts). A slot comes
back to the pool when the last tensor or array using its memory is gone, whoever held it
(the write queue, the host tier, a load in flight), so a slot is never reused while
anything still reads it. When the cap is reached and no slot is free,
:meth:`BufferPool.acquire` returns None and the caller decides: a save is dropped and
counted, never allocated.

:class:`ResultMemory` is for the other kind of buffer: tensors handed to a caller to keep
(a load's result), each in a map of its own that goes back to the system when dropped.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvtier.anon_memory import anonymous_map
from kvtier.errors import ConfigError
from kvtier.host_claims import MemoryShort, claim
from kvtier.units import format_size

_PAGE = 4096
# Tensors handed to a caller at least this large get a memory map of their own (``ResultMemory``).
_OWN_MAP_BYTES = 256 * 1024

class _Guard:
    """A lock for a pool whose items come back through ``weakref.finalize`` callbacks.

    A finalizer can run on any thread at any moment, including on a thread that holds this
    very lock: from Python 3.12 a garbage collection runs at the interpreter's periodic
    checks (a loop's back edge, a call), so collecting a cycle that holds a tensor can call
    the finalizer inside a locked section, and a plain ``with lock`` there deadlocks. So a
    finalizer hands its item back with :meth:`give_back`, which never blocks: it applies
    the item at once if the lock is free, else leaves it for whoever holds the lock (or
    takes it next) to apply on entering or leaving it.

    The item is queued first, then applied if the lock is free: a Ctrl-C landing in the
    finalizer after that (while it takes the lock) leaves it queued for the next holder,
    instead of losing it (a lost slot shrinks the pool for the process's life). (Not
    re-queued if applying it is cut short: a slot handed out twice is worse than one lost.)
    """

    def __init__(self, apply: Callable[[Any], None]) -> None:
        self.lock = threading.Lock()
        self._apply = apply  # called with the lock held
        self._later: deque[Any] = deque()

    def give_back(self, item: Any) -> None:
        self._later.append(item)  # atomic; no lock
        if self.lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self.lock.release()

    def __enter__(self) -> _Guard:
        self.lock.acquire()
        self._drain()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._drain()
        finally:
            self.lock.release()

    def _drain(self) -> None:
        while self._later:
            self._apply(self._later.popleft())

    def after_fork_in_child(self) -> None:
        self.lock = threading.Lock()


class BufferPool:
    def __init__(self, cap_bytes: int, *, pin: bool | None = None) -> None:
        self.cap_bytes = cap_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.chunk_bytes = 0  # the largest chunk asked for: what each slot counts against the cap
        self.slot_bytes = 0  # what each slot takes: chunk_bytes in whole pages, plus one
        self._free: list[np.ndarray] = []
        self._slots = 0  # slots of the current size that exist (free or in use)
        self._lock = _Guard(self._take_back)
        self.created = 0  # slots ever allocated (steady state: stops growing)
        self._closed = False
        # reserved (a serving worker): slots keep their size; a larger chunk gets none (a
        # record of another shape read from the store would otherwise drop every reserved slot)
        self._fixed = False

    @property
    def allocated_bytes(self) -> int:
        """Chunk bytes the slots that exist hold (what the cap bounds)."""
        return self._slots * self.chunk_bytes

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self, shape: tuple[int, ...], dtype: torch.dtype,
                reclaim: Callable[[], bool] | None = None, *, lead: int = 0) -> torch.Tensor | None:
        """A tensor of ``shape`` and ``dtype`` on a pooled slot, or None if the pool is full.

        ``reclaim`` is called while the pool is full to let a holder of slots release one
        (e.g. the host tier evicting its least recently used chunk); it returns False when
        it has nothing left to give.

        ``lead`` (less than a page, a multiple of the element size): the tensor starts that
        many bytes into its storage, which starts on a page and runs to the slot's end. A
        record read whole into the storage (header first) then leaves its payload exactly in
        the tensor: what lets a file be read with ``O_DIRECT`` straight into a pooled slot.
        """
        itemsize = dtype.itemsize
        nbytes = _nbytes(shape, dtype)
        if not 0 <= lead < _PAGE or lead % itemsize:
            raise ValueError(f"lead {lead}: must be below {_PAGE} and a multiple of {itemsize}")
        if self._fixed and nbytes > self.chunk_bytes:
            return None  # (larger than the reserved slots: nothing to reclaim for it)
        while True:
            slot = self._take(nbytes)
            if slot is not None:
                break
            if reclaim is None or not reclaim():
                return None
        return _lend(slot[:] if lead else slot[:nbytes], lead, shape, dtype, self._lock.give_back, slot)

    def reserve(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Allocate and touch, now, every slot the cap allows for chunks of ``shape``: in one
        allocation (one pinned allocation with CUDA, not one per slot). A serving worker
        calls this at start-up, so that no step ever allocates (the first saves would
        otherwise pay for new pinned memory on the model's thread). Slots are cut from it
        as views; it is freed when the last of them is. From then on slots keep that size:
        :meth:`acquire` of a larger chunk returns None. Returns the slots made."""
        with self._lock:
            self._fit(_nbytes(shape, dtype))
            self._fixed = True
            count = self.cap_bytes // self.chunk_bytes - self._slots if self.chunk_bytes else 0
            if count <= 0:
                return 0
            self._slots += count
            size = self.slot_bytes
        slots = self._make(count, size, reserving=True)
        with self._lock:
            self._free.extend(slots)
        return count

    def close(self) -> None:
        """Let go of the free slots, and of each slot in use when it comes back (and with
        them of the memory reserved): the store is closed."""
        with self._lock:
            self._closed = True
            self._free.clear()
            self._slots = 0
        if self.pin:
            release_pinned_cache()

    def _take(self, nbytes: int) -> np.ndarray | None:
        with self._lock:
            self._fit(nbytes)
            if self._free:
                return self._free.pop()
            # the cap counts chunks: a slot's spare page (or two) is not charged to it
            if (self._slots + 1) * self.chunk_bytes > self.cap_bytes:
                return None
            self._slots += 1
            size = self.slot_bytes
        return self._make(1, size)[0]

    def _fit(self, nbytes: int) -> None:
        """(Under the lock.) A larger chunk than any so far: from now on slots have its size
        (the free smaller ones are dropped; those in use are dropped when they come back), in
        whole pages and one more (room for a record's header before it)."""
        if nbytes > self.chunk_bytes:
            self._free.clear()
            self._slots = 0
            self.chunk_bytes = nbytes
            self.slot_bytes = _slot_bytes(nbytes)

    def _make(self, count: int, size: int, *, reserving: bool = False) -> list[np.ndarray]:
        """``count`` slots of ``size`` bytes, cut from as few allocations as can hold them
        (:func:`arena_pieces`); the caller has counted them in ``_slots`` (under the lock,
        with the cap), and gets that back on failure. ``reserving`` (:meth:`reserve`, all
        at once): refused with a ``ConfigError`` where the host has not that much memory left,
        and an allocation that fails is one too."""
        slots: list[np.ndarray] = []
        pieces = arena_pieces(count, size, pinned=self.pin)
        need = sum(nbytes for nbytes, _ in pieces)
        try:
            with contextlib.ExitStack() as claimed:
                if reserving:
                    self._claim_room(claimed, need, count, size)
                for nbytes, n in pieces:
                    try:
                        arena = self._new_arena(nbytes, n * size)
                    except RuntimeError as exc:
                        if not reserving or not _out_of_memory(exc):
                            raise
                        slots.clear()  # (the pieces made so far: not kept by the error's frames)
                        raise ConfigError(self._too_much(need, count, size,
                                                         f"allocating {format_size(nbytes)} failed: {exc}")) from exc
                    slots.extend(arena[i * size : (i + 1) * size] for i in range(n))
                    del arena
        except BaseException:
            with self._lock:
                self._slots -= count
            if reserving and self.pin:
                slots.clear()
                release_pinned_cache()  # (the pieces made before the failure, pinned for nothing)
            raise
        self.created += count
        return slots

    def _claim_room(self, claimed: contextlib.ExitStack, need: int, count: int, size: int) -> None:
        """Claim ``need`` bytes of host memory until ``claimed`` closes, or refuse a reservation
        the host cannot hold (see :mod:`kvtier.host_claims`): touching it would bring the OOM
        killer, not an error."""
        if os.environ.get("KVTIER_HOST_MEMORY_CHECK", "").strip().lower() == "off":
            return  # (a host that can free more than it says: the user's call)
        try:
            claimed.enter_context(claim(need))
        except MemoryShort as short:
            others = (f", less what {short.pending} other kvtier worker(s) on this host are reserving "
                      "at the same time" if short.pending else "")
            raise ConfigError(self._too_much(need, count, size, (
                f"this process can take {format_size(short.room)} of host memory now (what the kernel "
                f"counts as available, within the container's memory limit{others}; if the host can "
                "free more, KVTIER_HOST_MEMORY_CHECK=off skips this check)"))) from None

    def _too_much(self, need: int, count: int, size: int, why: str) -> str:
        pinned = " (pinned)" if self.pin else ""
        return (f"kvtier cannot reserve its chunk buffers: host_bytes + write_queue_bytes (and "
                f"remote_queue_bytes with a remote tier), {format_size(self.cap_bytes)}, make {count} "
                f"buffers of {format_size(size)}, {format_size(need)} in all{pinned}, and {why}. Lower "
                f"host_bytes, write_queue_bytes or remote_queue_bytes: every worker process (each "
                f"tensor-parallel rank) reserves its own")

    def _new_arena(self, nbytes: int, used: int) -> np.ndarray:
        """``used`` bytes from the first page of a new allocation of ``nbytes`` (at least a
        page more), touched."""
        # page-aligned (pinned memory is; the CPU allocator aligns to 64 bytes): for O_DIRECT
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        start = -t.data_ptr() % _PAGE
        t = t[start : start + used]
        t.zero_()  # touch every page now, once, not on each use
        return t.numpy()

    def _take_back(self, slot: np.ndarray) -> None:
        """(Under the lock.) A slot nothing uses any more."""
        if len(slot) == self.slot_bytes and not self._closed:
            self._free.append(slot)
        # else: a slot of an earlier, smaller size: let it go

    def after_fork_in_child(self) -> None:
        self._lock.after_fork_in_child()


def arena_pieces(count: int, size: int, *, pinned: bool) -> list[tuple[int, int]]:
    """How to allocate ``count`` slots of ``size`` bytes: ``(bytes, slots)`` per allocation,
    each a page more than its slots (for alignment). Pageable memory: one allocation. Pinned
    memory: PyTorch's pinned allocator rounds every allocation up to a power of two (a
    1.25 GiB pool would pin 2 GiB, a 64.25 GiB one 128 GiB), so each allocation is a power of
    two, the largest that the slots left fill, down to one slot's: a few allocations, each
    wasting less than a slot."""
    if not pinned:
        return [(count * size + _PAGE, count)] if count else []
    out, left = [], count
    while left:
        nbytes = 1 << ((left * size + _PAGE).bit_length() - 1)  # (a power of two, at most what is left)
        if nbytes < size + _PAGE:  # less than one slot: the next power of two holds one
            nbytes <<= 1
        n = min(left, (nbytes - _PAGE) // size)
        out.append((nbytes, n))
        left -= n
    return out


def release_pinned_cache() -> None:
    """Give the pinned memory nothing uses back to the system. PyTorch keeps a freed pinned
    allocation in its cache for the next one of that size class, so without this a closed
    pool's allocations (a whole ``host_bytes``), or the pieces a refused reservation made
    before it failed, stay pinned for the life of the process: a retry with smaller budgets
    in the same process could not use them. (Frees every unused pinned allocation of the
    process, which the next pinned allocation pays for again: only when a pool closes or its
    reservation fails, never on a step.)"""
    if not torch.cuda.is_initialized():  # (nothing was pinned; and the call raises without a device)
        return
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:  # (PyTorch before 2.9)
        empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def _out_of_memory(exc: RuntimeError) -> bool:
    """Whether PyTorch's error says an allocation found no memory (pageable: "can't allocate
    memory"; pinned: "out of memory"), not some other failure (CUDA not initialized...)."""
    text = str(exc).lower()
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or "allocate memory" in text


def _slot_bytes(chunk_bytes: int) -> int:
    """A slot for chunks of ``chunk_bytes``: in whole pages, and one more (room for a record's
    header before the chunk)."""
    return -(-chunk_bytes // _PAGE) * _PAGE + _PAGE


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    # (math.prod: Python ints never overflow; numpy's prod cost 12 µs, per chunk, on the
    # model's thread)
    return math.prod(shape) * dtype.itemsize


def _lend(memory: np.ndarray, start: int, shape: tuple[int, ...], dtype: torch.dtype,
          give_back: Callable[[Any], None] | None, item: object) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` at byte ``start`` of ``memory`` (bytes, a new array
    object made for this one use); ``give_back(item)`` runs once nothing uses that memory any
    more: no tensor, view or array, since the tensor's storage keeps ``memory`` alive."""
    if give_back is not None:
        weakref.finalize(memory, give_back, item)
    if not math.prod(shape):
        return torch.empty(shape, dtype=dtype)  # (no memory to use: ``memory`` goes back now)
    # the storage is all of ``memory`` (an O_DIRECT read fills it from its first byte), the
    # tensor ``start`` bytes into it: one PyTorch operation, where from_numpy, a slice and two
    # views took four (a save takes a buffer per chunk in a layer hook, while the device may
    # have little compute queued)
    assert not start % dtype.itemsize and not len(memory) % dtype.itemsize  # (whole elements)
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return torch.frombuffer(memory, dtype=dtype).as_strided(shape, strides[::-1], start // dtype.itemsize)


class ResultMemory:
    """Memory for tensors handed to a caller to keep as long as it likes (``KVCache.load``'s
    result, a chunk loaded when the pool is full): an anonymous map per tensor, returned to
    the system when the last tensor using it is gone, except the most recently freed
    ``keep_bytes``, kept mapped for the next results.

    Why not ``torch.empty``: it takes large tensors from glibc's heap once glibc's adaptive
    mmap threshold has risen (after the first large free, up to 32 MiB), and glibc keeps
    what is freed there. A process that loads a few MiB of KV per request and drops it grew
    by hundreds of MiB it never gave back. Why keep some: a fresh map is paid for in page
    faults on first touch (3.6 GiB/s measured on a 2-core VM, against 70 GiB/s to reuse
    memory), so a steady stream of results reuses the same few maps.
    """

    def __init__(self, keep_bytes: int = 32 << 20) -> None:
        self.keep_bytes = keep_bytes
        self._free: list[mmap.mmap] = []  # oldest first
        self._kept = 0
        self._lock = _Guard(self._take_back)
        self.mapped = 0  # maps ever made (steady state: stops growing)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new CPU tensor, contents unspecified."""
        nbytes = _nbytes(shape, dtype)
        if nbytes < _OWN_MAP_BYTES:  # below glibc's own mmap threshold's range: the heap is fine
            return torch.empty(shape, dtype=dtype)
        m = self._take(nbytes)
        # a map larger than what is kept is simply unmapped when its array goes
        give_back = self._lock.give_back if len(m) <= self.keep_bytes else None
        return _lend(np.frombuffer(m, dtype=np.uint8, count=nbytes), 0, shape, dtype, give_back, m)

    def _take(self, nbytes: int) -> mmap.mmap:
        with self._lock:
            best = None
            for m in self._free:
                if len(m) >= nbytes and (best is None or len(m) < len(best)):
                    best = m
            if best is not None:
                self._free.remove(best)
                self._kept -= len(best)
                return best
            self.mapped += 1
        return anonymous_map(_size_class(nbytes))

    def _take_back(self, m: mmap.mmap) -> None:
        """(Under the lock.) A map no result uses any more: kept, the oldest unmapped."""
        self._free.append(m)
        self._kept += len(m)
        while self._kept > self.keep_bytes:
            self._kept -= len(self._free.pop(0))

    def clear(self) -> None:
        """Unmap every kept map (the store is closed)."""
        with self._lock:
            self._free.clear()
            self._kept = 0

    def after_fork_in_child(self) -> None:
        self._lock.after_fork_in_child()


def _size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to one of eight sizes per power of two (at most 12.5% more, in
    whole pages): results of similar sizes then fit each other's kept maps."""
    step = max(_PAGE, 1 << max(nbytes.bit_length() - 4, 0))
    return -(-nbytes // step) * step
