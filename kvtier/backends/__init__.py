"""Persistent backends and the store directory they live in.

A store directory holds ``kvtier-store.json`` (what kvtier wrote it, with which backend and
on-disk layout version) and the backend's own files. ``open_backend`` refuses directories
that are not kvtier stores, stores of another backend, and stores of a newer layout, with
a message that says what to do.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# (not 'import lmdb': the submodule kvtier.backends.lmdb would shadow that name here)
from lmdb import Error as LmdbError

from kvtier.backends.base import Backend, EntryInfo, PutItem, PutResult
from kvtier.backends.lmdb_check import not_damage, unusable_store
from kvtier.backends.payloads import PayloadStore, open_regular_file
from kvtier.codec import MAX_HEADER_BYTES
from kvtier.config import CacheConfig
from kvtier.errors import ConfigError, StoreError, StoreFormatError

log = logging.getLogger("kvtier")
MARKER = "kvtier-store.json"
LOCKFILE = "kvtier.lock"
# 2: one shared LMDB index (``index/``) names every record; payloads at unique locations.
STORE_LAYOUT_VERSION = 2
# Settings every process of a store shares: kept in the store, so the CLI, the library and
# every server read the same values instead of their own defaults.
STORED_SETTINGS = ("disk_bytes", "max_record_bytes", "chunk_tokens", "compression", "durability")
# Of those, the shared limits: eviction reads the budget from the store inside each commit,
# and the CLI judges records by the recorded size limit. A writer's default never replaces a
# recorded one. The others say how the newest writer writes (its keys, its records),
# defaults included.
SHARED_LIMITS = ("disk_bytes", "max_record_bytes")

__all__ = ["Backend", "EntryInfo", "PutItem", "PutResult", "open_backend", "read_marker", "StoreLock",
           "SHARED_LIMITS", "STORED_SETTINGS", "adopt_settings", "open_shared", "stored_config"]


# what a marker this kvtier cannot use leaves the user to do (nothing of the store is touched)
_ELSEWHERE = "move the directory away and let the cache refill a new one"
_DAMAGED = f"the store marker is damaged; restore it from a backup, or {_ELSEWHERE}"


def _make_backend(root: Path, config: CacheConfig, readonly: bool) -> Backend:
    max_read = int(config.max_record_bytes) + MAX_HEADER_BYTES
    payloads: PayloadStore
    if config.backend == "lmdb":
        from kvtier.backends.lmdb import LmdbPayloads

        payloads = LmdbPayloads(root, config.durability, int(config.disk_bytes), max_read, readonly=readonly)
    else:
        from kvtier.backends.files import FilePayloads

        payloads = FilePayloads(root, config.durability, config.io_threads, max_read, readonly=readonly,
                                direct_reads=config.direct_reads)
    try:
        return Backend(root, config, payloads, readonly=readonly)
    except BaseException:
        payloads.close()
        raise


def read_marker(root: Path) -> dict[str, object]:
    """Read and check a store's marker; raise :class:`StoreError` with advice if unusable."""
    if not root.exists():
        raise StoreError(f"{root}: no such directory; check the path (a store is created by the first save)")
    if not root.is_dir():
        raise StoreError(f"{root}: not a directory; pass the store directory")
    marker = root / MARKER
    try:
        info = json.loads(_read_small_file(marker))
    except FileNotFoundError:
        raise StoreError(f"{root}: not a kvtier store (no {MARKER}); pass the directory a kvtier cache was opened on") from None
    except PermissionError:
        raise StoreError(f"{root}: cannot read {MARKER} (permission denied); run as the store's owner") from None
    except (ValueError, OSError) as exc:
        raise StoreError(f"{root}: {MARKER} is unreadable ({exc}); {_DAMAGED}") from None
    if not isinstance(info, dict) or info.get("format") != "kvtier-store":
        raise StoreError(f"{root}: {MARKER} is not a kvtier store marker")
    version = info.get("layout_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise StoreError(f"{root}: {MARKER} has no valid layout_version ({version!r}); {_DAMAGED}")
    if version > STORE_LAYOUT_VERSION:
        raise StoreFormatError(
            f"{root}: store layout version {version} was written by a newer kvtier "
            f"(this one reads version {STORE_LAYOUT_VERSION}); upgrade kvtier or use another path"
        )
    if version < STORE_LAYOUT_VERSION:
        raise StoreFormatError(
            f"{root}: store layout version {version} was written by an older kvtier, before the "
            f"shared index (this one uses layout {STORE_LAYOUT_VERSION}); kvtier does not migrate "
            "its records: delete the directory (the cache refills itself) or point the "
            "cache at a new path"
        )
    backend = info.get("backend")
    if backend not in ("lmdb", "files"):
        raise StoreError(f"{root}: unknown backend {backend!r} in {MARKER} (a newer kvtier's?); upgrade "
                         f"kvtier, or {_ELSEWHERE}")
    other = "files" if backend == "lmdb" else "lmdb"
    if (root / other).is_dir() and not (root / str(backend)).is_dir():
        raise StoreError(f"{root}: {MARKER} says backend {backend!r}, but the store holds "
                         f"{other!r} records ({other}/); {_DAMAGED}")
    return info


def _read_small_file(path: Path, limit: int = 1 << 20) -> str:
    """A small regular file's text (a FIFO would block a plain read forever)."""
    fd = open_regular_file(path, follow_links=True)
    try:
        return os.read(fd, limit).decode()
    finally:
        os.close(fd)


def _create_marker(root: Path, backend: str) -> None:
    from kvtier.backends.base import write_json_atomic

    outer = next((p for p in root.parents if (p / MARKER).exists()), None)
    if outer is not None:  # its sweeps and evictions would see this store's files as its own
        raise StoreError(f"{root}: inside the kvtier store at {outer}; put a new store outside any other")
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:  # (read-only or special file system, no permission)
        raise StoreError(f"{root}: cannot create the store directory ({exc.strerror or exc}); choose a "
                         "path on a writable local file system") from exc
    marker = root / MARKER
    # Another process may be creating this store now: whatever it has put here is its store
    # once its marker exists (checked again after looking), and of two markers written at
    # once only the first is kept (exclusive), so two creators with different backends end
    # with one store, and the loser is refused by read_marker's backend check.
    if any(p.name not in (MARKER, LOCKFILE) and not p.name.startswith(f".{MARKER}") for p in root.iterdir()):
        if marker.exists():
            return
        raise StoreError(
            f"{root}: directory is not empty and is not a kvtier store; choose an empty or new directory"
        )
    write_json_atomic(marker, {
        "format": "kvtier-store", "layout_version": STORE_LAYOUT_VERSION,
        "backend": backend, "created": time.time(),
    }, exclusive=True)


class StoreLock:
    """An advisory lock on a store: shared by every user, exclusive for maintenance (compact)."""

    def __init__(self, root: Path, exclusive: bool = False) -> None:
        path = root / LOCKFILE
        try:
            with _full_disk_as_store_full(root):  # (the lock file's inode)
                self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS) or not path.exists():
                raise
            # flock needs no write access: a user who may only read the store (or a read-only
            # file system) locks it through a read-only descriptor, with the same effect
            self._fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(self._fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise StoreError(
                f"{root}: the store is in use by another process; "
                + ("stop the server using it first" if exclusive else "it is being compacted, retry shortly")
            ) from None

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def open_backend(config: CacheConfig, *, readonly: bool = False, create: bool = True) -> Backend:
    """Open (creating if allowed) the store at ``config.path`` with the configured backend."""
    root = config.path
    with _full_disk_as_store_full(root):  # (its marker, its directories)
        if create and not readonly and not (root / MARKER).exists():
            _create_marker(root, config.backend)
        info = read_marker(root)
        if info["backend"] != config.backend:
            config._follow_store_backend(str(info["backend"]))  # created since the config was made
        if info["backend"] != config.backend:
            raise StoreError(
                f"{root}: store was created with backend {info['backend']!r}, config asks for "
                f"{config.backend!r}; set backend={info['backend']!r} or use another path"
            )
        try:
            return _make_backend(root, config, readonly)
        except LmdbError as exc:
            raise unusable_store(root, exc) from None


@contextmanager
def _full_disk_as_store_full(root: Path) -> Iterator[None]:
    """An OSError that says the disk is full becomes :class:`StoreFull` (a server then serves
    without the cache); any other passes unchanged (a wrong path: the user must see it)."""
    try:
        yield
    except OSError as exc:
        if not_damage(exc, root) != "full":
            raise
        raise unusable_store(root, exc) from None


def adopt_settings(backend: Backend, config: CacheConfig) -> None:
    """Record a writer's settings in the store. A shared limit (:data:`SHARED_LIMITS`) is
    recorded only if the config gives it or the store has none yet: a process opened with
    only a path (a restarted server, a second one, a tool) keeps the budget the servers set,
    and a budget given explicitly holds for all. The other settings describe how this writer
    writes, and are recorded as they are (the newest writer's hold)."""
    mine = {k: getattr(config, k) for k in STORED_SETTINGS}
    given = {k: v for k, v in mine.items() if k not in SHARED_LIMITS or k in config.chosen}
    old = backend.index.set_settings(given, defaults=mine)
    changed = {k: (old[k], v) for k, v in given.items() if k in old and old[k] != v}
    if changed:
        log.warning("kvtier: %s: store settings changed by this process: %s", config.path,
                    ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items())))


