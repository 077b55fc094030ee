"""The remote tier: chunk records on a Redis (or Valkey) server or cluster, shared by servers.

A chunk is stored as a small manifest value and its payload in parts::

    kvt:{<key hex>}                   manifest: b"KVTR" | version u8 | flags u8 | parts u16
                                      | payload_len u64 | write_id 8B | record header | xxh3_64
    kvt:{<key hex>}:<write_id>:<i>    payload part i (``remote_part_bytes`` each)

The ``{...}`` hash tag keeps a chunk's values on one cluster node, so one pipeline writes
and reads them. Parts are written before the manifest, so a chunk is visible only once all
of its parts are; a write id names each writer's parts, so two writers of one chunk never
mix. The record header and payload are kvtier's self-verifying record: a damaged,
truncated or mixed value fails its checksum and is a miss, never wrong KV. The server's
own eviction (``maxmemory`` with an LRU policy) is the remote budget: a manifest whose parts
were evicted is a miss too.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvtier.background import RateLimitedLog, take_batch, wait_while
from kvtier.codec import MAX_HEADER_BYTES
from kvtier.errors import IncompatibleRecord, RecordError
from kvtier.metrics import Counters
from kvtier.remote.address import parse_remote
from kvtier.remote.nodes import NodeUnavailable, RedisNodes

log = logging.getLogger("kvtier")

_MANIFEST = struct.Struct("<4sBBHQ8s")
_MAGIC = b"KVTR"
_VERSION = 1
_SUM = struct.Struct("<Q")
WRITE_BATCH_BYTES = 64 << 20  # one pipeline per node per batch of writes
# Which of KEYS exist, as a string of "0"/"1": a 512-chunk lookup in one command and a
# 512-byte reply. Its keys may lie in several slots of one cluster node (Redis 7 flag).
_EXISTS_LUA = """#!lua flags=no-writes,allow-cross-slot-keys
local r = {}
for i, k in ipairs(KEYS) do r[i] = redis.call('EXISTS', k) end
return table.concat(r)
"""
_EXISTS_SHA = hashlib.sha1(_EXISTS_LUA.encode()).hexdigest()
# Delete KEYS (a manifest and parts) only if the manifest still holds ARGV[1].
_DELETE_IF_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', unpack(KEYS)) end
return 0
"""


def _transient_errors() -> tuple[type, ...]:
    from redis import exceptions as e

    return (e.MovedError, e.AskError, e.TryAgainError, e.BusyLoadingError, e.ClusterDownError)


def _is_oom(reply: object) -> bool:
    """A write refused for memory: maxmemory reached under the noeviction policy."""
    from redis import exceptions as e

    # OutOfMemoryError is the class redis-py gives "OOM" replies; the text covers any version
    return isinstance(reply, getattr(e, "OutOfMemoryError", ())) or (
        isinstance(reply, e.ResponseError) and "maxmemory" in str(reply))


def _is_noscript(reply: object) -> bool:
    from redis.exceptions import NoScriptError

    return isinstance(reply, NoScriptError)


def manifest_name(key: bytes) -> str:
    return f"kvt:{{{key.hex()}}}"


def part_name(key: bytes, write_id: bytes, i: int) -> str:
    return f"kvt:{{{key.hex()}}}:{write_id.hex()}:{i}"


def pack_manifest(header: bytes, payload_len: int, parts: int, write_id: bytes) -> bytes:
    body = _MANIFEST.pack(_MAGIC, _VERSION, 0, parts, payload_len, write_id) + header
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def unpack_manifest(value: bytes) -> tuple[bytes, int, int, bytes]:
    """``(record header, payload_len, parts, write_id)``; :class:`RecordError` if damaged."""
    if len(value) < _MANIFEST.size + _SUM.size or len(value) > _MANIFEST.size + MAX_HEADER_BYTES + _SUM.size:
        raise RecordError(f"remote manifest of {len(value)} bytes is malformed")
    body, (stored,) = value[: -_SUM.size], _SUM.unpack_from(value, len(value) - _SUM.size)
    if xxhash.xxh3_64_intdigest(body) != stored:
        raise RecordError("remote manifest checksum mismatch")
    magic, version, _flags, parts, payload_len, write_id = _MANIFEST.unpack_from(body)
    if magic != _MAGIC:
        raise RecordError("not a kvtier remote manifest")
    if version != _VERSION:  # intact, another kvtier's: a miss here, kept for that kvtier
        raise IncompatibleRecord(f"remote manifest version {version}, this kvtier reads {_VERSION}")
    if parts < 1:
        raise RecordError("remote manifest names no parts")
    return bytes(body[_MANIFEST.size:]), payload_len, parts, write_id


