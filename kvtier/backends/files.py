"""Files backend: one file per record under hash-sharded directories.

A record is written to a temp file (with aiofiles, many at once) and renamed into place,
so a lookup sees the whole record or nothing; with ``durability="power"`` each file and
each touched directory is fsynced once per batch before the batch counts as stored.
Records are read with ``readinto`` into a reused per-thread buffer (no per-read
allocation). An in-memory index (key -> size, last use) is rebuilt by a background scan
on open, so opening is instant and a restart sees everything on disk; until the scan is
done, and for records written by other processes, lookups fall back to ``stat``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import aiofiles

from kvtier.backends.base import Backend, EntryInfo, PutItem, ThreadBuffer, write_json_atomic
from kvtier.codec import MAGIC, MAX_HEADER_BYTES
from kvtier.config import CacheConfig
from kvtier.errors import RecordError

T = TypeVar("T")
SUFFIX = ".kvt"
_NS_OFFSET = 8 + 2 + 2 + 4 + 4 + 8 + 8 + 8 + 8 + 32  # namespace id position in the header


_FORK_ORPHANS: list[object] = []


def _owner_only(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


class FilesBackend(Backend):
    name = "files"

    def __init__(self, root: Path, config: CacheConfig, *, readonly: bool = False) -> None:
        super().__init__(root, config, readonly=readonly)
        self._data = root / "files"
        self._tmp = root / "files" / "tmp"
        self._nsdir = root / "namespaces"
        if not readonly:
            for d in (self._data, self._tmp, self._nsdir):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._remove_orphan_temps()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._index: dict[bytes, tuple[int, int]] = {}  # key -> (size, last use ns)
        self._bytes = 0
        self._buf = ThreadBuffer()
        self._pool: ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scanned = threading.Event()
        self._scanner = threading.Thread(target=self._scan, name="kvtier-files-scan", daemon=True)
        self._scanner.start()

    def after_fork_in_child(self) -> None:
        # The parent's locks may be held by threads that do not exist here, and its event
        # loop and I/O threads are not ours: start afresh (the parent's objects are kept
        # referenced, never closed here, so nothing of the parent's is torn down).
        _FORK_ORPHANS.append((self._loop, self._pool))
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._loop = None
        self._pool = None
        if not self._scanned.is_set():  # the scan thread did not survive the fork
            self._scanned = threading.Event()
            self._scanner = threading.Thread(target=self._scan, name="kvtier-files-scan", daemon=True)
            self._scanner.start()

    # -- paths and index ---------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self._data / h[:2] / h[2:4] / (h + SUFFIX)

    def _scan(self) -> None:
        found: dict[bytes, tuple[int, int]] = {}
        for path, st in self._walk():
            try:
                found[bytes.fromhex(path.name[: -len(SUFFIX)])] = (st.st_size, st.st_mtime_ns)
            except ValueError:
                continue
        with self._lock:
            for k, v in found.items():
                self._index.setdefault(k, v)
            self._bytes = sum(v[0] for v in self._index.values())
        self._scanned.set()

    def _walk(self) -> Iterator[tuple[Path, os.stat_result]]:
        if not self._data.is_dir():
            return
        for a in os.scandir(self._data):
            if not a.is_dir() or a.name == "tmp":
                continue
            for b in os.scandir(a.path):
                if not b.is_dir():
                    continue
                for f in os.scandir(b.path):
                    if f.name.endswith(SUFFIX):
                        try:
                            yield Path(f.path), f.stat()
                        except FileNotFoundError:  # removed by another process meanwhile
                            continue

    def _remove_orphan_temps(self) -> None:
        """Delete temp files of writers that no longer run (a killed writer's leftovers)."""
        for f in os.scandir(self._tmp):
            pid = f.name.split("-", 1)[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f.path)

    def _known(self, key: bytes) -> bool:
        with self._lock:
            if key in self._index:
                return True
        try:
            st = os.stat(self._path(key))
        except FileNotFoundError:
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = (st.st_size, st.st_mtime_ns)
                self._bytes += st.st_size
        return True

    # -- writes ------------------------------------------------------------------
    def put_many(self, items: list[PutItem]) -> None:
        if not items:
            return
        with self._write_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._pool = ThreadPoolExecutor(self.config.io_threads, thread_name_prefix="kvtier-aio")
                self._loop.set_default_executor(self._pool)
            temps = self._loop.run_until_complete(self._write_temps(items))
            try:
                changed: set[Path] = set()  # directories that gained an entry
                now = time.time_ns()
                for it, tmp in zip(items, temps, strict=True):
                    final = self._path(it.key)
                    changed |= self._make_dirs(final.parent)
                    # last use = now, on the clock touch() uses: the kernel stamps writes with
                    # a coarse clock (a tick behind), which could rank a new record older
                    # than one touched just before it was written
                    os.utime(tmp, ns=(now, now))
                    os.replace(tmp, final)
                    changed.add(final.parent)
                if self.config.durability == "power":  # file data was fsynced before the rename
                    self._fsync_dirs(changed)
            except OSError:
                for tmp in temps:
                    _unlink_quiet(tmp)
                raise
        with self._lock:
            for it in items:
                old = self._index.get(it.key)
                self._bytes += it.size - (old[0] if old else 0)
                self._index[it.key] = (it.size, now)

    async def _write_temps(self, items: list[PutItem]) -> list[str]:
        results = await asyncio.gather(*(self._write_one(it) for it in items), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for r in results:
                if isinstance(r, str):
                    _unlink_quiet(r)
            raise errors[0] if isinstance(errors[0], OSError) else OSError(str(errors[0]))
        return [r for r in results if isinstance(r, str)]

    async def _write_one(self, it: PutItem) -> str:
        tmp = str(self._tmp / f"{os.getpid()}-{threading.get_ident()}-{it.key.hex()[:16]}.tmp")
        try:
            async with aiofiles.open(tmp, "wb", opener=lambda p, f: _owner_only(p, f | os.O_TRUNC)) as f:
                await f.write(it.header)
                await f.write(it.payload)
                if self.config.durability == "power":
                    await f.flush()
                    await asyncio.get_running_loop().run_in_executor(None, os.fsync, f.fileno())
        except BaseException:
            _unlink_quiet(tmp)
            raise
        return tmp

    def _make_dirs(self, shard: Path) -> set[Path]:
        """Create a shard directory and its parent level, owner-only (``mkdir(parents=True)``
        would create the parent with default permissions); return the directories that
        gained an entry."""
        if shard.is_dir():
            return set()
        changed: set[Path] = set()
        for d in (shard.parent, shard):
            try:
                d.mkdir(mode=0o700)
                changed.add(d.parent)
            except FileExistsError:
                continue
        return changed

    def _fsync_dirs(self, dirs: set[Path]) -> None:
        for d in dirs:
            fd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def touch(self, keys: Iterable[bytes], now_ns: int) -> None:
        for k in keys:
            try:
                os.utime(self._path(k), ns=(now_ns, now_ns))
            except FileNotFoundError:
                continue
            with self._lock:
                if k in self._index:
                    self._index[k] = (self._index[k][0], now_ns)

    def delete(self, keys: Iterable[bytes]) -> int:
        freed = 0
        for k in keys:
            path = self._path(k)
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                size = 0
            freed += size
            with self._lock:
                old = self._index.pop(k, None)
                if old:
                    self._bytes -= old[0]
        return freed

    # -- reads -------------------------------------------------------------------
    def read(self, key: bytes, fn: Callable[[memoryview], T]) -> T | None:
        try:
            with open(self._path(key), "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if size > self.config.max_record_bytes + MAX_HEADER_BYTES:
                    # never size a buffer by a length nothing has checked
                    raise RecordError(f"record file is {size} bytes, over max_record_bytes")
                view = self._buf.get(size)
                got = f.readinto(view)
        except FileNotFoundError:
            with self._lock:
                old = self._index.pop(key, None)
                if old:
                    self._bytes -= old[0]
            return None
        return fn(view[:got])

    def count_present_prefix(self, keys: Iterable[bytes]) -> int:
        n = 0
        for k in keys:
            if not self._known(k):
                break
            n += 1
        return n

    def entries(self) -> Iterator[EntryInfo]:
        for path, st in self._walk():
            try:
                key = bytes.fromhex(path.name[: -len(SUFFIX)])
                with open(path, "rb") as f:
                    head = f.read(_NS_OFFSET + 16)
            except (ValueError, OSError):
                continue
            ns = head[_NS_OFFSET : _NS_OFFSET + 16] if head.startswith(MAGIC) else b"\0" * 16
            yield EntryInfo(key, st.st_size, st.st_mtime_ns, ns)

    def usage(self) -> tuple[int, int]:
        self._scanned.wait()
        with self._lock:
            return len(self._index), self._bytes

    def evict_lru(self, target_bytes: int) -> tuple[int, int]:
        self._scanned.wait()
        with self._lock:
            if self._bytes <= target_bytes:
                return 0, 0
        # Other processes add and remove records too (servers, `kvtier evict`): decide on a
        # fresh scan of the disk, and resynchronise the index with it.
        entries = list(self.entries())
        with self._lock:
            self._index = {e.key: (e.size, e.atime_ns) for e in entries}
            self._bytes = sum(e.size for e in entries)
        return self.evict_from(entries, target_bytes)

    def register_namespace(self, namespace_id: bytes, description: dict[str, object]) -> None:
        path = self._nsdir / (namespace_id.hex() + ".json")
        if not path.exists():
            write_json_atomic(path, description)

    def namespaces(self) -> dict[bytes, dict[str, object]]:
        out: dict[bytes, dict[str, object]] = {}
        if self._nsdir.is_dir():
            for f in self._nsdir.glob("*.json"):
                try:
                    out[bytes.fromhex(f.stem)] = json.loads(f.read_text())
                except (ValueError, OSError):
                    continue
        return out

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            pass
