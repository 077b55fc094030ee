"""The remote tier: chunk records on a Redis (or Valkey) server or cluster, shared by servers.

A chunk is one Redis string, its manifest followed by its payload::

    kvt2:{<key hex>}   b"KVTR" | version u8 | flags u8 | head_len u32 | payload_len u64 | write_id 8B
                       | record header (head_len bytes) | xxh3_64 of all of that | payload

One key per chunk, written by one ``SET``, so the server stores, evicts and refuses a chunk
whole: under ``allkeys-lru`` it never keeps part of a chunk (a key per part did: the LRU
clock's one-second resolution evicts same-second keys at random, so most chunks lost a part
and lookups promised chunks that loads could not read), and a write it refuses
(``noeviction``) leaves nothing behind. The manifest and the payload go out as one value
from two buffers, and the server keeps the value it received (a hash would cost the server
a copy of every byte: ``HSET`` copies its values). Loads read the value in pieces of
``remote_part_bytes`` with ``GETRANGE`` (redis-py receives one 32 MiB reply far slower than
4 MiB ones): the first piece, which holds the manifest, then the rest. The ``{...}`` hash
tag routes a chunk's key on a cluster. A later format takes another key prefix, so servers
of two kvtier versions share a Redis without reading each other's records. The record header and payload are kvtier's
self-verifying record: a damaged or truncated value fails its checksums and is a miss,
never wrong KV. The server's own eviction (``maxmemory`` with an LRU policy) is the remote
budget.
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
from kvtier.errors import RecordError
from kvtier.metrics import Counters
from kvtier.remote.address import parse_remote
from kvtier.remote.nodes import Joined, NodeUnavailable, RedisNodes, is_stale_route

log = logging.getLogger("kvtier")

_MANIFEST = struct.Struct("<4sBBIQ8s")  # magic, version, flags, head_len, payload_len, write_id
_MAGIC = b"KVTR"
_VERSION = 2  # 1: a manifest key and one key per part (kvt:{...}), which kvtier no longer reads
# Redis refuses a value over proto-max-bulk-len (512 MB by default) and drops the connection
MAX_VALUE_BYTES = 512 << 20
_SUM = struct.Struct("<Q")
WRITE_BATCH_BYTES = 64 << 20  # one pipeline per node per batch of writes
# Which of the keys exist, as a string of "0"/"1": a 512-chunk lookup in one command and a
# 512-byte reply. The keys are arguments, not declared KEYS: a cluster refuses declared keys
# of several slots (CROSSSLOT) even with the flag, which lets the script read keys of every
# slot its node serves (the caller sends each node only its own keys).
_EXISTS_LUA = """#!lua flags=no-writes,allow-cross-slot-keys
local r = {}
for i, k in ipairs(ARGV) do r[i] = redis.call('EXISTS', k) end
return table.concat(r)
"""
_EXISTS_SHA = hashlib.sha1(_EXISTS_LUA.encode()).hexdigest()
# Delete KEYS[1] if it is an empty string (no record is): 1 if it was.
_DROP_EMPTY_LUA = """
if redis.call('TYPE', KEYS[1])['ok'] == 'string' and redis.call('STRLEN', KEYS[1]) == 0 then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
# Delete KEYS[1] if it is not a string (another program's value, never a record).
_DROP_NON_STRING_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'string' and t ~= 'none' then return redis.call('DEL', KEYS[1]) end
return 0
"""
# Delete KEYS[1] only if it still starts with the manifest ARGV[1] (not one rewritten since).
_DELETE_IF_LUA = """
if redis.call('GETRANGE', KEYS[1], 0, #ARGV[1] - 1) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _is_transient(reply: object) -> bool:
    """An error reply that may not recur: a slot moving (the node layer re-reads the slot
    map), a loading server, or one busy with another client's long script (``BUSY``, which
    redis-py gives no class of its own)."""
    from redis import exceptions as e

    return is_stale_route(reply) or isinstance(reply, e.TryAgainError | e.BusyLoadingError | e.ClusterDownError) \
        or (isinstance(reply, e.ResponseError) and str(reply).startswith("BUSY"))


def _is_wrong_type(reply: object) -> bool:
    """A value of another type under a chunk's key: not a record of this format."""
    from redis.exceptions import ResponseError

    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")


def _is_oom(reply: object) -> bool:
    """A write refused for memory: maxmemory reached under the noeviction policy."""
    from redis import exceptions as e

    # OutOfMemoryError is the class redis-py gives "OOM" replies; the text covers any version
    return isinstance(reply, getattr(e, "OutOfMemoryError", ())) or (
        isinstance(reply, e.ResponseError) and "maxmemory" in str(reply))


def _is_noscript(reply: object) -> bool:
    from redis.exceptions import NoScriptError

    return isinstance(reply, NoScriptError)


def chunk_name(key: bytes) -> str:
    """The Redis key of a chunk."""
    return f"kvt2:{{{key.hex()}}}"


def pack_manifest(header: bytes, payload_len: int, write_id: bytes) -> bytes:
    body = _MANIFEST.pack(_MAGIC, _VERSION, 0, len(header), payload_len, write_id) + header
    return body + _SUM.pack(xxhash.xxh3_64_intdigest(body))


def unpack_manifest(value: bytes | memoryview) -> tuple[bytes, int, int]:
    """From a value's first bytes: ``(record header, manifest length, payload length)``;
    :class:`RecordError` if damaged. The key's prefix names the format (a later one takes
    another prefix), so a value here of another version is damage too."""
    view = memoryview(value)
    if len(view) < _MANIFEST.size + _SUM.size:
        raise RecordError(f"remote value of {len(view)} bytes is too short for a manifest")
    magic, version, _flags, head_len, payload_len, _ = _MANIFEST.unpack_from(view)
    if magic != _MAGIC:
        raise RecordError("not a kvtier remote record")
    if version != _VERSION:
        raise RecordError(f"remote record of format {version} under a format-{_VERSION} key")
    end = _MANIFEST.size + head_len
    if head_len > MAX_HEADER_BYTES or len(view) < end + _SUM.size:
        raise RecordError("remote manifest is malformed or cut short")
    (stored,) = _SUM.unpack_from(view, end)
    if xxhash.xxh3_64_intdigest(view[:end]) != stored:
        raise RecordError("remote manifest checksum mismatch")
    return bytes(view[_MANIFEST.size:end]), end + _SUM.size, payload_len


@dataclass
class RemoteRecord:
    """A record read from the remote tier, not yet verified (the codec does that)."""

    header: bytes
    pieces: list[bytes | memoryview]
    manifest: bytes = b""  # the manifest value read: deletes check it is still the same


@dataclass
class RemoteMiss:
    """No record from the remote tier, and why: ``damage`` for a value there that is not a
    whole, sound record (removed), else absent or the server could not say (``why``). False,
    as a miss."""

    why: str = "not stored"
    damage: RecordError | None = None

    def __bool__(self) -> bool:
        return False


class RemoteRefused(OSError):
    """The server refuses this client (credentials, a database it lacks, an ACL): trying
    again will not help (for a caller that would otherwise wait, the KV pipe)."""


def is_refusal(reply: object) -> bool:
    from redis.exceptions import AuthenticationError, NoPermissionError

    return isinstance(reply, AuthenticationError | NoPermissionError)


class DamagedRemoteRecord(RecordError):
    """:meth:`RemoteTier.fetch_checked`: the record is there but cannot be read (a damaged
    manifest, a value shorter or longer than its manifest says, or one that is not a kvtier
    record)."""


@dataclass
class _Read:
    """What one key's value was found to be (:meth:`RemoteTier._read`); what to do about it
    is the caller's: a load misses and cleans up, the KV pipe raises."""

    record: RemoteRecord | None = None  # all of it, not yet verified
    manifest: bytes | None = None  # the manifest read, if one was
    damage: RecordError | None = None  # there, but not a whole, sound record
    # how to remove it: "manifest" (only while it starts with ``manifest``), "not_string"
    # (only while it is another type of value) or "done" (removed when found)
    remove: str = "manifest"
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
        self._limits: dict[str, int] = {}  # each node's largest value (see _value_limit)
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

    def fetch_many(self, keys: Sequence[bytes]) -> list[RemoteRecord | RemoteMiss]:
        """Records for ``keys`` (a :class:`RemoteMiss` says why not), not yet verified: pass
        them to :func:`kvtier.codec.decode_pieces`, and one that fails there to :meth:`discard`."""
        try:
            return self._fetch_many(keys)
        except Exception as exc:
            self._unexpected("a load", exc)
            return [RemoteMiss(f"the remote tier failed ({type(exc).__name__}: {exc})")] * len(keys)

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
        """A fetched record that failed verification (the caller says so): count it and
        delete it, unless rewritten since."""
        self.counters.add(remote_corrupt=1)
        self.delete(key, expect=record.manifest)

    def present_each(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the remote tier holds each of ``keys`` (all False if it cannot say)."""
        try:
            return self._present_each(keys)
        except Exception as exc:
            self._unexpected("a lookup", exc)
            return [False] * len(keys)

    def or_present(self, keys: Sequence[bytes], there: list[bool]) -> list[bool]:
        """``there`` (whether each key is stored locally), with the keys not there looked up
        here, in one lookup."""
        missing = [i for i, t in enumerate(there) if not t]
        if not missing:
            return there
        found = self.present_each([keys[i] for i in missing])
        out = list(there)
        for i, f in zip(missing, found, strict=True):
            out[i] = f
        return out

    def _count_present_prefix(self, keys: Sequence[bytes]) -> int:
        present = self._present_each(keys)
        n = 0
        while n < len(keys) and present[n]:
            n += 1
        return n

    def _present_each(self, keys: Sequence[bytes]) -> list[bool]:
        """One command per node (a read-only script that checks them all), or one pipeline of
        EXISTS where scripts are refused."""
        names = [chunk_name(k) for k in keys]
        present = [False] * len(keys)
        if not keys:
            return present
        try:
            for node, client, idx in self.nodes.route(names):
                for i, there in zip(idx, self._exists(node, client, [names[i] for i in idx]), strict=True):
                    present[i] = there
        except NodeUnavailable as exc:
            self._unavailable("a lookup", exc)
        return present

    def _exists(self, node: str, client: object, names: list[str]) -> list[bool]:
        if self._scripts:
            reply = self.nodes.run(node, client, lambda p: p.evalsha(_EXISTS_SHA, 0, *names))[0]
            if _is_noscript(reply):  # first use on this server (or after a restart): send it
                reply = self.nodes.run(node, client, lambda p: p.eval(_EXISTS_LUA, 0, *names))[0]
            if isinstance(reply, bytes) and len(reply) == len(names):
                return [c == 0x31 for c in reply]
            if _is_transient(reply):  # a slot moving, a busy server: misses now, scripts kept
                return [False] * len(names)
            # scripts refused (disabled, an ACL, a server older than Redis 7): EXISTS from now on
            self._scripts = False
            log.info("kvtier: remote tier %s refused the lookup script (%s); using pipelined EXISTS",
                     self.address.describe(), reply)
        replies = self.nodes.run(node, client, lambda p: [p.exists(n) for n in names])
        return [r == 1 for r in replies]

    # -- loads ---------------------------------------------------------------------------
    def fetch(self, key: bytes) -> RemoteRecord | RemoteMiss:
        """The chunk's record, or why not (not there, damaged, or the server unavailable)."""
        return self.fetch_many([key])[0]

    def _fetch_many(self, keys: Sequence[bytes]) -> list[RemoteRecord | RemoteMiss]:
        """Records for ``keys`` in one or two pipelined round trips per node (see
        :meth:`_read`), not yet verified: pass them to :func:`kvtier.codec.decode_pieces`, and
        a record that fails there to :meth:`discard`."""
        out: list[RemoteRecord | RemoteMiss] = [RemoteMiss()] * len(keys)
        try:
            routes = self.nodes.route([chunk_name(k) for k in keys])
        except NodeUnavailable as exc:
            self._unavailable("a load", exc)
            return [RemoteMiss(f"the remote tier is unavailable ({exc})")] * len(keys)
        for node, client, idx in routes:
            try:
                reads = self._read(node, client, [keys[i] for i in idx])
            except NodeUnavailable as exc:
                self._unavailable("a load", exc)
                down = RemoteMiss(f"the remote tier is unavailable ({exc})")
                for i in idx:
                    out[i] = down
                continue
            refused = next((r.error for r in reads if r.error is not None and not _is_transient(r.error)), None)
            if refused is not None:  # e.g. an ACL without GETRANGE: lookups hit, every load fails
                self.counters.add(remote_errors=1)
                self._warn("refused-read", "kvtier: remote tier %s refused a read (%s); loads from it "
                           "miss (a read-only user needs +getrange +strlen +exists +evalsha +eval)",
                           self.address.describe(), refused)
            for i, r in zip(idx, reads, strict=True):
                if r.record is not None:
                    out[i] = r.record
                elif r.damage is not None:
                    self.discard_corrupt(keys[i], r)
                    out[i] = RemoteMiss("damaged", r.damage)
                elif r.error is not None:  # (an error reply: a miss, nothing deleted)
                    out[i] = RemoteMiss(f"the remote tier answered an error ({r.error})")
        return out

    def _read(self, node: str, client: object, keys: list[bytes]) -> list[_Read]:
        """Read ``keys``' values from one node: the first piece of each (its manifest) in one
        pipelined round trip, then, for those longer than a piece, the rest in a second;
        judge nothing but what was found (no counter, no delete)."""
        names = [chunk_name(k) for k in keys]
        reads = [_Read() for _ in keys]
        pb = self.part_bytes
        # (no stored record is larger; a lower proto-max-bulk-len now limits new writes only)
        limit = max(self._value_limit(node, client), MAX_VALUE_BYTES)
        # EXISTS with each first piece: "" from GETRANGE is a missing key or an empty string
        firsts = self.nodes.run(node, client, lambda p: [c for n in names for c in (p.exists(n), p.getrange(n, 0, pb - 1))])
        longer: list[tuple[_Read, str, bytes, bytes, int, int]] = []  # read, name, header, first, meta, total
        empty: list[tuple[_Read, str]] = []  # there, but "": an empty string, or gone in between
        for r, name, there, value in zip(reads, names, firsts[::2], firsts[1::2], strict=True):
            if _is_wrong_type(value):
                r.damage = RecordError("the chunk's key holds a value that is not a kvtier record")
                r.remove = "not_string"
            elif not isinstance(value, bytes):
                r.error = value
            elif not value:
                if there == 1:  # (0: absent, even if written since)
                    empty.append((r, name))
            else:
                try:
                    header, meta, payload_len = unpack_manifest(value)
                except RecordError as exc:
                    r.damage, r.manifest = exc, value[:4096]  # (a delete checks it is unchanged)
                    continue
                r.manifest, total = value[:meta], meta + payload_len
                if total == len(value):
                    r.record = RemoteRecord(header, [memoryview(value)[meta:]], r.manifest)
                elif total < len(value) or len(value) < pb or total > limit:
                    r.damage = RecordError(f"the value has {len(value)} bytes, its manifest says {total}")
                else:
                    longer.append((r, name, header, value, meta, total))
        if not longer and not empty:
            return reads
        # Second round trip: for each empty one, whether it is an empty string now (one
        # script: removed if so, as it can never become a record; else it was deleted or
        # rewritten in between: a miss); for each longer one its length, its other pieces,
        # then its manifest again: a value rewritten meanwhile (another server's upload, a
        # new write id) is a miss, not damage.
        spans = [[(off, min(off + pb, total) - 1) for off in range(pb, total, pb)] for *_, total in longer]
        replies = self.nodes.run(node, client, lambda p: [
            *(p.eval(_DROP_EMPTY_LUA, 1, name) for _, name in empty),
            *(cmd for (_, name, _, _, meta, _), sp in zip(longer, spans, strict=True)
              for cmd in (p.strlen(name), *(p.getrange(name, lo, hi) for lo, hi in sp),
                          p.getrange(name, 0, meta - 1)))])
        for (r, _), dropped in zip(empty, replies, strict=False):
            if dropped == 1:  # (an error reply, e.g. scripts refused: a miss)
                r.damage, r.remove = RecordError("the chunk's key held an empty value (removed)"), "done"
        at = len(empty)
        for (r, _, header, first, meta, total), sp in zip(longer, spans, strict=True):
            size, got, again = replies[at], replies[at + 1 : at + 1 + len(sp)], replies[at + 1 + len(sp)]
            at += 2 + len(sp)
            odd = next((g for g in (size, *got, again) if isinstance(g, Exception)), None)
            if odd is not None and _is_wrong_type(odd):
                r.damage, r.remove = RecordError("the chunk's key changed type while read"), "not_string"
            elif odd is not None:
                r.error = odd
            elif again != r.manifest:  # gone (evicted) or rewritten since its first piece: a miss
                r.manifest = None
            elif size != total or [len(g) for g in got] != [hi - lo + 1 for lo, hi in sp]:
                r.damage = RecordError(f"the value has {size} bytes, its manifest says {total}")
            else:
                r.record = RemoteRecord(header, [memoryview(first)[meta:], *got], r.manifest)
        return reads

    def _value_limit(self, node: str, client: object) -> int:
        """The largest value ``node`` takes (its ``proto-max-bulk-len``; asked once, 512 MB
        where CONFIG is not allowed): a larger value makes the server drop the connection."""
        limit = self._limits.get(node)
        if limit is None:
            (reply,) = self.nodes.run(node, client, lambda p: p.config_get("proto-max-bulk-len"))
            try:
                limit = int(reply["proto-max-bulk-len"])  # type: ignore[index]
            except (TypeError, KeyError, ValueError):  # refused (an ACL, a managed service)
                limit = MAX_VALUE_BYTES
            if not _is_transient(reply):  # (a loading or busy server: ask again next time)
                self._limits[node] = limit
        return limit

    def fetch_checked(self, key: bytes) -> RemoteRecord | None:
        """One record, for a caller that must tell "absent" from "there but unusable" (the KV
        pipe, whose consumer would otherwise wait for a message that never becomes readable).
        None: absent. Raises :class:`DamagedRemoteRecord` for a damaged record, one of another
        format version, or a value that is not a kvtier record; ``OSError`` when the server
        cannot say now (down, slow, an error reply). Counts like a load, deletes nothing: the
        caller decides (:meth:`delete`). Not verified: the codec does that."""
        name = chunk_name(key)
        try:
            routes = self.nodes.route([name])
            if not routes:
                raise OSError(f"remote tier {self.address.describe()}: no node serves {name}")
            ((node, client, _),) = routes
            (r,) = self._read(node, client, [key])
        except NodeUnavailable as exc:
            self._unavailable("a load", exc)
            kind = RemoteRefused if exc.refused else OSError
            raise kind(f"remote tier {self.address.describe()} unavailable ({exc})") from exc
        if r.damage is not None:  # unreadable here, whichever version wrote it
            self.counters.add(remote_corrupt=1)
            raise DamagedRemoteRecord(f"remote record unreadable: {r.damage}") from r.damage
        if r.error is not None:  # the record may be whole, later; unless the server refuses us
            raise (RemoteRefused if is_refusal(r.error) else OSError)(
                f"remote tier {self.address.describe()}: {r.error}")
        return r.record

    def discard_corrupt(self, key: bytes, found: _Read) -> None:
        """A remote record proven damaged: count it and delete it (a miss from now on),
        unless it was rewritten since it was read (see ``_Read.remove``)."""
        self.counters.add(remote_corrupt=1)
        self._warn("corrupt", "kvtier: corrupt remote record %s (%s); removed, will recompute",
                   key.hex()[:16], found.damage)
        if found.remove == "manifest" and found.manifest:
            self.delete(key, expect=found.manifest)
        elif found.remove == "not_string":
            self.delete(key, unless_string=True)

    def delete(self, key: bytes, *, expect: bytes | None = None, unless_string: bool = False) -> None:
        """Delete a chunk (its one key). With ``expect``, only if its value still starts with
        those bytes, with ``unless_string`` only if it is not a string (one script on the
        node either way): a copy another server stored meanwhile is kept."""
        name = chunk_name(key)
        try:
            for node, client, _ in self.nodes.route([name]):
                if unless_string:
                    self.nodes.run(node, client, lambda p: p.eval(_DROP_NON_STRING_LUA, 1, name))
                elif expect is None:
                    self.nodes.run(node, client, lambda p: p.delete(name))
                else:
                    self.nodes.run(node, client, lambda p: p.eval(_DELETE_IF_LUA, 1, name, expect))
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
        names = [chunk_name(k) for k, _, _ in items]
        written = 0
        try:
            routes = self.nodes.route(names)
        except NodeUnavailable as exc:
            self._unavailable("a save", exc)
            self.counters.add(remote_dropped=len(items))
            return 0
        routed = sum(len(idx) for _, _, idx in routes)
        if routed < len(items):  # keys of a slot no node serves (a cluster mid-failover)
            self.counters.add(remote_dropped=len(items) - routed)
        for node, client, idx in routes:
            todo = list(idx)  # what a failure drops: all, then only those not there already
            try:
                limit = self._value_limit(node, client)
                too_big = [i for i in idx if _MANIFEST.size + len(items[i][1]) + _SUM.size
                           + items[i][2].nbytes > limit]
                if too_big:  # the server would drop the connection mid-value
                    self.counters.add(remote_dropped=len(too_big))
                    self._warn("too-big", "kvtier: remote tier %s: not uploading %d record(s) over %d "
                               "bytes, the server's largest value (proto-max-bulk-len)",
                               self.address.describe(), len(too_big), limit)
                    todo = idx = [i for i in idx if i not in too_big]
                    if not idx:
                        continue
                there = self.nodes.run(node, client, lambda p, idx=idx: [p.exists(names[i]) for i in idx])
                todo = [i for i, r in zip(idx, there, strict=True) if r != 1]
                if not todo:
                    continue
                # one SET per chunk: the server stores or refuses each chunk whole
                replies = self.nodes.run(node, client, lambda p, todo=todo: [
                    self._add_set(p, names[i], items[i]) for i in todo])
            except NodeUnavailable as exc:
                self._unavailable("a save", exc)
                self.counters.add(remote_dropped=len(todo))
                continue
            done = [i for i, r in zip(todo, replies, strict=True) if not isinstance(r, Exception)]
            refused = [r for r in replies if isinstance(r, Exception)]
            if refused:
                self.counters.add(remote_dropped=len(refused))
                oom = next((r for r in refused if _is_oom(r)), None)
                if oom is not None:
                    self._warn("refused", "kvtier: remote tier %s refused writes (%s); set maxmemory-policy "
                               "to allkeys-lru so the server evicts instead", self.address.describe(), oom)
                elif not all(_is_transient(r) for r in refused):
                    self._warn("refused-other", "kvtier: remote tier %s refused writes (%s)",
                               self.address.describe(), refused[0])
                # a slot moving (MOVED, ASK, TRYAGAIN): those chunks are dropped, counted, and
                # the slot map is re-read (RedisNodes.run); nothing to warn about
            written += len(done)
            self.counters.add(remote_saves=len(done),
                              remote_bytes_saved=sum(len(items[i][1]) + items[i][2].nbytes for i in done))
        return written

    @staticmethod
    def _add_set(pipe: object, name: str, item: tuple[bytes, bytes, memoryview]) -> None:
        """Queue one record's ``SET`` (manifest and payload as one value) on ``pipe``."""
        _, header, payload = item
        manifest = pack_manifest(header, payload.nbytes, os.urandom(8))
        pipe.execute_command("SET", name, Joined((manifest, payload)))  # type: ignore[attr-defined]

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

    @property
    def queued_bytes(self) -> int:
        """Bytes waiting for upload or being uploaded (what ``queue_bytes`` bounds)."""
        with self._cv:
            return self._queued_bytes

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