@dataclass
class RemoteRecord:
    """A record read from the remote tier, not yet verified (the codec does that)."""

    header: bytes
    pieces: list[bytes]
    part_names: list[str]
    manifest: bytes = b""  # the manifest value read: deletes check it is still the same


class DamagedRemoteRecord(RecordError):
    """:meth:`RemoteTier.fetch_checked`: the record is there but cannot be read (a damaged
    manifest, another format version, or a part missing). ``part_names``: its parts as the
    manifest names them, or None where the manifest is unreadable (see :meth:`RemoteTier.purge`)."""

    def __init__(self, message: str, part_names: list[str] | None) -> None:
        super().__init__(message)
        self.part_names = part_names


@dataclass
class _Read:
    """What one key's manifest and parts were found to be (:meth:`RemoteTier._read`); what
    to do about it is the caller's: a load misses and cleans up, the KV pipe raises."""

    record: RemoteRecord | None = None  # all of it, not yet verified
    manifest: bytes | None = None  # the manifest value read, if one was
    damage: RecordError | None = None  # the manifest is unreadable (IncompatibleRecord: another version's)
    part_names: list[str] | None = None  # as the manifest names them
    missing_part: bool = False  # a part is gone (evicted)
    error: object = None  # an error reply (a slot moving, a loading server): may be whole later


@dataclass
class _Queued:
    key: bytes
    header: bytes
    payload: memoryview

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.payload.nbytes


