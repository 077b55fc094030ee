"""The tiered chunk store: a host-memory tier over one persistent backend.

Saves are write-behind: ``put`` puts the chunk in the host tier and on a bounded queue and
returns at once; a writer thread encodes queued chunks in batches, and a committer thread
writes and publishes each batch (group commit) while the writer prepares the next; the
commit itself evicts, across every process's records, down to the store's
budget. When the queue is full, a save is dropped and counted rather than blocking the
caller. Loads check the host tier, then the queue, then the backend, and say what happened
(:class:`Outcome`): only a record proven corrupt is removed. Nothing here raises into a
serving loop for a storage fault.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import numbers
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from kvtier import codec, forksafe
from kvtier.backends import PutItem, open_shared
from kvtier.backends.base import EVICT_LOW_WATERMARK, EntryInfo, most_recent
from kvtier.backends.index import WRITER_BEAT_S
from kvtier.backends.lmdb_check import full_cause
from kvtier.backends.payloads import ViewReader, oversized
from kvtier.background import RateLimitedLog, take_batch, wait_while
from kvtier.buffer_pool import BufferPool, ResultMemory
from kvtier.config import CacheConfig
from kvtier.errors import (
    ConfigError,
    DestinationMismatch,
    IncompatibleRecord,
    RecordError,
    RecordTooLarge,
    StoreError,
)
from kvtier.host_tier import HostTier
from kvtier.keys import KEY_BYTES, NAMESPACE_ID_BYTES
from kvtier.metrics import Counters
from kvtier.remote import RemoteTier, open_remote
from kvtier.remote.tier import RemoteMiss

log = logging.getLogger("kvtier")
_ENFORCE_STEP_BYTES = 1 << 30  # most a budget check evicts in one index commit
# How often the writer looks at its queue when nothing woke it (a heartbeat due; a put that
# did not wake it would wait this long to be written)
WRITER_POLL_S = 1.0


class Outcome(Enum):
    """What a load found. Only ``CORRUPT`` (a checksum or structure proven wrong) deletes."""

    HIT = "hit"
    MISS = "miss"  # not stored (or evicted meanwhile)
    CORRUPT = "corrupt"
    INCOMPATIBLE = "incompatible"  # intact, another record-format version: kept
    TOO_LARGE = "too_large"  # intact, over this process's max_record_bytes: kept
    IO_ERROR = "io_error"
    TIMED_OUT = "timed_out"  # no answer within read_timeout_s (a hung mount?): kept, a miss


@dataclass
class Loaded:
    outcome: Outcome
    tensor: torch.Tensor | None = None
    why: str = ""


@dataclass
class _Pending:
    key: bytes
    tensor: torch.Tensor
    namespace_id: bytes
    token_start: int
    num_tokens: int
    group: bytes | None
    parent: bytes | None
    head: bytes | None
    from_remote: bool = False  # promoted from the remote tier: not uploaded back
    ready: Callable[[], object] | None = None  # waits until the tensor's bytes are there
    replace: bool = False  # replaces a stored record of the key (see PutItem.replace)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


_LIVE_STORES: weakref.WeakSet[ChunkStore] = weakref.WeakSet()


def _kind_of(value: object) -> str:
    """An argument as an error message shows it: its type, and the length of bytes."""
    return f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__


def _check_keys(call: str, keys: object) -> None:
    """Refuse keys that are not a sequence of chunk keys: a lookup would count the error as
    an I/O error and answer a miss, and one key where a list goes is its bytes, one by one."""
    if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Sequence):
        raise TypeError(f"{call}: keys must be a list of {KEY_BYTES}-byte keys, got {_kind_of(keys)}"
                        + (" (put one key in a list)" if isinstance(keys, bytes) else ""))
    for k in keys:
        if not isinstance(k, bytes) or len(k) != KEY_BYTES:
            raise TypeError(f"{call}: each key must be {KEY_BYTES} bytes, got {_kind_of(k)}")


def _stores_after_fork_in_child() -> None:
    for store in list(_LIVE_STORES):
        store._after_fork_in_child()


forksafe.register(forksafe.STORE, after_in_child=_stores_after_fork_in_child)


def _flush_stores_at_exit() -> None:
    """Commit what open stores have queued, at interpreter exit.

    At exit Python stops every ``ThreadPoolExecutor`` from taking work (its own hook, run
    from ``threading._shutdown``) before ``atexit`` handlers and finalizers run, so a store
    closed that late (an in-process vLLM engine's, a cache never closed) could not write
    what it had queued: the files backend's writes go through a pool. Hooks registered
    later run first, so this one runs before the pools stop; it runs again from ``atexit``,
    after the threads that outlived the main one are joined. Each bounded by the store's
    ``close_timeout_s``. (``os._exit`` and a signal's default action run neither.)"""
    for store in list(_LIVE_STORES):
        if store.closed or store.readonly or store._exit_flush_gave_up:
            continue
        # A store whose writer made no progress in a whole close_timeout_s (a hung disk) is
        # not waited for again: the exit costs one timeout, not one per run of this. One
        # that is still committing (a thread still saving) is waited for again. Marked
        # before waiting, so a Ctrl-C here does not make the next run wait too.
        store._exit_flush_gave_up = True
        before = store.counters.snapshot()
        try:
            drained = store.flush(float(store.config.close_timeout_s))
        except Exception:  # never fail the interpreter's exit
            continue
        after = store.counters.snapshot()
        progress = any(after[k] != before[k] for k in ("saves_committed", "dropped_saves", "saves_duplicate"))
        store._exit_flush_gave_up = not drained and not progress


with contextlib.suppress(AttributeError, RuntimeError):  # (private: absent in some Pythons)
    threading._register_atexit(_flush_stores_at_exit)  # type: ignore[attr-defined]
# and again once Python has joined the threads that were still running (their saves came
# after the first flush; the files backend then writes on its own thread, pools being shut)
atexit.register(_flush_stores_at_exit)


class ChunkStore:
    """Chunks (tensors in the canonical layout) under 32-byte keys, in host memory and on disk."""

    def __init__(self, config: CacheConfig, *, readonly: bool = False) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"ChunkStore(config): expected a kvtier.CacheConfig, got {type(config).__name__} "
                            "(CacheConfig(path=...), or CacheConfig.from_dict({...}) for a dict of settings)")
        self.config = config
        self.readonly = readonly
        self.counters = Counters()
        self._warn = RateLimitedLog()
        # the remote tier first: connecting is lazy, and a missing client must not leave the
        # store locked behind a failed open
        self.remote: RemoteTier | None = open_remote(config, self.counters, writer=not readonly)
        try:
            self._lock, self.backend = open_shared(config, readonly=readonly)
        except BaseException:
            if self.remote is not None:
                self.remote.close(0)
            raise
        self.host = HostTier(config.host_bytes)
        # Saves and host-tier loads use pooled buffers: what the queue and the host tier hold
        # (and the remote tier's upload queue, which holds them until uploaded).
        self.pool = BufferPool(int(config.host_bytes) + int(config.write_queue_bytes)
                               + (int(config.remote_queue_bytes) if self.remote else 0))
        # what a caller keeps (a load's result, a chunk loaded while the pool is full)
        self.results = ResultMemory()
        # buffers handed out by buffer() and not yet written: only these may have a record's
        # header written in front of them (memory the store owns, written once); by id, as
        # tensors compare element by element
        self._fresh: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._pending: dict[bytes, _Pending] = {}
        self._queue: list[_Pending] = []
        self._queued_bytes = 0
        self._touched: dict[bytes, int] = {}
        self._cv = threading.Condition()
        self._deferred = threading.local()  # this thread's put_batch(): depth, and held (a wake-up held back)
        self._closed = False
        self._usage_at_close: dict[str, int] = {}  # the disk part of stats(), read at close
        self._exit_flush_gave_up = False  # (see _flush_stores_at_exit)
        self._loads = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvtier-load")
        # I/O thread -> when its read of the persistent tier began (see _stuck_reads)
        self._reads_since: dict[int, float] = {}
        # the store's own chores (orphan sweeps, budget checks): never in the way of a read
        self._chores = ThreadPoolExecutor(1, thread_name_prefix="kvtier-chores")
        self._start_writer()
        _LIVE_STORES.add(self)

    def _after_fork_in_child(self) -> None:
        """Threads do not survive ``fork()``: a child gets its own locks, an empty write queue
        (the parent commits what it had queued) and its own writer and load threads, so a
        store opened before forking keeps working in the child instead of hanging."""
        if self._closed:
            return
        # torch's own after-fork handler leaves its intra-op thread pool to be rebuilt by the
        # first thread that asks for it; two of this store's threads asking at once can find
        # none ("Invalid thread pool!", a load failed: 6 forks in 3,000 with 8 threads copying
        # at once). Rebuilt here, while this is the child's only thread: none in 3,000.
        with contextlib.suppress(Exception):  # (a torch without the pool: nothing to rebuild)
            torch.set_num_threads(torch.get_num_threads())
        self._cv = threading.Condition()
        self._deferred = threading.local()  # (the forking thread's put_batch does not go on here)
        self._pending, self._queue, self._touched = {}, [], {}
        self._queued_bytes = 0
        self.counters._lock = threading.Lock()
        self.host._lock = threading.Lock()
        self.pool.after_fork_in_child()
        self.results.after_fork_in_child()
        # the parent's sockets and upload thread are not ours: connect afresh
        self.remote = open_remote(self.config, self.counters, writer=not self.readonly)
        self._loads = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="kvtier-load")
        self._reads_since = {}  # (the parent's threads are not ours)
        self._chores = ThreadPoolExecutor(1, thread_name_prefix="kvtier-chores")
        self._start_writer(register=False)  # registers on its first save: many children never save

    def _start_writer(self, *, register: bool = True) -> None:
        """The writer and committer threads (see ``_write_loop``), with nothing in flight."""
        self._inflight = 0  # chunks taken off the queue and not yet stored or dropped
        self._taken_bytes = 0  # their bytes
        self._handoff: list | None = None  # a prepared batch (and its records) for the committer
        self._committing = False
        self._writer_done = False
        self._next_beat = float("inf")  # set by the registration
        self._registered = False
        self._writer = threading.Thread(target=self._write_loop, name="kvtier-writer", daemon=True)
        self._committer = threading.Thread(target=self._commit_loop, name="kvtier-committer", daemon=True)
        if not self.readonly:
            self._writer.start()
            self._committer.start()
            if register:
                self._register_writer()

    # -- saves ---------------------------------------------------------------------
    @contextlib.contextmanager
    def put_batch(self) -> Iterator[None]:
        """The :meth:`put` calls of this thread inside the block wake the writer once, at
        its end, rather than each (a step's saves: the model's thread hands over a dozen
        chunks at once). Woken per chunk, the writer thread takes the GIL and the queue's lock
        between the puts: a 16-chunk ``wait_for_save`` took 1.1-1.2 ms (median; p90 up to 3 ms)
        on a quiet 2-core VM against 0.35 ms, and a writer that got the GIL between two puts
        took the chunks in smaller batches. A put that has to wait for room (``wait_until``) wakes it
        first, and so does :meth:`flush` (or :meth:`close`) inside the block."""
        local = self._deferred
        local.depth = getattr(local, "depth", 0) + 1
        try:
            yield
        finally:
            local.depth -= 1
            if not local.depth:
                self._wake_deferred()

    def _notify_writer(self) -> None:
        """(Under ``_cv``.) New work for the writer: wake it, or note it for the end of
        this thread's :meth:`put_batch`."""
        if getattr(self._deferred, "depth", 0):
            self._deferred.held = True
        else:
            self._cv.notify_all()

    def _wake_deferred(self) -> None:
        """Wake the writer for the puts this thread's :meth:`put_batch` held back, if any
        (before anything that waits for the writer)."""
        if getattr(self._deferred, "held", False):
            self._deferred.held = False
            with self._cv:
                self._cv.notify_all()

    def _wait_for_room(self, nbytes: int, deadline: float) -> None:
        """Wait until the write queue can take ``nbytes`` more (or could never: then
        :meth:`put` drops the chunk), or the monotonic ``deadline``. Wakes the writer for
        this thread's held puts only where it waits (else a batch would go chunk by chunk)."""
        limit = int(self.config.write_queue_bytes)
        if nbytes > limit:
            return

        def full() -> bool:
            return not self._closed and self._queued_bytes > 0 and self._queued_bytes + nbytes > limit

        with self._cv:
            if not full():
                return
        self._wake_deferred()
        wait_while(self._cv, full, deadline)

    def buffer(self, shape: tuple[int, ...], dtype: torch.dtype, *,
               wait_until: float | None = None) -> torch.Tensor | None:
        """A pooled host buffer to fill with a chunk and hand to :meth:`put` (no allocation
        per chunk). None when every buffer is in use by the write queue or a load even after
        the host tier gave back what it could: the save is then dropped (and counted here).

        ``wait_until`` (a monotonic time; offline writers only, such as warm-up, never a
        server's loop) waits for the writer to give buffers back instead, until then."""
        self._refuse_if_closed("buffer")
        # the record's header fits in front of the chunk: the writer stores the record from
        # this buffer as it is (codec.record_in_place), no staging copy
        lead = codec.record_lead(shape, dtype)
        while (t := self.pool.acquire(shape, dtype, reclaim=self.host.evict_oldest, lead=lead)) is None:
            left = (wait_until or 0.0) - time.monotonic()
            if left > 0:
                self._wake_deferred()
            with self._cv:  # a committed batch gives its buffers back, then notifies
                if left <= 0 or self._closed or not (self._queue or self._inflight):
                    break  # (nothing being written would give one back: the caller holds them)
                self._cv.wait(min(left, 0.05))
        if t is None:
            self.counters.add(dropped_saves=1)
            self._warn.warning("pool", "kvtier: no free chunk buffer (the write queue, the host tier's "
                               "loads and the chunks being copied hold them all); dropping saves")
        else:
            self._fresh[id(t)] = t
        return t

    def put(self, key: bytes, tensor: torch.Tensor, *, namespace_id: bytes, token_start: int,
            num_tokens: int, group: bytes | None = None, parent: bytes | None = None,
            head: bytes | None = None, ready: Callable[[], object] | None = None,
            wait_until: float | None = None, replace: bool = False, _from_remote: bool = False) -> bool:
        """Queue a chunk for the persistent tier (and keep it in the host tier).

        ``parent`` is the key of the chunk this one extends (None for a chain's first chunk),
        ``head`` the key of the chain's first chunk, and ``group`` the chunk's rank-0 key
        under tensor parallelism: eviction keeps chains and rank tuples whole with them, and
        lookups read a prompt's chunks side by side. The store takes ownership of ``tensor`` (a CPU
        tensor; do not modify it afterwards). ``ready``, if given, returns once the tensor's
        bytes are all there (a device copy into it may still be in flight when ``put`` is
        called): the writer thread calls it before reading them, so the caller never waits.
        A record of ``key`` stored meanwhile (by any process) is kept and this copy dropped,
        unless ``replace`` (the caller could not load the stored one).
        Returns False if the save was dropped because the write queue is full or closed;
        with ``wait_until`` (a monotonic time; offline writers only, never a server's loop)
        it waits for the writer to make room instead, until then.
        """
        if self.readonly:
            raise RuntimeError("store opened read-only")
        # (a bad key would sit in the host tier, then fail in the writer, logged, far from here)
        for name, value, size in (("key", key, KEY_BYTES), ("namespace_id", namespace_id, NAMESPACE_ID_BYTES),
                                  ("group", group, KEY_BYTES), ("parent", parent, KEY_BYTES),
                                  ("head", head, KEY_BYTES)):
            if value is not None and (not isinstance(value, bytes) or len(value) != size):
                raise TypeError(f"put: {name} must be {size} bytes, got {_kind_of(value)}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"put: tensor must be a torch.Tensor, got {type(tensor).__name__}")
        # (a value the record's header cannot hold would fail in the writer, far from here)
        for name, value, low, high in (("token_start", token_start, 0, 2**64), ("num_tokens", num_tokens, 1, 2**32)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value < high:
                raise ValueError(f"put: {name} must be an integer in [{low}, 2**{high.bit_length() - 1}), got {value!r}")
        item = _Pending(key, tensor, namespace_id, token_start, num_tokens, group, parent, head,
                        _from_remote, ready, replace)
        if item.nbytes > self.config.max_record_bytes:  # no process with this limit could load it
            self.counters.add(dropped_saves=1)
            self._warn.warning("oversized", "kvtier: a %d-byte chunk is over max_record_bytes (%d): "
                               "dropping it; raise max_record_bytes or lower chunk_tokens",
                               item.nbytes, self.config.max_record_bytes)
            return False
        if wait_until is not None:
            self._wait_for_room(item.nbytes, wait_until)
        with self._cv:
            if self._closed or key in self._pending:
                return not self._closed
            if self._queued_bytes + item.nbytes > self.config.write_queue_bytes:
                self.counters.add(dropped_saves=1)
                self._warn.warning("queue", "kvtier: write queue full (%d bytes); dropping saves",
                                   self.config.write_queue_bytes)
                return False
            self._pending[key] = item
            self._queue.append(item)
            self._queued_bytes += item.nbytes
            self._notify_writer()
        self.counters.add(saves_queued=1, evicted_host=self.host.put(key, tensor))
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is committed (or dropped), and uploaded to the remote
        tier if there is one. True if drained."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._wake_deferred()  # (inside a put_batch: its puts are what this waits for)
        if not wait_while(self._cv, lambda: bool(self._queue or self._inflight), deadline):
            return False
        if self.remote is not None:
            return self.remote.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return True

    # -- the writer: two threads, so that preparing a batch overlaps writing the one before --
    def _write_loop(self) -> None:
        """Take batches off the queue and prepare them (wait for their device copies, encode
        and checksum them) on this thread, then hand each to the committer thread, which
        writes and publishes it. While the committer writes one batch, the next full batch
        is prepared here: the disk does not wait for a checksum or a device copy."""
        touched: dict[bytes, int] = {}
        try:
            while True:
                with self._cv:
                    # recent uses go to the index with a batch, or while the committer is
                    # idle: not one index commit per load while a batch is being written
                    while not (self._can_take() or (self._touched and not self._committing)
                               or (self._closed and not self._queue)
                               or time.monotonic() >= self._next_beat):
                        self._cv.wait(WRITER_POLL_S)
                    if self._closed and not self._queue:
                        touched, self._touched = self._touched, {}
                        break
                    beat_due = time.monotonic() >= self._next_beat
                    batch = take_batch(self._queue, self.config.commit_bytes) if self._can_take() else []
                    self._inflight += len(batch)
                    self._taken_bytes += sum(p.nbytes for p in batch)
                    touched = {}
                    if batch or not self._committing:
                        touched, self._touched = self._touched, {}
                if batch and not self._registered:  # (a forked child) before its first payload
                    self._register_writer()
                if touched:  # first: the next commit's eviction must see these recent uses
                    self._apply_touches(touched)
                if batch:
                    self._hand_over(batch)
                if beat_due and self._registered:  # idle or not: a stale row counts as gone
                    self._beat(self.backend.index.beat)
            if touched:  # the last uses too: the next process evicts by them
                self._apply_touches(touched)
        finally:
            with self._cv:
                self._writer_done = True
                self._cv.notify_all()

    def _can_take(self) -> bool:
        """(Under ``_cv``.) Whether the writer may take a batch now: the hand-over slot is
        free, and the committer is idle or a whole batch is queued (a smaller one taken
        while it writes would go out as a small batch of its own)."""
        return bool(self._queue) and self._handoff is None and (
            not self._committing or self._queued_bytes - self._taken_bytes >= self.config.commit_bytes)

    def _hand_over(self, batch: list[_Pending]) -> None:
        """Prepare ``batch`` and leave it in the slot for the committer."""
        items: list[PutItem] | None = None
        why = ""
        try:
            items = self._prepare(batch)
        except Exception as exc:  # e.g. a failed device copy: the batch is lost, not the writer
            why = str(exc) or type(exc).__name__  # the message only: its frames hold the buffers
        if items is None:  # released once the error (and the frames it holds) is gone
            self.counters.add(dropped_saves=len(batch), io_errors=1)
            self._warn.warning("writer", "kvtier: preparing %d chunks for the disk failed (%s); they "
                               "stay uncached", len(batch), why)
            self._forget_in_host(batch)  # (a failed device copy leaves its buffer's bytes unknown)
            self._release(batch)
            return
        with self._cv:
            self._handoff = [batch, items]  # the slot was free when the batch was taken
            self._cv.notify_all()

    def _commit_loop(self) -> None:
        """The committer thread: write and publish each prepared batch, in order."""
        while True:
            with self._cv:
                while self._handoff is None and not self._writer_done:
                    self._cv.wait(1.0)
                if self._handoff is None:
                    return
                work, self._handoff = self._handoff, None
                self._committing = True
                self._cv.notify_all()  # the slot is free: the writer may prepare the next batch
            try:
                self._commit(work[0], work[1])
            except Exception as exc:  # never let the committer die: count and carry on
                self.counters.add(io_errors=1)
                self._warn.warning("writer", "kvtier: writer error: %s", str(exc))
            finally:  # nothing of the batch may outlive its release (flush() returns then)
                batch = work[0]
                work.clear()
                self._release(batch, committed=True)

    def _forget_in_host(self, batch: list[_Pending]) -> None:
        """Drop ``batch``'s chunks from the host tier (a function of its own: no loop
        variable outlives it to keep a buffer from the pool)."""
        for p in batch:
            self.host.discard(p.key, p.tensor)

    def _release(self, batch: list[_Pending], *, committed: bool = False) -> None:
        """A batch is done with (stored, dropped or failed): its chunks leave the queue."""
        with self._cv:
            nbytes = sum(p.nbytes for p in batch)
            self._queued_bytes -= nbytes
            self._taken_bytes -= nbytes
            for k in [p.key for p in batch]:
                self._pending.pop(k, None)
            self._inflight -= len(batch)
            # no reference to a committed chunk may outlive this (not even a loop variable):
            # its buffer goes back to the pool before flush() returns
            batch.clear()
            if committed:
                self._committing = False
            self._cv.notify_all()

    def _apply_touches(self, touched: dict[bytes, int]) -> None:
        try:
            self.backend.touch(touched.keys(), max(touched.values()))
        except Exception as exc:  # LRU order is best effort; never lose the batch over it
            self.counters.add(io_errors=1)
            self._warn.warning("touch", "kvtier: recording uses failed: %s", exc)

    def _prepare(self, batch: list[_Pending]) -> list[PutItem]:
        """Encode ``batch`` as records (on the writer thread, never the model's)."""
        items = []
        for p in batch:
            if p.ready is not None:
                p.ready()  # the device copy into it
            header, payload = codec.encode(
                p.tensor, key=p.key, namespace_id=p.namespace_id, token_start=p.token_start,
                num_tokens=p.num_tokens, compression=self.config.compression,
                level=self.config.compression_level)
            # in place only in a buffer from buffer(), once: never in a caller's own memory, nor
            # twice in one buffer put under two keys
            fresh = self._fresh.pop(id(p.tensor), None) is p.tensor
            record = codec.record_in_place(p.tensor, header) if fresh and self.config.compression == "none" else None
            items.append(PutItem(p.key, header, payload, p.namespace_id, p.group, p.parent,
                                 p.token_start, p.num_tokens, p.head, record, replace=p.replace))
        return items

    def _count_failed_saves(self, n: int, errors: list[BaseException]) -> None:
        """``n`` saves dropped for ``errors``: a full file system is not an I/O error (the
        disk is fine; the operator should free space or lower disk_bytes)."""
        full = all(full_cause(e, self.config.path) is not None for e in errors)
        self.counters.add(dropped_saves=n, dropped_disk_full=n if full else 0, io_errors=0 if full else 1)

    def _commit(self, batch: list[_Pending], items: list[PutItem]) -> None:
        """Write and publish a prepared batch (on the committer thread)."""
        if self.remote is not None:  # write-behind to the shared tier, from the same bytes
            try:
                for p, item in zip(batch, items, strict=True):
                    if not p.from_remote:
                        self.remote.enqueue(item.key, item.header, item.payload)
            except Exception as exc:  # the local write goes on
                self.counters.add(io_errors=1)
                self._warn.warning("remote", "kvtier: queueing chunks for the remote tier failed (%s); "
                                   "they are stored locally only", str(exc))
        try:
            res = self.backend.put_many(items)
        except Exception as exc:  # the index commit failed (disk full, I/O, ...)
            self._count_failed_saves(len(batch), [exc])
            self._warn.warning("save", "kvtier: saving %d chunks failed (%s); they stay uncached",
                               len(batch), str(exc))
            return
        finally:
            items.clear()
        if res.failed:
            self._count_failed_saves(len(res.failed), [err for _, err in res.failed])
            self._warn.warning("save", "kvtier: %d of %d chunks could not be written (%s); they stay "
                               "uncached", len(res.failed), len(batch), str(res.failed[0][1]))
        kept_out = res.left_out + res.unreachable
        self.counters.add(saves_committed=len(res.stored) - len(kept_out),
                          bytes_saved=sum(i.size for i in res.stored) - sum(e.size for e in kept_out),
                          saves_duplicate=len(res.left_out), saves_unreachable=len(res.unreachable),
                          evicted_disk=len(res.evicted), evicted_disk_bytes=res.evicted_bytes)

    def _register_writer(self) -> None:
        """Record this process as a writer; if one was killed since (it never unregistered),
        sweep its orphan payloads in the background. A clean history costs no scan."""
        self._registered = True  # (counted even if the row's write fails: the beats retry it)
        self._beat(self.backend.index.register_writer)

    def _beat(self, beat: Callable[[], list[int] | None]) -> None:
        """Register or refresh this writer (see :meth:`StoreIndex.beat`), and sweep the
        orphans of any writer found gone, on a load thread (a scan of every payload)."""
        self._next_beat = time.monotonic() + WRITER_BEAT_S
        try:
            gone = beat()
        except Exception as exc:  # housekeeping: never fatal
            self._warn.warning("sweep", "kvtier: recording this writer in the index failed: %s", exc)
            return
        with contextlib.suppress(RuntimeError):  # closing: the next writer to open does these
            if gone is not None:
                self._chores.submit(self._sweep_orphans, set(gone))
            self._chores.submit(self._enforce_budget)

    def _enforce_budget(self) -> None:
        """Evict down to the store's budget if it is over it: commits evict, but a budget
        lowered at this open (or by another process) must hold without waiting for the next
        save, which a server that only loads may never make."""
        try:
            budget = self.backend.budget()
            occupied = self.backend.occupied()
            if occupied <= budget:
                return
            target = int(budget * EVICT_LOW_WATERMARK)
            while occupied > target and not self._closed:
                # in steps: one commit removing a whole store's worth would hold the index's
                # write lock (every writer's commits) for as long as it takes
                n, nbytes = self.backend.evict_lru(max(target, occupied - _ENFORCE_STEP_BYTES))
                self.counters.add(evicted_disk=n, evicted_disk_bytes=nbytes)
                if not n:
                    return  # what is left is leased to loads
                occupied = self.backend.occupied()
        except Exception as exc:  # housekeeping: never fatal
            self._warn.warning("sweep", "kvtier: evicting down to the store's budget failed: %s", exc)

    def _sweep_orphans(self, gone_writers: set[int]) -> None:
        try:
            self.counters.add(orphans_removed=self.backend.sweep_orphans(gone_writers=gone_writers))
        except Exception as exc:  # housekeeping: never fatal
            self._warn.warning("sweep", "kvtier: orphan sweep failed: %s", exc)

    # -- lookups and loads --------------------------------------------------------
    def count_present_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are stored or queued to be (the longest cached prefix).

        The store's index answers, not this process's memory: a chunk still in the host tier
        whose record another process evicted is not stored (other processes cannot load it,
        and a save must not be skipped for it)."""
        _check_keys("count_present_prefix", keys)
        n = 0
        try:
            while n < len(keys):
                if keys[n] in self._pending:
                    n += 1
                    continue
                m = self.backend.count_present_prefix(keys[n:])
                if m == 0:
                    break
                n += m
        except Exception as exc:
            self.counters.add(io_errors=1)
            self._warn.warning("lookup", "kvtier: lookup failed (%s); treating as a miss", exc)
        return n

    def present_each(self, keys: Sequence[bytes], *, remote: bool = False) -> list[bool]:
        """Whether each of ``keys`` is stored or queued to be, in one index read (all False if
        the index cannot be read: the saves then go ahead; the index keeps the first copy).
        With ``remote``, a key the remote tier holds counts too (one lookup there for the rest),
        as in :meth:`count_present_chain`."""
        _check_keys("present_each", keys)
        try:
            stored = self.backend.present_each(keys)
        except Exception as exc:
            self.counters.add(io_errors=1)
            self._warn.warning("lookup", "kvtier: lookup failed (%s); treating as a miss", exc)
            return [k in self._pending for k in keys]  # (as count_present_chain: no remote lookup either)
        there = [t or k in self._pending for k, t in zip(keys, stored, strict=True)]
        return there if not remote or self.remote is None else self.remote.or_present(keys, there)

    def queued_each(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` is queued in this process to be written (memory only:
        never waits for the index or the disk, so the model's thread may ask)."""
        pending = self._pending
        return [k in pending for k in keys]

    def count_present_chain(self, head: bytes, spans: Sequence[tuple[int, bytes]]) -> int:
        """:meth:`count_present_prefix` for a chain's chunks ``(token_start, key)`` whose first
        chunk's key is ``head``: the index reads them side by side (fast also when cold)."""
        _check_keys("count_present_chain", [head, *(k for _, k in spans)])
        if not spans:
            return 0
        try:
            n = self.backend.count_present_chain(head, spans)
        except Exception as exc:
            self.counters.add(io_errors=1)
            self._warn.warning("lookup", "kvtier: lookup failed (%s); treating as a miss", exc)
            return 0
        if n < len(spans) and spans[n][1] in self._pending:  # queued, not yet stored: counts too
            n += self.count_present_prefix([k for _, k in spans[n:]])
        if n < len(spans) and self.remote is not None:
            n += self.remote.count_present_prefix([k for _, k in spans[n:]])
        return n

    def get(self, key: bytes, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Load a chunk (into ``out`` if given); None unless it was a hit (see :meth:`load`
        for what happened instead). Never an exception for a storage fault. Without ``out``,
        a host-tier hit is the host tier's own tensor: read it, copy it, never change it
        (a change would be what later loads return)."""
        return self.load(key, out).tensor

    def load(self, key: bytes, out: torch.Tensor | None = None, *, out_is_scratch: bool = False) -> Loaded:
        """Load a chunk (into ``out`` if given) and say what happened (the tensor, as
        :meth:`get` says, is read-only without ``out``). With
        ``out_is_scratch``, ``out`` may be written before the record is verified (its contents
        are unspecified unless the outcome is a hit), which saves a copy of the record. An
        ``out`` of another shape or dtype than the chunk's is ``INCOMPATIBLE`` (the chunk is
        kept), whichever tier holds it. On a closed store, a :class:`StoreError`."""
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise TypeError(f"load: key must be {KEY_BYTES} bytes, got {_kind_of(key)}")
        self._refuse_if_closed("load")
        got = self._load_from_memory(key, out)
        return got if got is not None else self._load_from_backend(key, out, out_is_scratch)

    def _load_from_memory(self, key: bytes, out: torch.Tensor | None) -> Loaded | None:
        """A hit from the host tier or the write queue, or None. A chunk whose device copy
        may still be landing (``put``'s ``ready``) is waited for: the caller reads it on the
        host (a worker that copies it to the device on the stream that copied it out would
        not need to, but waits at most for that copy, and only for a chunk saved a step
        before). One whose copy failed is no hit, and leaves the host tier."""
        t = self.host.get(key)
        pending = self._pending.get(key)
        if t is None and pending is not None:
            t = pending.tensor
        if t is None:
            return None
        if out is not None:  # (as from the disk: a wrong destination is never a hit, and the chunk is kept)
            try:
                codec.check_destination(out, t.shape, t.dtype)
            except DestinationMismatch as exc:
                return self._failed(Outcome.INCOMPATIBLE, key, exc)
        if pending is not None and pending.ready is not None and pending.tensor is t:
            try:
                pending.ready()
            except Exception:  # (the writer drops and counts it, as it does every failed copy)
                self.host.discard(key, t)
                return None
        self.counters.add(hits_host=1, bytes_loaded=t.numel() * t.element_size())
        self.touch((key,))
        if out is not None:
            out.copy_(t)
            t = out
        return Loaded(Outcome.HIT, t)

    def _load_from_backend(self, key: bytes, out: torch.Tensor | None, out_is_scratch: bool,
                           record: tuple[EntryInfo, memoryview] | None = None) -> Loaded:
        """Load from the persistent tier; ``record``: an entry listed earlier and its bytes,
        already read by a bulk reader (the DALI prefetch), verified here like any read. Those
        bytes are that entry's version: a corrupt one removes that version only, never one
        written since (valid bytes are a hit: a key's content is the same in every version)."""
        def decode(reader: codec.RecordReader) -> torch.Tensor:
            return codec.decode_from(reader, expect_key=key, out=out, alloc=self._load_buffer,
                                     max_record_bytes=self.config.max_record_bytes,
                                     out_is_scratch=out_is_scratch)[1]

        entry: EntryInfo | None = None
        try:
            if record is not None:
                entry, data = record
                if len(data) > self.config.max_record_bytes + codec.MAX_HEADER_BYTES:  # (as the backends read)
                    raise oversized(data, len(data), int(self.config.max_record_bytes))
                t = decode(ViewReader(data))
            else:
                entry = self.backend.lookup(key)
                t = None if entry is None else self.backend.read_record(entry, decode)
        except (IncompatibleRecord, DestinationMismatch) as exc:  # intact: kept
            return self._failed(Outcome.INCOMPATIBLE, key, exc)
        except RecordTooLarge as exc:
            return self._failed(Outcome.TOO_LARGE, key, exc)
        except RecordError as exc:
            if entry is not None:
                self._remove_corrupt(entry)
            return self._failed(Outcome.CORRUPT, key, exc)
        except Exception as exc:
            return self._failed(Outcome.IO_ERROR, key, exc)
        if t is None:
            if entry is not None and record is None:
                self._drop_if_dangling(entry)
            if self.remote is not None:
                return self._load_from_remote(key, out)
            self.counters.add(misses=1)
            return Loaded(Outcome.MISS)
        self.counters.add(hits_disk=1, bytes_loaded=t.numel() * t.element_size())
        self.touch((key,))
        if out is None:
            self.counters.add(evicted_host=self.host.put(key, t))
        return Loaded(Outcome.HIT, t)

    def _load_from_remote(self, key: bytes, out: torch.Tensor | None) -> Loaded:
        """The remote tier's copy, verified like any record; a hit is promoted to the host
        tier and the local disk (not uploaded back)."""
        assert self.remote is not None
        rec = self.remote.fetch(key)
        if isinstance(rec, RemoteMiss):
            if rec.damage is not None:  # (removed there, as a corrupt local record is here)
                return self._failed(Outcome.CORRUPT, key, rec.damage)
            # not there, or the server could not say: not stored as far as this store knows
            # (a chunk recomputed is saved again), the remote tier's counters say which
            self.counters.add(misses=1)
            return Loaded(Outcome.MISS, why=rec.why)
        try:
            header, t = codec.decode_pieces(rec.header, rec.pieces, expect_key=key, out=out,
                                            alloc=self._load_buffer,
                                            max_record_bytes=self.config.max_record_bytes)
        except (IncompatibleRecord, DestinationMismatch) as exc:  # intact: kept
            return self._failed(Outcome.INCOMPATIBLE, key, exc)
        except RecordTooLarge as exc:
            return self._failed(Outcome.TOO_LARGE, key, exc)
        except RecordError as exc:
            self.remote.discard(key, rec)
            return self._failed(Outcome.CORRUPT, key, exc)
        self.counters.add(remote_hits=1, bytes_loaded=t.numel() * t.element_size())
        if not self.readonly:
            owned = t if out is None else self.buffer(tuple(t.shape), t.dtype)
            if owned is not None:
                if owned is not t:
                    owned.copy_(t)
                self.put(key, owned, namespace_id=header.namespace_id, token_start=header.token_start,
                         num_tokens=header.num_tokens, _from_remote=True)
        elif out is None:
            self.counters.add(evicted_host=self.host.put(key, t))
        return Loaded(Outcome.HIT, t)

    def reserve_buffers(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Allocate every chunk buffer the budgets allow (``host_bytes + write_queue_bytes``)
        now, for chunks of ``shape`` (see :meth:`BufferPool.reserve`); the buffers made."""
        self._refuse_if_closed("reserve_buffers")
        return self.pool.reserve(shape, dtype)

    def _refuse_if_closed(self, call: str) -> None:
        """A call on a closed store is a mistake of its caller, not a storage fault (a load
        would count an I/O error, a buffer would be handed out for a save that cannot be)."""
        if self._closed:
            raise StoreError(f"{self.config.path}: {call}: this store was closed; open it again")

    def _load_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, *, lead: int = 0) -> torch.Tensor:
        """Where a chunk loaded for the host tier is decoded: a pooled buffer if one is free
        (``lead``: see :meth:`BufferPool.acquire`)."""
        t = self.pool.acquire(shape, dtype, reclaim=self.host.evict_oldest, lead=lead)
        if t is None:  # every buffer is in use (queued saves, loads in flight): never fail a load
            self.counters.add(unpooled_loads=1)
            return self.results.empty(shape, dtype)
        return t

    _FAILURES = {
        Outcome.INCOMPATIBLE: ("incompatible_records", "kvtier: skipping record %s: %s"),
        Outcome.TOO_LARGE: ("oversized_records", "kvtier: skipping record %s: %s"),
        Outcome.CORRUPT: ("corrupt_records", "kvtier: corrupt record %s (%s); removed, will recompute"),
        Outcome.IO_ERROR: ("io_errors", "kvtier: reading %s failed (%s); treating as a miss"),
        Outcome.TIMED_OUT: ("read_timeouts", "kvtier: reading %s timed out (%s); treating as a miss"),
    }

    def _failed(self, outcome: Outcome, key: bytes, exc: Exception) -> Loaded:
        counter, msg = self._FAILURES[outcome]
        self.counters.add(misses=1, **{counter: 1})
        self._warn.warning(outcome.value, msg, key.hex()[:16], exc)
        return Loaded(outcome, why=str(exc))

    def _drop_if_dangling(self, entry: EntryInfo) -> None:
        """The payload of ``entry`` was not found. If the index still names that version
        (:meth:`Backend.still_names`), the entry can never load, and would keep the chunk from
        being saved again: drop it. Else a plain miss."""
        if self.readonly:
            return
        try:
            # (a read first: the common case, evicted meanwhile, needs no write transaction)
            if self.backend.still_names(entry) and self.backend.delete_entry(entry):
                self.counters.add(missing_payloads=1)
                self._warn.warning("missing", "kvtier: record %s had no payload file (removed by hand?); "
                                   "dropped from the index", entry.key.hex()[:16])
        except Exception as exc:  # housekeeping: the load is a miss either way
            self._warn.warning("delete", "kvtier: could not drop an index entry without payload: %s", exc)

    def _remove_corrupt(self, entry: EntryInfo) -> None:
        if self.readonly:
            return
        try:
            self.backend.delete_entry(entry)  # this version only: a rewrite meanwhile stays
        except Exception as exc:
            self._warn.warning("delete", "kvtier: could not remove corrupt record: %s", exc)

    def load_many(self, keys: Sequence[bytes], ahead: Callable[[], int] | None = None) -> Iterator[Loaded]:
        """Load several chunks (into the host tier, as :meth:`load`) in parallel on the I/O
        pool; yield what happened to each, in order, as each is ready. Never raises for a
        storage fault (an unexpected exception in a load is an ``IO_ERROR``).

        At most twice ``io_threads`` chunks (or ``ahead()``, asked before each read starts:
        several loads at once share that many) are read ahead of the one the caller is at:
        the I/O threads stay busy, and a long load holds a bounded number of buffers until
        the caller is done with the earlier ones (a 128k-token prompt is gigabytes of KV).

        A read with no answer ``read_timeout_s`` after it was asked for is ``TIMED_OUT``: the
        caller goes on, and the read is left to finish on its thread (it holds its own buffer,
        no one else's). While every I/O thread is held so, reads fail at once, without a wait.
        Reads not yet begun when the caller stops taking results are cancelled."""
        _check_keys("load_many", keys)
        if threading.current_thread().name.startswith("kvtier-load"):
            # serial on a pool thread: waiting there for the same pool could deadlock
            for k in keys:
                yield self._load_guarded(k)
            return
        # (even one read goes through the pool: that is what bounds the caller's wait)
        most = max(2, 2 * self.config.io_threads)
        ahead = ahead or (lambda: most)
        reads: collections.deque[tuple[bytes, Future[Loaded] | None, float]] = collections.deque()
        started = 0
        try:
            for _ in range(len(keys)):
                # this read and, before it is handed over, up to ahead() more
                while started < len(keys) and len(reads) <= max(1, ahead()):
                    reads.append(self._submit_read(keys[started]))
                    started += 1
                yield self._read_result(*reads.popleft())  # (no name keeps it here once handed over)
        finally:
            for _, fut, _ in reads:
                if fut is not None:
                    fut.cancel()

    def _submit_read(self, key: bytes) -> tuple[bytes, Future[Loaded] | None, float]:
        """A read of ``key``, ahead of its turn, and its deadline: from memory at once (the
        host tier, the write queue), else on the I/O pool; none where every I/O thread is held
        by a read older than ``read_timeout_s`` (it would only queue behind them)."""
        hit = self._load_from_memory(key, None)
        if hit is not None:
            done: Future[Loaded] = Future()
            done.set_result(hit)
            return key, done, 0.0
        if self._stuck_reads() >= self.config.io_threads:
            return key, None, 0.0
        return key, self._submit(self._load_guarded, key), time.monotonic() + float(self.config.read_timeout_s)

    def _read_result(self, key: bytes, fut: Future[Loaded] | None, deadline: float) -> Loaded:
        """What a read of :meth:`_submit_read` found, waiting at most until its deadline."""
        timeout = float(self.config.read_timeout_s)
        if fut is None:
            return self._failed(Outcome.TIMED_OUT, key, TimeoutError(
                f"not read: all {self.config.io_threads} I/O threads are held by reads that have not "
                f"returned within read_timeout_s ({timeout:g} s); is the store's file system hung?"))
        try:
            return self._result(fut, max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            pass
        if fut.cancel():  # never began: the I/O threads were busy all along
            return self._failed(Outcome.TIMED_OUT, key, TimeoutError(
                f"not begun within read_timeout_s ({timeout:g} s): every I/O thread was busy"))
        if fut.done():  # (it returned just now)
            return self._result(fut)
        return self._failed(Outcome.TIMED_OUT, key, TimeoutError(
            f"no answer within read_timeout_s ({timeout:g} s); the read goes on in the background"))

    def _stuck_reads(self) -> int:
        """I/O threads in a read of the persistent tier that began over ``read_timeout_s``
        ago, whether or not anyone still waits for it (a caller that gave up on a load leaves
        its other reads running)."""
        since = time.monotonic() - float(self.config.read_timeout_s)
        return sum(began < since for began in tuple(self._reads_since.values()))

    def _submit(self, fn: Callable[..., object], *args: object) -> Future[Any]:
        """``fn`` on the I/O pool; a pool that refuses (the store was closed meanwhile, or
        the interpreter is exiting) is a StoreError, not the pool's RuntimeError."""
        try:
            return self._loads.submit(fn, *args)
        except RuntimeError as exc:
            raise StoreError(f"{self.config.path}: the store was closed ({exc})") from None

    def _result(self, fut: Future[Any], timeout: float | None = None) -> Any:
        """A pool job's result; one that close() cancelled is a StoreError."""
        try:
            return fut.result(timeout)
        except CancelledError:
            raise StoreError(f"{self.config.path}: the store was closed while loading") from None

    def _load_guarded(self, key: bytes, out: torch.Tensor | None = None, *,
                      out_is_scratch: bool = False) -> Loaded:
        """:meth:`load` for the I/O pool: an unexpected exception (a destination that does
        not take the host tier's copy, a bug) is an ``IO_ERROR`` outcome, never raised. How
        long each I/O thread has been in its read is kept (``_stuck_reads``)."""
        me = threading.get_ident() if threading.current_thread().name.startswith("kvtier-load") else None
        if me is not None:
            self._reads_since[me] = time.monotonic()
        try:
            return self.load(key, out, out_is_scratch=out_is_scratch)
        except Exception as exc:  # defensive: load() turns storage faults into outcomes
            return self._failed(Outcome.IO_ERROR, key, exc)
        finally:
            if me is not None:
                self._reads_since.pop(me, None)

    def get_async(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor | None] | None = None
                  ) -> Future[list[torch.Tensor | None]]:
        """Load several chunks on the I/O pool; the future's result has None for misses."""
        _check_keys("get_async", keys)
        outs = list(outs) if outs is not None else [None] * len(keys)
        if len(outs) != len(keys):  # (else a zip error, raised by the future)
            raise ValueError(f"get_async: one destination per key ({len(keys)} keys, {len(outs)} outs)")
        return self._submit(lambda: [self.get(k, o) for k, o in zip(keys, outs, strict=True)])

    def load_into(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> int:
        """Load chunks straight into ``outs`` (one per key), in parallel on the I/O pool, and
        return how many leading chunks loaded: a miss or a bad record ends the prefix.

        Nothing goes into the host tier (a bulk load would only flush it); the destinations
        may be strided slices of one tensor. Destinations past the returned prefix hold
        unspecified bytes (uncompressed records are read straight into them, then verified).
        """
        _check_keys("load_into", keys)
        if len(keys) != len(outs):
            raise ValueError("one destination per key")

        def get(k: bytes, o: torch.Tensor) -> torch.Tensor | None:
            return self._load_guarded(k, o, out_is_scratch=True).tensor

        if len(keys) <= 1 or threading.current_thread().name.startswith("kvtier-load"):
            # serial on a pool thread: waiting there for the same pool could deadlock
            n = 0
            for k, o in zip(keys, outs, strict=True):
                if get(k, o) is None:
                    break
                n += 1
            return n
        futures = [self._submit(get, k, o) for k, o in zip(keys, outs, strict=True)]
        n = len(futures)
        for i, fut in enumerate(futures):
            if self._result(fut) is None:
                n = i
                break
        rest = futures[n + 1:]
        for fut in rest:  # not needed any more
            fut.cancel()
        # and those already running finish before we return: nothing writes into outs later
        wait(rest)
        return n

    def prefetch(self, keys: Sequence[bytes]) -> Future[int]:
        """Bring chunks into the host tier ahead of use; the future gives how many are there."""
        _check_keys("prefetch", keys)
        return self._submit(lambda: sum(self.get(k) is not None for k in keys))

    def prefetch_recent(self, namespace_id: bytes, max_bytes: int, reader: str = "default") -> Future[int]:
        """In the background: bring one namespace's most recently used chunks, up to
        ``max_bytes`` of records (and the host tier's budget), into the host tier; the future
        gives how many loaded. For a server's start-up, so its first hits come from memory.
        ``reader="dali"`` reads the record files in DALI pipelines (files backend, the
        ``dali`` extra); each record is verified as any load is."""
        if reader == "dali":
            from kvtier.dali_reader import require_dali

            require_dali()
            if self.config.backend != "files":
                raise ConfigError("prefetch_reader 'dali' reads record files: it needs backend 'files'")
        elif reader != "default":
            raise ConfigError(f"prefetch reader: must be 'default' or 'dali', got {reader!r}")

        def run() -> int:
            mine = (e for e in self.backend.entries() if e.namespace_id == namespace_id)
            chosen = most_recent(mine, min(max_bytes, self.host.budget))
            if reader == "default":  # several records at once, on the I/O pool
                return sum(got.outcome is Outcome.HIT for got in self.load_many([e.key for e in chosen]))
            from kvtier.dali_reader import read_files

            paths = [str(self.backend.payloads.path_of(e.key, e.location)) for e in chosen]
            loaded = 0
            for i, data in read_files(paths, threads=self.config.io_threads):
                if data is None:
                    self.counters.add(misses=1)  # evicted meanwhile
                else:
                    loaded += self._load_from_backend(chosen[i].key, None, False, (chosen[i], data)).outcome is Outcome.HIT
            return loaded

        # its own thread, not the I/O pool: load_many spreads the reads over that pool
        done: Future[int] = Future()

        def thread() -> None:
            try:
                done.set_result(run())
            except BaseException as exc:  # reported through the future, like a pool task
                done.set_exception(exc)

        threading.Thread(target=thread, name="kvtier-prefetch", daemon=True).start()
        return done

    def touch(self, keys: Iterable[bytes]) -> None:
        """Record a use of stored chunks for LRU eviction (a load, or a use no load saw:
        vLLM's own prefix cache held the chunk). Never waits: the writer thread applies uses
        in batches, before its next commit evicts."""
        if not self.readonly:
            now = time.time_ns()
            with self._cv:
                for key in keys:  # (no wake-up: the writer looks at least once a second)
                    self._touched[key] = now

    # -- lifecycle -------------------------------------------------------------------
    def stats(self) -> dict[str, object]:
        """Counters, usage and the budgets it is measured against; after :meth:`close`, the
        counters and the disk's usage and budget at close."""
        disk = self._usage_at_close if self._closed else self._disk_usage()
        with self._cv:
            queued = self._queued_bytes
        return {
            **self.counters.snapshot(),
            "host_bytes": self.host.nbytes, "host_chunks": len(self.host),
            "host_budget_bytes": self.host.budget,
            "queued_bytes": queued, "queue_budget_bytes": int(self.config.write_queue_bytes),
            # (no remote tier configured: both 0)
            "remote_queued_bytes": self.remote.queued_bytes if self.remote is not None else 0,
            "remote_queue_budget_bytes": self.remote.queue_bytes if self.remote is not None else 0,
            **disk,
        }

    def _disk_usage(self) -> dict[str, int]:
        """The persistent tier's usage, across every process, and the budget it is held to:
        the store's recorded ``disk_bytes`` (every writer enforces that one), which may not
        be this config's."""
        t = self.backend.index.totals()
        return {"disk_records": t.records, "disk_bytes": t.record_bytes,
                "disk_occupied_bytes": t.occupied, "disk_budget_bytes": self.backend.budget()}

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, flush: bool = True, timeout: float | None = None) -> None:
        """Commit what is queued (unless ``flush=False``), then release threads and files.

        Bounded by ``timeout`` (default: the ``close_timeout_s`` setting): what is not
        committed by then is dropped and counted, and a writer stuck in I/O (a hung disk)
        is left to finish in the background, holding the store open, instead of hanging
        the server's shutdown.
        """
        if self._closed:
            return
        timeout = float(self.config.close_timeout_s) if timeout is None else timeout
        deadline = time.monotonic() + timeout
        drained = True
        if flush and not self.readonly:
            drained = self.flush(timeout)
        try:  # what stats() says from now on
            self._usage_at_close = self._disk_usage()
        except Exception as exc:  # (an index that broke meanwhile): usage 0, this config's budget
            log.debug("kvtier: usage at close unreadable: %s", exc)
            self._usage_at_close = {"disk_records": 0, "disk_bytes": 0, "disk_occupied_bytes": 0,
                                    "disk_budget_bytes": int(self.config.disk_bytes)}
        with self._cv:
            if self._queue:  # abandon what is still queued, counted as dropped
                self.counters.add(dropped_saves=len(self._queue))
                for item in self._queue:
                    self._pending.pop(item.key, None)
                    self._queued_bytes -= item.nbytes
                self._queue.clear()
            self._closed = True
            self._cv.notify_all()
        # shut the pool first: a sweep the writer's last beat submits either starts before
        # this (and is listed, so joined) or is refused
        self._loads.shutdown(wait=False, cancel_futures=True)
        self._chores.shutdown(wait=False, cancel_futures=True)
        threads = [self._writer, self._committer, *getattr(self._loads, "_threads", ()),
                   *getattr(self._chores, "_threads", ())]
        for t in threads:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))
        if self.remote is not None:  # uploads what the local writer queued for it, then disconnects
            self.remote.close(max(0.0, deadline - time.monotonic()))
        if self._registered and not self._committer.is_alive() and not self._inflight:
            try:  # a clean close: nothing of ours is left unpublished
                self.backend.index.unregister_writer()
            except Exception as exc:
                self._warn.warning("sweep", "kvtier: unregistering as a writer failed: %s", exc)
        if any(t.is_alive() for t in threads):
            with self._cv:  # given up on: counted as dropped (they land if the disk recovers)
                self.counters.add(dropped_saves=self._inflight)
            log.warning("kvtier: %s: storage I/O did not finish within %.0f s of shutdown; %s"
                        "leaving it to finish in the background", self.config.path, timeout,
                        "" if drained else "queued saves were dropped; ")
            return  # closing the backend under a running thread could crash it
        self.backend.close()
        self.host.clear()
        self.pool.close()
        self.results.clear()
        self._lock.release()

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
