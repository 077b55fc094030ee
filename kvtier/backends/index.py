"""The store's index: the one source of truth for what is stored, shared by every process.

Every process that opens a store (the scheduler and each tensor-parallel rank of every
server, other servers, the CLI) reads and writes this one LMDB environment, transactionally.
Presence, sizes, last use, leases and eviction order come from it and from nothing else, so
a process never promises a chunk another process has evicted.

Databases (all in ``<store>/index``):

- ``entries``: key -> :data:`_ENTRY` (record size, bytes occupied on disk, last use, lease,
  payload location, namespace, rank group, chain parent and head, token span);
- ``chains``: chain head + token start + key -> empty: a prompt's chunks side by side, for
  lookups (see :func:`chain_key`);
- ``lru``: big-endian last use + key -> empty: eviction order without a scan;
- ``children``: parent key -> keys of the chunks that extend it (duplicates allowed);
- ``groups``: rank-0 key -> the other tensor-parallel ranks' keys of the same chunk;
- ``info``: totals and the store's settings; ``namespaces``: what a namespace id stands for;
- ``leases``: key -> one :data:`_LEASE` per load it is promised to (duplicates allowed), so
  a release knows which other holders remain (the entry keeps the longest, which eviction
  reads).

A payload is written first (files or the LMDB data environment) under a fresh *location*,
and becomes visible only when the index commit that names it succeeds. Removal is the
reverse: the commit that drops an entry comes first, and the payload goes afterwards. A
crash between the two leaves an unreferenced payload, never an entry without its data; the
orphan sweep removes such payloads once they are older than a grace period.

Eviction (see :meth:`StoreIndex._evict_in`) walks the chunks least recently used first. A
chunk counts as recent as its most recently used relative: the chunks that extend it (a
hit on a chain's tail reads its head) and its other tensor-parallel ranks (a hit needs
every rank). It removes a chain tail first (chunk i is useless without chunks 0..i-1, so
a head never goes before its tail), every rank of a chunk together, and skips anything
under a lease (a load was promised).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import lmdb

from kvtier import forksafe
from kvtier.backends.lmdb_env import EnvHandle

# size, occupied, atime_ns, lease_until_ns, location, namespace, group, parent, head, start, tokens
_ENTRY = struct.Struct("<QQQQQ16s32s32s32sII")
_BE32 = struct.Struct(">I")
_TOTALS = struct.Struct("<QQQ")  # records, record bytes, occupied bytes
_BE64 = struct.Struct(">Q")
_TOTALS_KEY = b"totals"
_SETTINGS_KEY = b"settings"
_KEY_BYTES = 32  # every chunk key (SHA-256)
NO_KEY = b"\0" * _KEY_BYTES
# Scan the LRU order this many entries at a time while evicting.
_EVICT_SCAN = 256
INDEX_DIR = "index"
_DBS = ((b"entries", False), (b"chains", False), (b"lru", False), (b"children", True),
        (b"groups", True), (b"info", False), (b"namespaces", False), (b"leases", True))
# Added after the first release of the index: a read-only handle goes without them (the
# operations that use them write).
_ADDED_DBS = frozenset({b"leases"})
# Address space for the index map (it holds ~0.4 KiB per chunk; the file grows with use).
_INDEX_MAP = 64 << 30
# A lease taken: key -> (its end in ns, its holder's token), for its release.
Lease = dict[bytes, tuple[int, int]]
# One holder's lease in ``leases``: end ns, holder token (big-endian: the longest sorts last).
_LEASE = struct.Struct(">QQ")


@dataclass(frozen=True)
class EntryInfo:
    """What the index knows about a stored record."""

    key: bytes
    size: int
    atime_ns: int
    namespace_id: bytes
    occupied: int = 0  # bytes the payload takes on disk (block or page rounded)
    location: int = 0  # where the payload store keeps this version of the record
    lease_until_ns: int = 0
    group: bytes = NO_KEY  # the rank-0 key of this chunk (its own key for rank 0)
    parent: bytes = NO_KEY  # the key of the chunk this one extends (NO_KEY for a chain head)
    token_start: int = 0
    num_tokens: int = 0
    head: bytes = NO_KEY  # the key of its chain's first chunk (its own key for a head)

    def pack(self) -> bytes:
        return _ENTRY.pack(self.size, self.occupied, self.atime_ns, self.lease_until_ns, self.location,
                           self.namespace_id.ljust(16, b"\0")[:16], self.group, self.parent,
                           self.head, self.token_start, self.num_tokens)

    @classmethod
    def unpack(cls, key: bytes, raw: bytes | memoryview) -> EntryInfo:
        size, occ, atime, lease, loc, ns, group, parent, head, start, n = _ENTRY.unpack(raw)
        return cls(key, size, atime, ns, occ, loc, lease, group, parent, start, n, head)

    @property
    def lru_key(self) -> bytes:
        return _BE64.pack(self.atime_ns) + self.key

    @property
    def chain_key(self) -> bytes:
        return chain_key(self.head if self.head != NO_KEY else self.key, self.token_start, self.key)


def chain_key(head: bytes, token_start: int, key: bytes) -> bytes:
    """Where a chunk sits in the ``chains`` database: its chain's head, its position, and
    its key. A prompt's chunks are neighbours there, so a lookup of a whole prompt reads a
    few pages, not one page per chunk (what makes a lookup fast on a cold index)."""
    return head[:12] + _BE32.pack(token_start & 0xFFFFFFFF) + key[:16]


@dataclass
class Totals:
    records: int = 0
    record_bytes: int = 0
    occupied: int = 0

    def add(self, e: EntryInfo, sign: int = 1) -> None:
        self.records += sign
        self.record_bytes += sign * e.size
        self.occupied += sign * e.occupied


@dataclass
class Published:
    """What a publish replaced and evicted: payloads to remove once the commit is done."""

    replaced: list[EntryInfo]
    evicted: list[EntryInfo]
    # new entries not published because the key was stored already (see publish)
    left_out: list[EntryInfo] = field(default_factory=list)
    # new entries not published because the chunk they extend is not stored (see publish)
    unreachable: list[EntryInfo] = field(default_factory=list)


_PID_MASK = (1 << 22) - 1
# How old an unreferenced payload (or temp file) of a writer not known dead must be before
# it is removed: a live writer's stays unreferenced between its write and its index commit.
ORPHAN_GRACE_S = 600.0
# A writer refreshes its registration this often; one not refreshed for WRITER_STALE_S is
# gone. By then everything it wrote is older than the grace period, so an age sweep takes
# it all (the margin covers the beat it missed and some clock skew between hosts).
WRITER_BEAT_S = 60.0
WRITER_STALE_S = ORPHAN_GRACE_S + 2 * WRITER_BEAT_S
_SEQ = itertools.count()


def new_location() -> int:
    """A fresh payload location: the creation second (high 32 bits), the writer's pid (22
    bits) and a per-process counter (10 bits); the orphan sweep reads the age and the writer
    from it. Two writers of the same key can still meet at one location (the same pid in two
    containers, or over 1024 payloads a second): they write the same bytes (a key names its
    content), and nothing removes a payload the index names at that location."""
    return ((int(time.time()) & 0xFFFFFFFF) << 32 | (os.getpid() & _PID_MASK) << 10
            | (next(_SEQ) & 0x3FF))


def _relates_more(new: EntryInfo, old: EntryInfo) -> bool:
    """Whether ``new`` ties the chunk to its chain or its tensor-parallel group where the
    stored ``old`` does not (say, a chunk promoted from the remote tier, which knows neither):
    then it replaces ``old``, so that eviction keeps chains and rank tuples whole."""
    return ((old.parent == NO_KEY and new.parent != NO_KEY)
            or (old.group in (NO_KEY, old.key) and new.group not in (NO_KEY, new.key)))


def location_age_s(location: int) -> float:
    return time.time() - (location >> 32)


def location_written_by(location: int, pids: set[int]) -> bool:
    """Whether one of ``pids`` wrote this payload. Unknown (False) where pids can exceed what
    a location holds (another process's pid could share the bits kept)."""
    if not pids or _pid_max() > _PID_MASK + 1:
        return False
    return (location >> 10) & _PID_MASK in {p & _PID_MASK for p in pids}


def pid_scope() -> bytes:
    """8 bytes naming where this process's pid means something: its host and pid namespace
    (containers sharing a store on one machine may share a host name, never a pid
    namespace). A pid is only ever judged alive or gone within its own scope."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return hashlib.sha256(f"{socket.gethostname()}|{ns}".encode()).digest()[:8]


def _pid_max() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 1 << 32


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_WRITER = b"writer:"
# How many open stores of this process write each index (one registration per process).
_REGISTERED: dict[str, int] = {}
_REGISTERED_LOCK = threading.Lock()


def _forget_registrations_in_child() -> None:
    global _REGISTERED_LOCK
    _REGISTERED_LOCK = threading.Lock()
    _REGISTERED.clear()  # the child is another process: it registers itself


forksafe.register(forksafe.BACKEND, after_in_child=_forget_registrations_in_child)


class _Db:
    """A database handle of the index's environment, looked up on each use."""

    def __init__(self, name: bytes) -> None:
        self.name = name

    def __get__(self, index: StoreIndex, owner: type | None = None) -> object:
        return index.env.dbs[self.name]


class StoreIndex:
    """The shared index of one store (one per process and store; thread-safe)."""

    def __init__(self, root: Path, *, readonly: bool = False, sync: bool = False) -> None:
        self.path = root / INDEX_DIR
        self.readonly = readonly
        self.env = EnvHandle(self.path, readonly=readonly, sync=sync, map_size=_INDEX_MAP, dbs=_DBS,
                             added=_ADDED_DBS)

    # Database handles belong to this process's environment, which a fork replaces: looked
    # up on every use.
    _entries = _Db(b"entries")
    _chains = _Db(b"chains")
    _lru = _Db(b"lru")
    _children = _Db(b"children")
    _groups = _Db(b"groups")
    _info = _Db(b"info")
    _ns = _Db(b"namespaces")
    _leases = _Db(b"leases")

    def close(self) -> None:
        self.env.close()

    # -- reads --------------------------------------------------------------------------
    def get(self, key: bytes) -> EntryInfo | None:
        with self.env.txn() as txn:
            return self._get(txn, key)

    def _get(self, txn: lmdb.Transaction, key: bytes) -> EntryInfo | None:
        if len(key) != _KEY_BYTES:  # a damaged row's key (LMDB refuses an empty one outright)
            return None
        raw = txn.get(key, db=self._entries)
        if raw is None or len(raw) != _ENTRY.size:
            return None  # absent, or a damaged entry: nothing can be loaded through it
        return EntryInfo.unpack(key, raw)

    def present_prefix(self, keys: Iterable[bytes]) -> int:
        """How many of ``keys``, from the first, are stored (stops at the first absent one)."""
        n = 0
        with self.env.txn() as txn:
            cur = txn.cursor(db=self._entries)
            for k in keys:
                if not cur.set_key(k):
                    break
                n += 1
        return n

    def present_each(self, keys: Iterable[bytes]) -> list[bool]:
        """Whether each of ``keys`` is stored, in one read transaction."""
        with self.env.txn() as txn:
            cur = txn.cursor(db=self._entries)
            return [cur.set_key(k) for k in keys]

    def present_chain(self, head: bytes, spans: Iterable[tuple[int, bytes]]) -> int:
        """How many of a chain's chunks, ``(token_start, key)`` from the first, are stored;
        ``head`` is the key of the chain's first chunk. Same answer as
        :meth:`present_prefix`, reading the chunks where they lie side by side."""
        spans = list(spans)
        n = 0
        with self.env.txn() as txn:
            cur = txn.cursor(db=self._chains)
            for start, k in spans:
                if not cur.set_key(chain_key(head, start, k)):
                    break
                n += 1
            # A chunk stored without its chain's head (e.g. saved with neither parent nor
            # head) is not where the chain path looks: continue by key from there. For a
            # real miss that is one extra probe.
            by_key = txn.cursor(db=self._entries)
            for _, k in spans[n:]:
                if not by_key.set_key(k):
                    break
                n += 1
        return n

    def entries(self) -> list[EntryInfo]:
        """Every entry, from one consistent snapshot (drained: no transaction stays open)."""
        with self.env.txn() as txn:
            return [EntryInfo.unpack(bytes(k), v) for k, v in txn.cursor(db=self._entries)
                    if len(v) == _ENTRY.size]  # (a damaged entry names nothing loadable)

    def totals(self) -> Totals:
        with self.env.txn() as txn:
            return self._totals(txn)

    def _totals(self, txn: lmdb.Transaction) -> Totals:
        raw = txn.get(_TOTALS_KEY, db=self._info)
        return Totals(*_TOTALS.unpack(raw)) if raw else Totals()

    def index_bytes(self) -> int:
        """Bytes of the index's own pages (not counted against ``disk_bytes``)."""
        with self.env.txn() as txn:
            return self.env.page_bytes(txn)

    def settings(self) -> dict[str, object]:
        """The settings writers recorded ({} if none, or if they cannot be read)."""
        with self.env.txn() as txn:
            raw = txn.get(_SETTINGS_KEY, db=self._info)
        return _json_object(raw)

    def namespaces(self) -> dict[bytes, dict[str, object]]:
        with self.env.txn() as txn:
            return {bytes(k): _json_object(v) for k, v in txn.cursor(db=self._ns)}

    # -- writes -------------------------------------------------------------------------
    def _write(self):  # noqa: ANN202 - a context manager of a write transaction
        if self.readonly:
            raise PermissionError("store opened read-only")
        return self.env.txn(write=True)

    def set_settings(self, settings: dict[str, object], defaults: dict[str, object] | None = None
                     ) -> dict[str, object]:
        """Merge ``settings`` into the store's, and ``defaults`` where the store has no value
        yet (one transaction: two first writers cannot both miss a value); return what they
        were before."""
        with self._write() as txn:
            raw = txn.get(_SETTINGS_KEY, db=self._info)
            old = _json_object(raw)
            new = json.dumps({**(defaults or {}), **old, **settings}, sort_keys=True).encode()
            if raw is None or new != bytes(raw):
                txn.put(_SETTINGS_KEY, new, db=self._info)
        return old

    def register_namespace(self, namespace_id: bytes, description: dict[str, object]) -> None:
        blob = json.dumps(description, sort_keys=True).encode()
        with self.env.txn() as txn:
            if txn.get(namespace_id, db=self._ns) == blob:
                return  # common case (every start-up): no write transaction
        with self._write() as txn:
            txn.put(namespace_id, blob, db=self._ns)

    def publish(self, new: Sequence[EntryInfo], default_budget: int | None, low_watermark: float,
                replacing: Collection[bytes] = ()) -> Published:
        """Make ``new`` entries visible in one commit (their payloads must already be
        durable), then, if the occupied bytes exceed the store's budget (the ``disk_bytes``
        its settings record, read in this same commit; else ``default_budget``), evict down
        to ``low_watermark`` x that budget. Returns what was replaced or evicted, whose
        payloads the caller removes after this returns.

        A key stored already keeps its record (its content is the same: a key names it) and
        the new copy is left out (``left_out``; its use counts for the LRU): a reader of the
        stored record must not find it removed under it. Keys in ``replacing`` (a writer that
        could not load the stored record) replace it.

        An entry whose parent (the chunk it extends) is neither stored nor published before
        it in ``new`` is left out too (``unreachable``): the parent was evicted, or failed to
        be written, after the save was planned, and a lookup, which walks a prompt's chunks
        from its first, could never reach it. Stored, it would outlive its chain (a chain of
        its own, restamped by every later save of its prompt) and take the budget's room."""
        replaced: list[EntryInfo] = []
        left_out: list[EntryInfo] = []
        unreachable: list[EntryInfo] = []
        with self._write() as txn:
            budget = budget_of(_json_object(txn.get(_SETTINGS_KEY, db=self._info)), default_budget)
            tot = self._totals(txn)
            for e in new:
                up = self._get(txn, e.parent) if e.parent != NO_KEY else None
                if e.parent != NO_KEY and up is None:
                    unreachable.append(e)
                    continue
                if e.head == NO_KEY:  # not given: the parent's head, or a chain of its own
                    e = replace(e, head=up.head if up is not None and up.head != NO_KEY else
                                (up.key if up is not None else e.key))
                old = self._get(txn, e.key)
                if old is not None and e.key not in replacing and not _relates_more(e, old):
                    if old.location != e.location:  # (the same location: the same payload)
                        left_out.append(e)
                    if old.atime_ns < e.atime_ns:  # a save of it is a use
                        self._restamp(txn, old, replace(old, atime_ns=e.atime_ns))
                    continue
                if old is not None:
                    if old.lease_until_ns > e.lease_until_ns:  # a load was promised this key
                        e = replace(e, lease_until_ns=old.lease_until_ns)
                    self._drop(txn, old, tot, replaced=True)
                    if old.location != e.location:
                        replaced.append(old)
                self._add(txn, e, tot)
            evicted: list[EntryInfo] = []
            if budget is not None and tot.occupied > budget:
                evicted = self._evict_in(txn, int(budget * low_watermark), tot, time.time_ns())
            self._put_totals(txn, tot)
        return Published(replaced, evicted, left_out, unreachable)

    def remove(self, keys: Iterable[bytes], locations: Sequence[int] | None = None) -> list[EntryInfo]:
        """Drop entries (with ``locations``: only those still at that location, so a newer
        copy written meanwhile survives). Returns the removed entries."""
        out: list[EntryInfo] = []
        with self._write() as txn:
            tot = self._totals(txn)
            for i, k in enumerate(keys):
                e = self._get(txn, k)
                if e is None or (locations is not None and e.location != locations[i]):
                    continue
                self._drop(txn, e, tot)
                out.append(e)
            self._put_totals(txn, tot)
        return out

    def touch(self, keys: Iterable[bytes], now_ns: int) -> None:
        """Record a use of ``keys`` at ``now_ns`` (LRU order)."""
        with self._write() as txn:
            for k in keys:
                e = self._get(txn, k)
                if e is not None and e.atime_ns != now_ns:
                    self._restamp(txn, e, replace(e, atime_ns=now_ns))

    def lease(self, keys: Iterable[bytes], seconds: float) -> Lease:
        """Promise ``keys`` to a load: eviction skips them (and every chunk they extend)
        until the lease expires or is released. Leases are times, so a holder that dies
        frees them. Returns what :meth:`release` needs to end exactly this lease."""
        now = time.time_ns()
        until = now + int(seconds * 1e9)
        token = int.from_bytes(os.urandom(8), "big")
        held: Lease = {}
        with self._write() as txn:
            for k in keys:
                e = self._get(txn, k)
                if e is None:
                    continue
                if until > now:  # (a lease of no time holds nothing)
                    if e.lease_until_ns > max([now, *(u for _, (u, _) in self._holders(txn, k))]):
                        # a lease no row lists (an older kvtier's): listed now, with token 0,
                        # so that ending this one leaves it to run to its own end
                        txn.put(k, _LEASE.pack(e.lease_until_ns, 0), db=self._leases)
                    txn.put(k, _LEASE.pack(until, token), db=self._leases)
                    held[k] = (until, token)
                self._restamp(txn, e, replace(e, atime_ns=max(now, e.atime_ns),
                                              lease_until_ns=max(until, e.lease_until_ns)))
        return held

    def release(self, held: Lease) -> None:
        """End a lease once its load is done. Each key stays leased until the longest of the
        leases other holders still have on it, or is free now if none has; expired holders'
        rows go on the way. A lease the ``leases`` database does not list (taken by a kvtier
        before it existed) runs to its own end: :meth:`lease` lists one it finds, and one
        taken since is longer than every row."""
        now = time.time_ns()
        with self._write() as txn:
            for k, (until, token) in held.items():
                others = []  # the other holders' lease ends, still to come
                for raw, row in self._holders(txn, k):
                    if row == (until, token) or row[0] <= now:
                        txn.delete(k, raw, db=self._leases)
                    else:
                        others.append(row[0])
                e = self._get(txn, k)
                if e is None or e.lease_until_ns > max([until, *others]):  # (a lease no row lists)
                    continue
                rest = max(others, default=0)
                if rest != e.lease_until_ns:
                    self._restamp(txn, e, replace(e, lease_until_ns=rest))

    def _holders(self, txn: lmdb.Transaction, key: bytes) -> list[tuple[bytes, tuple[int, int]]]:
        """The key's rows in ``leases``: each as stored and as (end ns, token); a damaged
        one reads (0, 0), ended."""
        return [(raw, _LEASE.unpack(raw) if len(raw) == _LEASE.size else (0, 0))
                for raw in self._dups(txn, self._leases, key)]

    def evict(self, target_bytes: int) -> list[EntryInfo]:
        """Evict until at most ``target_bytes`` are occupied; the evicted entries."""
        with self._write() as txn:
            tot = self._totals(txn)
            if tot.occupied <= target_bytes:
                return []
            out = self._evict_in(txn, target_bytes, tot, time.time_ns())
            self._put_totals(txn, tot)
        return out

    # -- inside a write transaction -------------------------------------------------------
    def _put_totals(self, txn: lmdb.Transaction, tot: Totals) -> None:
        txn.put(_TOTALS_KEY, _TOTALS.pack(max(tot.records, 0), max(tot.record_bytes, 0),
                                          max(tot.occupied, 0)), db=self._info)

    def _add(self, txn: lmdb.Transaction, e: EntryInfo, tot: Totals) -> None:
        txn.put(e.key, e.pack(), db=self._entries)
        txn.put(e.chain_key, b"", db=self._chains)
        txn.put(e.lru_key, b"", db=self._lru)
        if e.parent != NO_KEY:
            txn.put(e.parent, e.key, db=self._children)
        if e.group not in (NO_KEY, e.key):
            txn.put(e.group, e.key, db=self._groups)
        tot.add(e)

    def _drop(self, txn: lmdb.Transaction, e: EntryInfo, tot: Totals, *, replaced: bool = False) -> None:
        txn.delete(e.key, db=self._entries)
        if not replaced:  # (a new version of the record keeps its promised loads)
            txn.delete(e.key, db=self._leases)
        txn.delete(e.chain_key, db=self._chains)
        txn.delete(e.lru_key, db=self._lru)
        if e.parent != NO_KEY:
            txn.delete(e.parent, e.key, db=self._children)
        if e.group not in (NO_KEY, e.key):
            txn.delete(e.group, e.key, db=self._groups)
        tot.add(e, -1)

    def _restamp(self, txn: lmdb.Transaction, old: EntryInfo, new: EntryInfo) -> None:
        if new.atime_ns != old.atime_ns:
            txn.delete(old.lru_key, db=self._lru)
            txn.put(new.lru_key, b"", db=self._lru)
        txn.put(new.key, new.pack(), db=self._entries)

    def _dups(self, txn: lmdb.Transaction, db: object, key: bytes) -> list[bytes]:
        cur = txn.cursor(db=db)
        return [bytes(v) for v in cur.iternext_dup(keys=False)] if cur.set_key(key) else []

    def _related(self, txn: lmdb.Transaction, key: bytes) -> list[EntryInfo]:
        """``key`` with every chunk that extends it, transitively, and every rank's part of
        each: what must go together."""
        seen: dict[bytes, EntryInfo] = {}
        todo = [key]
        while todo:
            k = todo.pop()
            if k in seen:
                continue
            e = self._get(txn, k)
            if e is None:
                continue
            seen[k] = e
            if e.group != NO_KEY:
                todo.append(e.group)
                todo.extend(self._dups(txn, self._groups, e.group))
            todo.extend(self._dups(txn, self._children, k))
        return list(seen.values())

    def _evict_in(self, txn: lmdb.Transaction, target: int, tot: Totals, now: int) -> list[EntryInfo]:
        evicted: list[EntryInfo] = []
        pos = b""
        cur = txn.cursor(db=self._lru)
        while tot.occupied > target:
            if not cur.set_range(pos):
                break
            batch = [bytes(k) for k, _ in zip(cur.iternext(values=False), range(_EVICT_SCAN), strict=False)]
            if not batch:
                break
            pos = batch[-1] + b"\0"
            for lk in batch:
                if tot.occupied <= target:
                    break
                e = self._get(txn, lk[8:])
                if e is None or e.lru_key != lk:
                    if e is None:  # names no usable entry (damaged): drop the order's row
                        txn.delete(lk, db=self._lru)
                        if len(lk) > 8:
                            txn.delete(lk[8:], db=self._entries)
                            txn.delete(lk[8:], db=self._leases)
                    continue  # gone with an earlier victim's relatives, or restamped
                group = self._related(txn, e.key)
                if any(m.lease_until_ns > now for m in group):
                    continue  # promised to a load
                newest = max(m.atime_ns for m in group)
                if newest > e.atime_ns:
                    # A relative was used later, so this chunk was too (a hit on a chain's
                    # tail reads its head, a hit on one rank reads all): move it up the order,
                    # and visit it again there (the scan may have passed that place already).
                    moved = replace(e, atime_ns=newest)
                    self._restamp(txn, e, moved)
                    if moved.lru_key < batch[-1]:  # its new place is among the rows read: read
                        pos = lk + b"\0"  # on from here, in the new order (else rows newer
                        break  # than it would be visited first, and evicted before it)
                    pos = min(pos, moved.lru_key)
                    continue
                # Tail first: deepest chunks first (a chunk's extensions start later than it
                # does), every rank of a chunk together, until enough is free; what is left
                # of the chain keeps its head.
                members = sorted(group, key=lambda m: (-m.token_start, m.group, m.key))
                for i, m in enumerate(members):
                    self._drop(txn, m, tot)
                    evicted.append(m)
                    last_of_chunk = i + 1 == len(members) or members[i + 1].group != m.group \
                        or m.group == NO_KEY
                    if last_of_chunk and tot.occupied <= target:
                        break
        return evicted

    # -- writers --------------------------------------------------------------------------
    def _writer_prefix(self) -> bytes:
        return _WRITER + pid_scope()

    def register_writer(self) -> list[int] | None:
        """Record this process as a writer of the store (see :meth:`beat`, whose answer this
        is). A clean close unregisters it: only a killed writer leaves its row behind."""
        with _REGISTERED_LOCK:
            first = _REGISTERED.get(str(self.path), 0) == 0
            _REGISTERED[str(self.path)] = _REGISTERED.get(str(self.path), 0) + 1
        return self.beat(first=first)

    def beat(self, *, first: bool = False) -> list[int] | None:
        """Refresh this process's writer row (its writer thread does so every
        :data:`WRITER_BEAT_S`, idle or not), and judge the other rows. A writer is gone when
        its pid is gone (only within this pid scope, where the pid means something) or when
        its row was not refreshed for :data:`WRITER_STALE_S` (in any scope: a killed
        container's writer, whose pid namespace no longer exists; a reused pid). Gone rows
        are deleted. Returns None if no writer was found gone, else the pids of those found
        gone here, whose unpublished payloads may be swept at once (the others' go by age:
        every one of them is older than the grace period by then).

        ``first``: this process registers; a row under its own pid is then an earlier
        process's that never unregistered. A writer whose own last beat is overdue (it was
        stalled: a hung disk, a held write lock) judges no row stale, as the others' may be
        overdue for the same reason."""
        scope = self._writer_prefix()
        mine = scope + os.getpid().to_bytes(4, "little")
        now = time.time_ns()
        dead: list[int] = []
        with self._write() as txn:
            rows = self._writer_rows(txn)
            own = next((beat_ns for _, key, beat_ns in rows if key == mine), None)
            found = first and own is not None
            stalled = not first and own is not None and now - own > 2 * WRITER_BEAT_S * 1e9
            for pid, key, beat_ns in rows:
                if key == mine:
                    continue
                stale = not stalled and now - beat_ns > WRITER_STALE_S * 1e9
                here = key.startswith(scope) and not pid_alive(pid)
                if here or stale:
                    found = True
                    if here:
                        dead.append(pid)
                    txn.delete(key, db=self._info)
            txn.put(mine, _BE64.pack(now), db=self._info)
        return dead if found else None

    def _writer_rows(self, txn: lmdb.Transaction) -> list[tuple[int, bytes, int]]:
        """``(pid, row key, last beat in ns)`` of every registered writer, in every pid
        scope; a row whose time cannot be read counts as never refreshed."""
        rows = []
        cur = txn.cursor(db=self._info)
        if cur.set_range(_WRITER):
            for k, v in cur:
                k = bytes(k)
                if not k.startswith(_WRITER):
                    break
                beat_ns = _BE64.unpack(v)[0] if len(v) == _BE64.size else 0
                rows.append((int.from_bytes(k[-4:], "little"), k, beat_ns))
        return rows

    def writers_elsewhere(self) -> set[int]:
        """Pids registered as writers under another pid scope (another host or container):
        a payload carrying one of them may be a live writer's there, whatever pid it is here."""
        mine = self._writer_prefix()
        with self.env.txn() as txn:
            rows = self._writer_rows(txn)
        return {pid for pid, key, _ in rows if not key.startswith(mine)}

    def unregister_writer(self) -> None:
        """This process closed the store cleanly: it left nothing unpublished (the record
        stays while another store of this process still writes the same index)."""
        with _REGISTERED_LOCK:  # held across the delete: a store of this process opening
            left = _REGISTERED.get(str(self.path), 1) - 1  # meanwhile must not lose its row
            _REGISTERED[str(self.path)] = max(left, 0)
            if left > 0:
                return
            with self._write() as txn:
                txn.delete(self._writer_prefix() + os.getpid().to_bytes(4, "little"), db=self._info)

    # -- maintenance ----------------------------------------------------------------------
    def referenced(self, key: bytes, location: int) -> bool:
        """Whether the index names this payload (the orphan sweep's question)."""
        e = self.get(key)
        return e is not None and e.location == location


def budget_of(settings: dict[str, object], default: int | None) -> int | None:
    """The ``disk_bytes`` a store's settings record, if valid, else ``default``."""
    value = settings.get("disk_bytes")
    valid = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if valid else default  # type: ignore[return-value]


def _json_object(raw: bytes | memoryview | None) -> dict[str, object]:
    """A JSON object stored in the index; {} for anything else (absent or damaged)."""
    if raw is None:
        return {}
    try:
        value = json.loads(bytes(raw))
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def iter_unreferenced(index: StoreIndex, found: Iterable[tuple[bytes, int]], grace_s: float,
                      gone_writers: set[int] | None = None) -> Iterator[tuple[bytes, int]]:
    """Payloads ``(key, location)`` no index entry names, older than ``grace_s`` (a live
    writer's younger payload may be between its write and its index commit) or written by
    one of ``gone_writers`` (pids of this pid scope's writers found dead, see
    :meth:`StoreIndex.beat`). Never judged by whether a pid is alive here: the
    writer may be in another pid namespace (a container) sharing the store."""
    for key, loc in found:
        if ((location_age_s(loc) > grace_s or location_written_by(loc, gone_writers or set()))
                and not index.referenced(key, loc)):
            yield key, loc
