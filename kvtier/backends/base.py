"""A store's persistent tier: the shared index (what is stored) over a payload store (bytes).

``Backend`` is what the rest of kvtier uses. It never exposes a partial record: a record's
bytes are written (and synced, with ``durability="power"``) before the index commit that
names them, and a batch of records is published in one commit, so durability costs one
sync per batch. Budgets hold across every process that writes the store, because usage
and eviction live in the index they all share. Reads hand a view of the record to a
callback (a zero-copy LMDB view or a reused buffer): no per-read allocation.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import lmdb

from kvtier import forksafe
from kvtier.backends.index import (
    NO_KEY,
    ORPHAN_GRACE_S,
    EntryInfo,
    Lease,
    StoreIndex,
    budget_of,
    iter_unreferenced,
    new_location,
)
from kvtier.backends.lmdb_check import full_cause, unusable_store
from kvtier.backends.lmdb_env import EnvHandle
from kvtier.backends.payloads import PayloadStore, PutItem
from kvtier.codec import RecordReader
from kvtier.config import CacheConfig

T = TypeVar("T")
log = logging.getLogger("kvtier")
_MAX_UNREMOVED = 4096  # payloads kept for another removal try (beyond that, the oldest are left)

# Evict down to this fraction of the disk budget, so eviction runs in batches, not per save.
EVICT_LOW_WATERMARK = 0.9
# Free space kept on the store's filesystem (beyond the batch being written): room for the
# index's own commits, which a removal needs too.
DISK_RESERVE = 1 << 20

__all__ = ["Backend", "EntryInfo", "PutItem", "PutResult", "most_recent", "EVICT_LOW_WATERMARK"]


@dataclass
class PutResult:
    """What one ``put_many`` did."""

    stored: list[PutItem]
    failed: list[tuple[PutItem, BaseException]]
    evicted: list[EntryInfo]
    # of ``stored``: keys stored already, whose copies were left out (see StoreIndex.publish)
    left_out: list[EntryInfo] = field(default_factory=list)
    # of ``stored``: chunks whose parent was gone by the commit, left out (StoreIndex.publish)
    unreachable: list[EntryInfo] = field(default_factory=list)

    @property
    def evicted_bytes(self) -> int:
        return sum(e.size for e in self.evicted)


def most_recent(entries: Iterable[EntryInfo], max_bytes: int) -> list[EntryInfo]:
    """The most recently used entries, newest first, as long as their sizes add up to at most
    ``max_bytes`` (what prefetching reads first)."""
    chosen, total = [], 0
    for e in sorted(entries, key=lambda e: (-e.atime_ns, e.key)):
        if total + e.size > max_bytes:
            break
        chosen.append(e)
        total += e.size
    return chosen


class Backend:
    """The persistent tier of one store. Thread-safe; one instance per process and store."""

    def __init__(self, root: Path, config: CacheConfig, payloads: PayloadStore, *,
                 readonly: bool = False) -> None:
        self.root = root
        self.config = config
        self.readonly = readonly
        self.name = payloads.name
        self.index = StoreIndex(root, readonly=readonly, sync=config.durability == "power")
        self.payloads = payloads
        self._write_lock = threading.Lock()
        self.evicted_for_space = 0  # records evicted because the filesystem was full
        self._unremoved: list[EntryInfo] = []  # see _remove_payloads
        self._unremoved_lock = threading.Lock()
        _LIVE_BACKENDS.add(self)

    # -- writes ----------------------------------------------------------------------------
    def put_many(self, items: list[PutItem]) -> PutResult:
        """Store records: write their payloads, publish the ones written in one index commit
        (evicting, across every process's records, down to the store's budget), then remove
        the payloads that commit replaced or evicted. A record that failed does not hold
        back the others. Raises ``OSError`` only if the index commit itself fails."""
        if not items:
            return PutResult([], [], [])
        with self._write_lock:
            room = self._make_room_on_disk(sum(self.payloads.occupied(it.size) for it in items))
            locations = [new_location() for _ in items]
            errors = self.payloads.write_many(items, locations)
            room += self._retry_where_full(items, locations, errors)
            ok = [(it, loc) for it, loc, err in zip(items, locations, errors, strict=True) if err is None]
            failed = [(it, err) for it, err in zip(items, errors, strict=True) if err is not None]
            # In the order they were saved, a nanosecond apart: within a batch too, the least
            # recently saved goes first (one time for all left the order to the keys). The
            # chunks of one prompt share its first chunk's time (a chain is used as a whole).
            first, stamps = time.time_ns() - len(ok) + 1, {}
            for i, (it, _) in enumerate(ok):
                stamps[it.key] = stamps.get(it.parent, first + i) if it.parent else first + i
            new = [EntryInfo(it.key, it.size, stamps[it.key], it.namespace_id, occupied=self.payloads.occupied(it.size),
                             location=loc, group=it.group or it.key, parent=it.parent or NO_KEY,
                             token_start=it.token_start, num_tokens=it.num_tokens,
                             head=it.head or (it.key if it.parent is None else NO_KEY))
                   for it, loc in ok]
            try:
                done = self.index.publish(new, int(self.config.disk_bytes), EVICT_LOW_WATERMARK,
                                          replacing={it.key for it, _ in ok if it.replace})
            except Exception as exc:
                self._remove_payloads(new)  # never published: nobody can see them
                raise OSError(f"index commit failed: {exc}") from exc
            self._remove_payloads(done.replaced + done.evicted + done.left_out + done.unreachable)
        return PutResult([it for it, _ in ok], failed, room + done.evicted, done.left_out, done.unreachable)

    def _make_room_on_disk(self, need: int) -> list[EntryInfo]:
        """If the filesystem itself is about to run out (it can fill before the budget does,
        shared with other data), evict first: a full disk would fail this batch, and LMDB
        cannot even commit a removal without a few free pages.

        The records can occupy what they hold on the disk now plus its free space, less a
        reserve; where the payload store says so, only part of that (``disk_fill``: an LMDB
        file)."""
        try:
            occupied = self.index.totals().occupied
            capacity = shutil.disk_usage(self.root).free + self.payloads.held_on_disk(occupied) - DISK_RESERVE
        except (OSError, lmdb.Error):
            return []
        short = occupied + need - int(capacity * self.payloads.disk_fill)
        if short <= 0 or short > occupied:
            return []  # room enough, or the disk is full of other data: evicting would not help
        return self._evict_for_space(occupied - short)

    def _evict_for_space(self, target: int) -> list[EntryInfo]:
        """Evict down to ``target`` occupied bytes to make room on the file system."""
        gone = self.index.evict(target)
        self._remove_payloads(gone)
        self.evicted_for_space += len(gone)
        return gone

    def _retry_where_full(self, items: list[PutItem], locations: list[int],
                          errors: list[BaseException | None]) -> list[EntryInfo]:
        """Write once more, after evicting twice their size, the records a full file system
        refused (in place in ``locations`` and ``errors``). The free-space estimate before a
        batch can be wrong: LMDB's free pages may be too scattered for a record, and other
        writers fill the disk meanwhile. Without this, a store that had filled its disk
        could end with no room left for the index commits that evictions need."""
        full = [i for i, err in enumerate(errors) if err is not None and full_cause(err, self.root)]
        if not full:
            return []
        need = 2 * sum(self.payloads.occupied(items[i].size) for i in full) + DISK_RESERVE
        try:
            occupied = self.index.totals().occupied
            if need > occupied:
                return []  # the disk is full of other data: the store's records are kept
            gone = self._evict_for_space(occupied - need)
        except Exception:  # (the index could not commit either: the batch's failures stand)
            return []
        if gone:
            again = [new_location() for _ in full]
            for i, loc, err in zip(full, again, self.payloads.write_many([items[i] for i in full], again),
                                   strict=True):
                locations[i], errors[i] = loc, err
        return gone

    def _remove_payloads(self, entries: list[EntryInfo]) -> None:
        """Remove the payloads of entries the index no longer names. One an I/O error keeps
        (a full disk, for LMDB) is tried again with the next removal: nothing names it, so
        nothing else would ever free its space (the orphan sweep runs only after a crash)."""
        with self._unremoved_lock:
            retry, self._unremoved = self._unremoved, []
        # the retries apart: one that keeps failing must not hold back the new removals
        kept = (self.payloads.delete(retry) if retry else []) + (self.payloads.delete(entries) if entries else [])
        if kept:
            with self._unremoved_lock:
                self._unremoved = (self._unremoved + kept)[-_MAX_UNREMOVED:]
            log.warning("kvtier: %s: could not remove %d payload(s) the index no longer names; "
                        "trying again with the next removal", self.root, len(kept))

    def budget(self) -> int:
        """The store's disk budget: the one the store records (every writer shares it)."""
        return int(budget_of(self.index.settings(), int(self.config.disk_bytes)))  # type: ignore[arg-type]

    def touch(self, keys: Iterable[bytes], now_ns: int) -> None:
        """Record a use of ``keys`` for LRU eviction."""
        keys = list(keys)
        if keys and not self.readonly:
            self.index.touch(keys, now_ns)

    def lease(self, keys: Iterable[bytes], seconds: float) -> Lease:
        """Keep ``keys`` (and what they extend) from eviction for ``seconds``, or until
        :meth:`release`: a load was promised."""
        keys = list(keys)
        if keys and not self.readonly:
            return self.index.lease(keys, seconds)
        return {}

    def release(self, held: Lease) -> None:
        if held and not self.readonly:
            self.index.release(held)

    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove records; return the bytes they occupied on disk (what ``disk_bytes`` counts)."""
        gone = self.index.remove(list(keys))
        self._remove_payloads(gone)
        return sum(e.occupied for e in gone)

    def delete_entry(self, entry: EntryInfo) -> bool:
        """Remove exactly this version of a record (a newer one written meanwhile stays)."""
        gone = self.index.remove([entry.key], [entry.location])
        self._remove_payloads(gone)
        return bool(gone)

    def evict_lru(self, target_bytes: int) -> tuple[int, int]:
        """Evict (chain- and rank-aware, leases respected) until at most ``target_bytes``
        are occupied. Returns ``(records, record bytes)`` removed."""
        gone = self.index.evict(target_bytes)
        self._remove_payloads(gone)
        return len(gone), sum(e.size for e in gone)

    def sweep_orphans(self, grace_s: float = ORPHAN_GRACE_S, gone_writers: set[int] | None = None) -> int:
        """Remove payloads no index entry names (a writer killed between its payload write
        and its commit, or between a commit and the removal): those older than ``grace_s``,
        and at once those of ``gone_writers`` (pids of this host's writers found dead); how
        many went."""
        n = 0
        # a pid gone here may be a live writer's in another pid scope sharing the store
        gone_writers = set(gone_writers or ()) - self.index.writers_elsewhere()
        for key, loc in list(iter_unreferenced(self.index, self.payloads.found(), grace_s, gone_writers)):
            self.payloads.remove_found(key, loc)
            n += 1
        return n

    # -- reads -----------------------------------------------------------------------------
    def lookup(self, key: bytes) -> EntryInfo | None:
        return self.index.get(key)

    def still_names(self, entry: EntryInfo) -> bool:
        """Whether the index still names this version of the record. One whose payload is
        not found then lost its file behind the store's back (a payload is written before its
        entry is published and removed after it is hidden); else it was evicted or replaced."""
        now = self.index.get(entry.key)
        return now is not None and now.location == entry.location

    def read_entry(self, entry: EntryInfo, fn: Callable[[memoryview], T]) -> T | None:
        """``fn`` of the record this entry names; None if its payload went meanwhile."""
        return self.payloads.read(entry, fn)

    def read_record(self, entry: EntryInfo, fn: Callable[[RecordReader], T]) -> T | None:
        """``fn`` of a reader of the record this entry names (see
        :class:`~kvtier.codec.RecordReader`); None if its payload went meanwhile."""
        return self.payloads.read_record(entry, fn)

    def read(self, key: bytes, fn: Callable[[memoryview], T]) -> T | None:
        """``fn`` of the record stored under ``key`` (a view valid during the call); None if
        there is none."""
        entry = self.index.get(key)
        return None if entry is None else self.payloads.read(entry, fn)

    def read_head(self, key: bytes, n: int) -> tuple[bytes, int] | None:
        """The first ``n`` bytes of ``key``'s record and its length; None if there is none."""
        entry = self.index.get(key)
        return None if entry is None else self.payloads.read_head(entry, n)

    def count_present_prefix(self, keys: Iterable[bytes]) -> int:
        """How many of ``keys``, from the first, are stored (stops at the first absent one)."""
        return self.index.present_prefix(keys)

    def present_each(self, keys: Iterable[bytes]) -> list[bool]:
        """Whether each of ``keys`` is stored (one index read for all of them)."""
        return self.index.present_each(keys)

    def count_present_chain(self, head: bytes, spans: Iterable[tuple[int, bytes]]) -> int:
        """:meth:`count_present_prefix` for chunks of one chain, ``(token_start, key)``, whose
        first chunk's key is ``head``: the fast path for a prompt's lookup."""
        return self.index.present_chain(head, spans)

    def entries(self) -> Iterator[EntryInfo]:
        """Every stored record's metadata, from one consistent snapshot."""
        return iter(self.index.entries())

    def usage(self) -> tuple[int, int]:
        """``(records, record bytes)`` stored, across every process."""
        t = self.index.totals()
        return t.records, t.record_bytes

    def occupied(self) -> int:
        """Bytes the records occupy on disk (what ``disk_bytes`` bounds)."""
        return self.index.totals().occupied

    def register_namespace(self, namespace_id: bytes, description: dict[str, object]) -> None:
        """Remember what a namespace id stands for (for ``kvtier ls``)."""
        if not self.readonly:
            try:
                self.index.register_namespace(namespace_id, description)
            except lmdb.Error as exc:  # at start-up, like opening: a damaged index is refused
                raise unusable_store(self.root, exc) from None  # (a full disk is no damage)

    def namespaces(self) -> dict[bytes, dict[str, object]]:
        return self.index.namespaces()

    def settings(self) -> dict[str, object]:
        return self.index.settings()

    # -- lifecycle -------------------------------------------------------------------------
    def lmdb_envs(self) -> list[EnvHandle]:
        """The store's LMDB environments (page statistics; ``kvtier compact`` compacts each)."""
        extra = getattr(self.payloads, "env", None)
        return [self.index.env] + ([extra] if isinstance(extra, EnvHandle) else [])

    def after_fork_in_child(self) -> None:
        self._write_lock = threading.Lock()
        self._unremoved_lock = threading.Lock()
        self.payloads.after_fork_in_child()

    def close(self) -> None:
        if self._unremoved and not self.readonly:  # (a last try: no later process knows of them)
            self._remove_payloads([])
        self.payloads.close()
        self.index.close()


_LIVE_BACKENDS: weakref.WeakSet[Backend] = weakref.WeakSet()


def _backends_after_fork_in_child() -> None:
    for backend in list(_LIVE_BACKENDS):
        backend.after_fork_in_child()


forksafe.register(forksafe.BACKEND, after_in_child=_backends_after_fork_in_child)


def write_json_atomic(path: Path, data: dict[str, object], *, exclusive: bool = False) -> None:
    """Write a small JSON file atomically (temp file, fsync, rename), owner-only. With
    ``exclusive``, only if ``path`` does not exist yet (a hard link cannot replace a file:
    of two processes creating it at once, one wins and the other's is never seen)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    if exclusive:
        try:
            os.link(tmp, path)  # (FileExistsError: another's is there; it stays)
        except OSError as exc:
            if exc.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                os.replace(tmp, path)  # a file system without hard links: replace, as before
                return
            if not isinstance(exc, FileExistsError):
                os.unlink(tmp)
                raise
        os.unlink(tmp)
        return
    os.replace(tmp, path)