class RemoteTier:
    """Lookups, loads and write-behind saves against the remote tier; never raises a
    network fault into the caller: an unavailable server is a miss and a counter."""

    def __init__(self, *, url: str, password: str | None, timeout_s: float, part_bytes: int,
                 queue_bytes: int, counters: Counters, connections: int = 8,
                 writer: bool = True, tls_ca: str | None = None) -> None:
        self.address = parse_remote(url, password)
        self.nodes = RedisNodes(self.address, timeout_s, max(2, connections), tls_ca=tls_ca)
        self.part_bytes = part_bytes
        self.queue_bytes = queue_bytes
        self.counters = counters
        self._queue: list[_Queued] = []
        self._queued_bytes = 0
        self._inflight = False
        self._cv = threading.Condition()
        self._closed = False
        self._warn = RateLimitedLog().warning  # (kind, msg, *args)
        self._scripts = True  # lookups by script until a server refuses one
        self._writer: threading.Thread | None = None
        if writer:
            self._writer = threading.Thread(target=self._write_loop, name="kvtier-remote-writer",
                                            daemon=True)
            self._writer.start()

    def _unexpected(self, what: str, exc: Exception) -> None:
        """A fault the node layer does not classify (e.g. a non-Redis reply): a miss too."""
        self.counters.add(remote_errors=1)
        self._warn("unexpected", "kvtier: remote tier %s: %s failed (%s: %s); treating as a miss",
                   self.address.describe(), what, type(exc).__name__, exc)

    def _unavailable(self, what: str, exc: Exception) -> None:
        self.counters.add(remote_errors=1)
        self._warn("down", "kvtier: remote tier %s unavailable for %s (%s); treating as misses",
                   self.address.describe(), what, exc)

    # -- lookups ------------------------------------------------------------------------
    # -- the public operations never raise: a fault is a miss and a counter ----------------
    def count_present_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the remote tier holds (0 if it cannot say)."""
        try:
            return self._count_present_prefix(keys)
        except Exception as exc:
            self._unexpected("a lookup", exc)
            return 0

    def fetch_many(self, keys: Sequence[bytes]) -> list[RemoteRecord | None]:
        """Records for ``keys`` (None: a miss), not yet verified: pass them to
        :func:`kvtier.codec.decode_pieces`, and one that fails there to :meth:`discard`."""
        try:
            return self._fetch_many(keys)
        except Exception as exc:
            self._unexpected("a load", exc)
            return [None] * len(keys)

    def store_many(self, items: Sequence[tuple[bytes, bytes, memoryview]]) -> int:
        """Store records ``(key, header, payload)`` now; skip those already there. Returns how
        many were written; failures are counted, never raised."""
        try:
            return self._store_many(items)
        except Exception as exc:
            self._unexpected("a save", exc)
            self.counters.add(remote_dropped=len(items))
            return 0

    def discard(self, key: bytes, record: RemoteRecord) -> None:
        """A fetched record that failed verification: delete it, unless rewritten since."""
        self.counters.add(remote_corrupt=1)
        self.delete(key, expect=record.manifest)

    def _count_present_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the remote tier holds: one command per node (a read-only
        script that checks them all), or one pipeline of EXISTS where scripts are refused."""
        if not keys:
            return 0
        names = [manifest_name(k) for k in keys]
        present = [False] * len(keys)
        try:
            for node, client, idx in self.nodes.route(names):
                for i, there in zip(idx, self._exists(node, client, [names[i] for i in idx]), strict=True):
                    present[i] = there
        except NodeUnavailable as exc:
            self._unavailable("a lookup", exc)
        n = 0
        while n < len(keys) and present[n]:
            n += 1
        return n

    def _exists(self, node: str, client: object, names: list[str]) -> list[bool]:
        if self._scripts:
            reply = self.nodes.run(node, client, lambda p: p.evalsha(_EXISTS_SHA, len(names), *names))[0]
            if _is_noscript(reply):  # first use on this server (or after a restart): send it
                reply = self.nodes.run(node, client, lambda p: p.eval(_EXISTS_LUA, len(names), *names))[0]
            if isinstance(reply, bytes) and len(reply) == len(names):
                return [c == 0x31 for c in reply]
            if isinstance(reply, _transient_errors()):  # a slot moving, a busy server: misses now
                return [False] * len(names)
            # scripts refused (disabled, or a server older than Redis 7): EXISTS from now on
            self._scripts = False
            log.info("kvtier: remote tier %s runs no lookup script (%s); using pipelined EXISTS",
                     self.address.describe(), reply)
        replies = self.nodes.run(node, client, lambda p: [p.exists(n) for n in names])
        return [r == 1 for r in replies]

    # -- loads ---------------------------------------------------------------------------
    def fetch(self, key: bytes) -> RemoteRecord | None:
        """The chunk's record, or None (not there, parts evicted, damaged manifest, or the
        server unavailable)."""
        return self.fetch_many([key])[0]

    def _fetch_many(self, keys: Sequence[bytes]) -> list[RemoteRecord | None]:
        """Records for ``keys`` in two pipelined round trips per node (manifests, then parts),
        not yet verified: pass them to :func:`kvtier.codec.decode_pieces`, and a record that
        fails there to :meth:`discard_corrupt`."""
        out: list[RemoteRecord | None] = [None] * len(keys)
        try:
            routes = self.nodes.route([manifest_name(k) for k in keys])
        except NodeUnavailable as exc:
            self._unavailable("a load", exc)
            return out
        for node, client, idx in routes:
            try:
                reads = self._read(node, client, [keys[i] for i in idx])
            except NodeUnavailable as exc:
                self._unavailable("a load", exc)
                continue
            for i, r in zip(idx, reads, strict=True):
                out[i] = r.record
                if r.damage is not None and not isinstance(r.damage, IncompatibleRecord):
                    self.discard_corrupt(keys[i], r.damage, r.manifest)
                elif r.missing_part:  # the chunk is gone
                    self.counters.add(remote_incomplete=1)
                    self.delete(keys[i], expect=r.manifest)
                # absent, another version's, or an error reply: a miss, nothing deleted
        return out

    def _read(self, node: str, client: object, keys: list[bytes]) -> list[_Read]:
        """Read ``keys``' manifests, then the parts they name, from one node in two pipelined
        round trips; judge nothing but what was found (no counter, no delete)."""
        names = [manifest_name(k) for k in keys]
        reads = [_Read() for _ in keys]
        manifests = self.nodes.run(node, client, lambda p: [p.get(n) for n in names])
        wanted: list[tuple[_Read, bytes]] = []
        for key, r, value in zip(keys, reads, manifests, strict=True):
            if value is None:
                continue
            if not isinstance(value, bytes):
                r.error = value
                continue
            r.manifest = value
            try:
                header, _, parts, wid = unpack_manifest(value)
            except RecordError as exc:  # IncompatibleRecord too
                r.damage = exc
                continue
            r.part_names = [part_name(key, wid, j) for j in range(parts)]
            wanted.append((r, header))
        if not wanted:
            return reads
        replies = self.nodes.run(node, client, lambda p: [p.get(n) for r, _ in wanted for n in r.part_names])
        at = 0
        for r, header in wanted:
            pieces = replies[at : at + len(r.part_names)]
            at += len(r.part_names)
            if any(piece is None for piece in pieces):
                r.missing_part = True
            elif all(isinstance(piece, bytes) for piece in pieces):
                r.record = RemoteRecord(header, pieces, r.part_names, r.manifest)
            else:
                r.error = next(piece for piece in pieces if not isinstance(piece, bytes))
        return reads

    def fetch_checked(self, key: bytes) -> RemoteRecord | None:
        """One record, for a caller that must tell "absent" from "there but unusable" (the KV
        pipe, whose consumer would otherwise wait for a message that never becomes readable).
        None: absent. Raises :class:`DamagedRemoteRecord` for a damaged manifest, one of
        another format version, or a missing part; ``OSError`` when the server cannot say now
        (down, slow, an error reply). Counts like a load, deletes nothing: the caller decides
        (:meth:`delete` with the part names, else :meth:`purge`). Not verified: the codec does that."""
        name = manifest_name(key)
        try:
            routes = self.nodes.route([name])
            if not routes:
                raise OSError(f"remote tier {self.address.describe()}: no node serves {name}")
            ((node, client, _),) = routes
            (r,) = self._read(node, client, [key])
        except NodeUnavailable as exc:
            self._unavailable("a load", exc)
            raise OSError(f"remote tier {self.address.describe()} unavailable ({exc})") from exc
        if r.damage is not None:  # unreadable here, whichever version wrote it
            self.counters.add(remote_corrupt=1)
            raise DamagedRemoteRecord(f"remote manifest unreadable: {r.damage}", None) from r.damage
        if r.missing_part:
            self.counters.add(remote_incomplete=1)
            raise DamagedRemoteRecord("a part of the record is missing (evicted?)", r.part_names)
        if r.error is not None:  # the record may be whole, later
            raise OSError(f"remote tier {self.address.describe()}: {r.error}")
        return r.record

    def purge(self, key: bytes) -> None:
        """Delete a record whose manifest cannot be read, with every part stored under its key
        (found by SCAN on its node, as the manifest that named them is unreadable). A repair
        for rare damage, O(keys on that node): never on a load path. Never raises."""
        name = manifest_name(key)
        pattern = f"{name}:*"  # hex digits and braces: nothing glob-special
        try:
            for node, client, _ in self.nodes.route([name]):  # one hash tag: one node
                cursor, doomed = 0, [name]
                while True:
                    (reply,) = self.nodes.run(node, client, lambda p, c=cursor: p.scan(c, match=pattern, count=1000))
                    if isinstance(reply, Exception):
                        break  # SCAN refused (an ACL): the manifest goes, parts wait for eviction
                    cursor, found = reply
                    doomed += found
                    if not cursor:
                        break
                self.nodes.run(node, client, lambda p, d=doomed: p.delete(*d))
        except NodeUnavailable as exc:
            self._unavailable("a delete", exc)
        except Exception as exc:  # never raise a remote fault into the caller
            self._unexpected("a delete", exc)

    def discard_corrupt(self, key: bytes, why: Exception, manifest: bytes) -> None:
        """A remote record proven damaged: count it and delete it (a miss from now on),
        unless it was rewritten since ``manifest`` was read."""
        self.counters.add(remote_corrupt=1)
        self._warn("corrupt", "kvtier: corrupt remote record %s (%s); removed, will recompute",
                   key.hex()[:16], why)
        self.delete(key, expect=manifest)

    def delete(self, key: bytes, part_names: Sequence[str] = (), *, expect: bytes | None = None) -> None:
        """Hide a chunk (its manifest), and delete ``part_names`` (a fetched record's). With
        ``expect``, only if the manifest still holds that value (one script on the node):
        a copy another server stored meanwhile is kept. Parts not named are left to the
        server's eviction: another writer's parts may be in use under a newer manifest."""
        names = [manifest_name(key), *part_names]
        try:
            for node, client, _ in self.nodes.route(names[:1]):  # one hash tag: one node
                if expect is None:
                    self.nodes.run(node, client, lambda p: p.delete(*names))
                else:
                    self.nodes.run(node, client, lambda p: p.eval(_DELETE_IF_LUA, len(names), *names, expect))
        except NodeUnavailable as exc:
            self._unavailable("a delete", exc)
        except Exception as exc:  # never raise a remote fault into a load
            self._unexpected("a delete", exc)

    # -- saves ----------------------------------------------------------------------------
    def _store_many(self, items: Sequence[tuple[bytes, bytes, memoryview]]) -> int:
        """Store records ``(key, header, payload)`` now; skip those already there. Returns how
        many were written. Failures are counted, never raised."""
        if not items:
            return 0
        names = [manifest_name(k) for k, _, _ in items]
        written = 0
        try:
            routes = self.nodes.route(names)
        except NodeUnavailable as exc:
            self._unavailable("a save", exc)
            self.counters.add(remote_dropped=len(items))
            return 0
        for node, client, idx in routes:
            todo = list(idx)  # what a failure drops: all, then only those not there already
            commands: list[tuple[int, bytes]] = []  # per item of todo: (commands, manifest)
            try:
                there = self.nodes.run(node, client, lambda p, idx=idx: [p.exists(names[i]) for i in idx])
                todo = [i for i, r in zip(idx, there, strict=True) if r != 1]
                if not todo:
                    continue
                replies = self.nodes.run(node, client, lambda p, todo=todo, commands=commands: commands.extend(
                    self._add_sets(p, items[i]) for i in todo))
            except NodeUnavailable as exc:
                self._unavailable("a save", exc)
                self.counters.add(remote_dropped=len(todo))
                continue
            # one item's replies are its parts' SETs then its manifest's: judge each item by
            # its own, so one refused command drops one chunk, not the whole pipeline
            at, done, refused = 0, [], []
            for i, (n, manifest) in zip(todo, commands, strict=True):
                errors = [r for r in replies[at : at + n] if isinstance(r, Exception)]
                if not errors:
                    done.append(i)
                else:
                    refused.append(errors[0])
                    if not isinstance(replies[at + n - 1], Exception):  # a manifest over a missing part
                        self.delete(items[i][0], expect=manifest)
                at += n
            if refused:
                self.counters.add(remote_dropped=len(refused))
                oom = next((r for r in refused if _is_oom(r)), None)
                if oom is not None:
                    self._warn("refused", "kvtier: remote tier %s refused writes (%s); set maxmemory-policy "
                               "to allkeys-lru so the server evicts instead", self.address.describe(), oom)
                elif not all(isinstance(r, _transient_errors()) for r in refused):
                    self._warn("refused-other", "kvtier: remote tier %s refused writes (%s)",
                               self.address.describe(), refused[0])
                # a slot moving (MOVED, ASK, TRYAGAIN): those chunks are dropped, counted, and
                # the slot map is re-read (RedisNodes.run); nothing to warn about
            written += len(done)
            self.counters.add(remote_saves=len(done),
                              remote_bytes_saved=sum(len(items[i][1]) + items[i][2].nbytes for i in done))
        return written

    def _add_sets(self, pipe: object, item: tuple[bytes, bytes, memoryview]) -> tuple[int, bytes]:
        """Queue one record's SETs on ``pipe``: ``(how many commands, the manifest value)``."""
        key, header, payload = item
        payload = memoryview(payload).cast("B")
        wid = os.urandom(8)
        pb = self.part_bytes
        parts = max(1, -(-payload.nbytes // pb))
        for i in range(parts):
            pipe.set(part_name(key, wid, i), payload[i * pb : (i + 1) * pb])
        manifest = pack_manifest(header, payload.nbytes, parts, wid)
        pipe.set(manifest_name(key), manifest)  # last: visible
        return parts + 1, manifest

    def enqueue(self, key: bytes, header: bytes, payload: memoryview) -> bool:
        """Write-behind: queue a record for the remote tier. False (counted) if the queue's
        byte budget is spent or the tier is closed; the caller never waits."""
        item = _Queued(key, header, payload)
        with self._cv:
            if self._closed or self._writer is None:  # a save after close is a drop too
                self.counters.add(remote_dropped=1)
                return False
            if self._queued_bytes + item.nbytes > self.queue_bytes:
                self.counters.add(remote_dropped=1)
                self._warn("queue", "kvtier: remote write queue full (%d bytes); not uploading some chunks",
                           self.queue_bytes)
                return False
            self._queue.append(item)
            self._queued_bytes += item.nbytes
            self._cv.notify_all()
        return True

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait(1.0)
                if not self._queue:
                    return
                batch = take_batch(self._queue, WRITE_BATCH_BYTES)
                size = sum(q.nbytes for q in batch)
                self._inflight = True
            try:
                self.store_many([(q.key, q.header, q.payload) for q in batch])
            except Exception as exc:  # never let the writer die
                self.counters.add(remote_errors=1, remote_dropped=len(batch))
                self._warn("writer", "kvtier: remote writer error: %s", exc)
            finally:
                with self._cv:
                    self._queued_bytes -= size
                    batch.clear()  # their buffers go back to the pool before a flush returns
                    self._inflight = False
                    self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued upload is done (or dropped). True if drained."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return wait_while(self._cv, lambda: bool(self._queue or self._inflight), deadline)

    def close(self, timeout: float = 30.0) -> None:
        """Upload what is queued (within ``timeout``), then close the connections."""
        drained = self.flush(timeout)
        with self._cv:
            if not drained:
                self.counters.add(remote_dropped=len(self._queue))
                self._queue.clear()
            self._closed = True
            self._cv.notify_all()
        if self._writer is not None:
            self._writer.join(max(0.0, timeout))
        self.nodes.close()