def stored_config(root: Path, backend: str, **overrides: object) -> CacheConfig:
    """The config a store was last written with (for tools that open it beside writers)."""
    from kvtier.backends.index import StoreIndex

    values: dict[str, object] = {}
    try:
        index = StoreIndex(root, readonly=True)
    except Exception:  # no index yet (never written): defaults
        index = None
    if index is not None:
        try:
            values = {k: v for k, v in index.settings().items() if k in STORED_SETTINGS}
        finally:
            index.close()
    for name, value in list(values.items()):  # a value that does not validate is not used
        try:
            CacheConfig(path=root, backend=backend, **{name: value})  # type: ignore[arg-type]
        except (ConfigError, TypeError):
            log.warning("kvtier: %s: ignoring the store's recorded %s=%r (invalid); using the default",
                        root, name, value)
            del values[name]
    return CacheConfig(path=root, backend=backend, **{**values, **overrides})  # type: ignore[arg-type]


def open_shared(config: CacheConfig, *, readonly: bool = False) -> tuple[StoreLock, Backend]:
    """Open (creating if allowed) a store as a serving process does: under a shared
    :class:`StoreLock`, and, for a writer, recording its settings in the store.

    The lock is taken before opening an existing store, but never written into a directory
    that is not a store; nothing is held if opening fails.
    """
    lock = StoreLock(config.path) if (config.path / MARKER).exists() else None
    try:
        backend = open_backend(config, readonly=readonly)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    try:
        if lock is None:
            lock = StoreLock(config.path)
        if not readonly:
            adopt_settings(backend, config)
    except BaseException as exc:
        backend.close()
        if lock is not None:
            lock.release()
        if isinstance(exc, LmdbError):
            raise unusable_store(config.path, exc) from None
        raise
    return lock, backend
