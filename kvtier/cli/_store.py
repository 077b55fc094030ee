"""Store access for the CLI, on top of the public backend interface.

- :func:`open_store` opens an existing store (never creates one) with the backend its
  marker names, read-only unless asked, under a *shared* :class:`StoreLock` — the same lock
  a serving process holds — so ``kvtier compact`` cannot swap files underneath it.
- :func:`read_header` reads and checks one record's header without its payload (its first
  bytes only).
- :func:`resolve_namespaces` turns ``--namespace HEXPREFIX`` / ``--model NAME`` into ids.

Nothing here holds an LMDB read transaction for long: ``entries()`` is drained into a list
(one short snapshot), then each record is read in its own short transaction, so a writer
process is never blocked and the map never pins many old pages.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.backends import (
    LOCKFILE,
    Backend,
    EntryInfo,
    StoreLock,
    open_backend,
    read_marker,
    stored_config,
)
from kvtier.backends.files import scan_shard
from kvtier.cli._common import NotFoundError, UsageError
from kvtier.codec import RecordHeader, decode_header, verify_payload
from kvtier.errors import IncompatibleRecord, RecordError, RecordTooLarge, StoreError
from kvtier.keys import KEY_BYTES, Namespace

# Enough for any header: fixed part + 8 dims * 8 bytes + header checksum (< 256 bytes).
_HEADER_READ = 512
_HEADER_LEN_AT = struct.Struct("<8sHH")  # magic, format_version, header_len
# What a record can fail with when read: classified by :func:`problem`.
RECORD_PROBLEMS = (RecordError, RecordTooLarge, OSError)
BATCH = 256  # keys per delete: keeps each LMDB write transaction short


@dataclass
class OpenStore:
    root: Path
    marker: dict[str, object]
    backend: Backend

    @property
    def backend_name(self) -> str:
        return str(self.marker["backend"])


def store_root(path: str) -> Path:
    if not path.strip():  # (Path("") is the current directory)
        raise UsageError("STORE: an empty path; give the store directory")
    return Path(path).expanduser()


@contextmanager
def open_store(path: str, *, write: bool = False, exclusive: bool = False,
               removes_records: bool = False) -> Iterator[OpenStore]:
    """Open an existing store; refuse with advice if it is missing, foreign or too new.

    The store lock is shared (beside a server) unless ``exclusive``, which refuses
    (:class:`StoreError`) while anyone else has the store open. ``removes_records``: the
    command deletes records (it needs write access to a files store's record directories).
    """
    root = store_root(path)
    marker = read_marker(root)
    check_access(root, str(marker["backend"]), write=write, removes_records=removes_records)
    # The settings its writers recorded in it (limits, budget), with its backend.
    config = stored_config(root, str(marker["backend"]))
    lock = StoreLock(root, exclusive=exclusive)
    try:
        backend = open_backend(config, readonly=not write, create=False)
        try:
            yield OpenStore(root, marker, backend)
        finally:
            backend.close()
    finally:
        lock.release()


def _may(path: Path, mode: int) -> bool:
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


def check_access(root: Path, backend: str, *, write: bool, removes_records: bool = False) -> None:
    """Refuse, saying what is needed, a user who cannot write the files every user of a store
    writes, even one that only reads: LMDB records each reader in the environment's
    ``lock.mdb`` (so a writer does not reuse pages it reads; reading without that table is
    not safe beside a server). A command that changes the store also needs the data files.
    Without this, LMDB's "Permission denied" would read as a damaged store."""
    try:
        read_only_fs = bool(os.statvfs(root).f_flag & os.ST_RDONLY)
    except OSError:
        return  # let opening report it
    if read_only_fs:
        if write:
            raise StoreError(f"{root}: the store's file system is mounted read-only and this command "
                             "changes the store; remount it read-write (commands that only read "
                             "work as it is)")
        return  # LMDB reads without its lock files there (no writer can exist)
    missing: list[str] = []
    lockfile = root / LOCKFILE
    if lockfile.exists():
        if not _may(lockfile, os.R_OK):  # an existing one is locked through a read-only fd
            missing.append(f"{LOCKFILE} (read)")
    elif not _may(root, os.W_OK):
        missing.append(f"{root.name}/ (write, to create {LOCKFILE})")
    for env in [root / "index"] + ([root / "lmdb"] if backend == "lmdb" else []):
        if not env.is_dir():
            continue
        for name in ("lock.mdb", "data.mdb") if write else ("lock.mdb",):
            f = env / name
            if not _may(f if f.exists() else env, os.W_OK):
                missing.append(f"{env.name}/{name} (write)" if f.exists() else f"{env.name}/ (write)")
    if removes_records and backend == "files":  # removing a record file needs its directory's write bit
        missing += _unwritable_record_dirs(root / "files")
    if missing:
        why = ("changing the store needs" if write else
               "every command needs, even a read-only one (LMDB records each reader in lock.mdb)")
        raise StoreError(
            f"{root}: this user lacks access to {', '.join(missing)}, which {why}; run as the "
            "store's owner (e.g. sudo -u OWNER kvtier ...): kvtier creates a store's files for "
            "their owner only, so access granted to a group does not extend to files written later")


def _unwritable_record_dirs(files: Path, show: int = 3) -> list[str]:
    """The files backend's record directories (``files/``, ``files/xx/``, ``files/xx/yy/``)
    this user cannot write: a command that removes records would drop them from the index
    and then fail to delete their files, leaking the space."""
    if not files.is_dir():
        return []
    dirs = [files]
    for a in scan_shard(str(files)):
        if a.is_dir(follow_symlinks=False):
            dirs.append(Path(a.path))
            dirs += [Path(b.path) for b in scan_shard(a.path) if b.is_dir(follow_symlinks=False)]
    # (one a removal emptied and removed since the listing is not a problem)
    bad = [d for d in dirs if not _may(d, os.W_OK | os.X_OK) and d.exists()]
    named = [f"{d.relative_to(files.parent)}/ (write)" for d in bad[:show]]
    if len(bad) > show:
        named.append(f"and {len(bad) - show} more record directories (write)")
    return named


def snapshot(backend: Backend) -> list[EntryInfo]:
    """Every record's metadata, read in one short pass (one LMDB read transaction)."""
    return list(backend.entries())


def delete_in_batches(backend: Backend, keys: list[bytes]) -> int:
    """Delete ``keys`` in short write transactions; the bytes freed on disk (occupied)."""
    return sum(backend.delete(keys[i : i + BATCH]) for i in range(0, len(keys), BATCH))


# -- headers and checks ---------------------------------------------------------------
def record_file(backend: Backend, key: bytes) -> Path | None:
    """Where the files backend keeps ``key``'s record (None for other backends or if absent)."""
    path_of = getattr(backend.payloads, "path_of", None)
    entry = backend.lookup(key) if path_of is not None else None
    return None if entry is None else path_of(entry.key, entry.location)


def _max_record_bytes(backend: Backend) -> int:
    """The store's record size limit (a size string parsed to bytes by ``CacheConfig``)."""
    return int(backend.config.max_record_bytes)


def _check_identity(header: RecordHeader, key: bytes) -> RecordHeader:
    if header.key != key:
        raise RecordError("record is filed under another key than the one in its header")
    return header


def problem(exc: Exception) -> tuple[str, str]:
    """``(kind, why)`` of one of :data:`RECORD_PROBLEMS`: kind is incompatible (intact, but
    another format version or over this store's max_record_bytes), corrupt or unreadable."""
    if isinstance(exc, IncompatibleRecord | RecordTooLarge):  # intact: never removed
        return "incompatible", str(exc)
    if isinstance(exc, RecordError):
        return "corrupt", str(exc)
    return "unreadable", str(getattr(exc, "strerror", None) or exc)


def parse_header(head: bytes | memoryview, record_len: int, key: bytes, max_record_bytes: int) -> RecordHeader:
    """Check the header at the start of a record of ``record_len`` bytes."""
    mv = memoryview(head).cast("B")
    if len(mv) < _HEADER_LEN_AT.size:
        raise RecordError(f"record too short for a header ({len(mv)} bytes)")
    header_len = _HEADER_LEN_AT.unpack_from(mv, 0)[2]
    header = decode_header(mv[:header_len] if header_len <= len(mv) else mv,
                           max_record_bytes=max_record_bytes)
    if header.record_len != record_len:
        raise RecordError(f"record is {record_len} bytes, header says {header.record_len} (truncated?)")
    return _check_identity(header, key)


def read_header(backend: Backend, key: bytes) -> RecordHeader | None:
    """The checked header of ``key`` (payload not read); None if the record is gone.

    Raises :class:`RecordError` for a malformed header, ``OSError`` if unreadable.
    """
    got = backend.read_head(key, _HEADER_READ)
    return None if got is None else parse_header(got[0], got[1], key, _max_record_bytes(backend))


def check_record(backend: Backend, key: bytes, data: memoryview | None = None) -> RecordHeader | None:
    """Read the whole record (or take ``data``, its bytes read already) and verify header and
    payload checksum; None if it is gone.

    Raises :class:`RecordError` (corrupt), :class:`IncompatibleRecord` (other format
    version, intact) or ``OSError`` (unreadable).
    """
    def check(view: memoryview) -> RecordHeader:
        header = _check_identity(decode_header(view, max_record_bytes=_max_record_bytes(backend)), key)
        verify_payload(header, view)
        return header

    return backend.read(key, check) if data is None else check(data)


@dataclass
class HeaderScan:
    """Headers of a snapshot of records, with what could not be read."""

    headers: dict[bytes, RecordHeader] = field(default_factory=dict)
    bad: dict[bytes, str] = field(default_factory=dict)  # key -> why
    vanished: int = 0


def scan_headers(backend: Backend, entries: Iterable[EntryInfo]) -> HeaderScan:
    out = HeaderScan()
    for e in entries:
        try:
            h = read_header(backend, e.key)
        except RECORD_PROBLEMS as exc:
            out.bad[e.key] = "{}: {}".format(*problem(exc))
            continue
        if h is None:
            out.vanished += 1
        else:
            out.headers[e.key] = h
    return out


# -- namespaces and keys ---------------------------------------------------------------
def parse_hex(text: str, what: str) -> str:
    h = text.strip().lower()
    if h.startswith("0x"):
        h = h[2:]
    if not h or any(c not in "0123456789abcdef" for c in h):
        raise UsageError(f"{what} {text!r} is not hexadecimal; copy it from 'kvtier ls' or 'kvtier inspect'")
    return h


def _ambiguous(what: str, prefix: str, hits: list[bytes], noun: str, digits: int) -> UsageError:
    return UsageError(f"{what} prefix {prefix!r} is ambiguous ({len(hits)} {noun}: "
                      f"{', '.join(h.hex()[:digits] for h in hits[:4])}...); give more hex digits")


def resolve_namespaces(
    root: Path,
    known: Iterable[bytes],
    descriptions: dict[bytes, dict[str, object]],
    prefixes: list[str] | None,
    models: list[str] | None,
) -> set[bytes]:
    """Namespace ids named by hex prefixes and model names (each must match something)."""
    ids = sorted(set(known) | set(descriptions))
    chosen: set[bytes] = set()
    for text in prefixes or []:
        p = parse_hex(text, "namespace")
        hits = [i for i in ids if i.hex().startswith(p)]
        if not hits:
            raise UsageError(f"unknown namespace {text!r} in {root}; 'kvtier ls {root}' lists its namespaces")
        if len(hits) > 1:
            raise _ambiguous("namespace", text, hits, "match", 12)
        chosen.add(hits[0])
    for model in models or []:
        hits = [i for i, d in descriptions.items() if d.get("model") == model]
        if not hits:
            names = sorted({str(d.get("model")) for d in descriptions.values()})
            raise UsageError(
                f"no namespace of model {model!r} in {root} (models here: {', '.join(names) or 'none'}); "
                f"'kvtier ls {root}' lists them")
        chosen.update(hits)
    return chosen


def namespace_from_description(desc: dict[str, object]) -> Namespace:
    """Rebuild a :class:`Namespace` from what ``register_namespace`` stored."""
    try:
        d = dict(desc)
        shape = d.get("kv_shape")
        extra = d.get("extra") or {}
        if not isinstance(shape, list) or not isinstance(extra, dict):
            raise TypeError("kv_shape or extra has the wrong type")
        d["kv_shape"] = tuple(int(x) for x in shape)
        d["extra"] = tuple(sorted((str(k), str(v)) for k, v in extra.items()))
        return Namespace(**d)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise StoreError(f"namespace description cannot be read ({exc}); was it written by another kvtier?") from None


def find_key(entries: list[EntryInfo] | None, text: str) -> bytes:
    """A full key or a unique hex prefix of one (looked up in ``entries``) -> the key."""
    h = parse_hex(text, "key")
    if len(h) > 2 * KEY_BYTES:
        raise UsageError(f"key {text!r} is longer than a key ({2 * KEY_BYTES} hex digits)")
    if len(h) == 2 * KEY_BYTES:
        return bytes.fromhex(h)
    hits = [e.key for e in entries or () if e.key.hex().startswith(h)]
    if not hits:
        raise NotFoundError(f"no record whose key starts with {h!r}; 'kvtier inspect --help' shows how to find keys")
    if len(hits) > 1:
        raise _ambiguous("key", h, hits, "records", 16)
    return hits[0]


# -- files on disk -----------------------------------------------------------------
def disk_files(root: Path) -> list[tuple[str, int, int, int]]:
    """``(part, files, apparent bytes, allocated bytes)`` per top-level part of the store."""
    parts: dict[str, list[int]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:  # removed by a writer or eviction meanwhile
                continue
            part = str(rel / name) if rel.parts[:1] in ((), ("lmdb",)) else rel.parts[0] + "/"
            acc = parts.setdefault(part, [0, 0, 0])
            acc[0] += 1
            acc[1] += st.st_size
            acc[2] += st.st_blocks * 512
        dirnames.sort()
    return [(p, v[0], v[1], v[2]) for p, v in sorted(parts.items())]


def lmdb_pages(backend: Backend) -> dict[str, int] | None:
    """Page use of the store's LMDB environments (its index, and the records of an ``lmdb``
    store): what ``compact`` could give back. Best effort: None if it cannot be read."""
    try:
        psize, total, used = 0, 0, 0
        for handle in backend.lmdb_envs():
            env = handle.env_now()
            with handle.txn() as txn:
                in_use = handle.page_bytes(txn)
            psize = env.stat()["psize"]
            pages = env.info()["last_pgno"] + 1
            total += pages
            used += min(in_use // psize, pages)
        return {"page_size": psize, "pages_in_file": total, "pages_in_use": used,
                "reclaimable_bytes": max(total - used, 0) * psize}
    except Exception:
        return None
