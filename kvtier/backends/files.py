"""Files backend: one file per record under hash-sharded directories.

A record is written to a temp file (with aiofiles, many at once on ``io_threads``
workers) and renamed into place, so a lookup sees the whole record or nothing; with
``durability="power"`` each file is fdatasynced before its rename and each touched
directory is fsynced once per batch before the batch counts as stored.

Where the filesystem supports it, records are written with ``O_DIRECT`` from
page-aligned, reused (already touched) staging buffers: on the VMs this was tuned on, the
page-cache write path ran at 0.1-0.4x of the disk because fresh page-cache pages are slow
to touch. The bytes on disk are exactly the encoded record: an ``O_DIRECT`` write is
padded to 4 KiB and the file is then truncated to the record's length. Filesystems that
refuse ``O_DIRECT`` (``EINVAL``) get plain buffered writes. Reads go through the page
cache by default, with ``readinto`` into a reused per-thread buffer (``O_DIRECT`` reads:
``direct_reads``). An in-memory index (key -> size, last use) is rebuilt by a background
scan on open, so opening is instant and a restart sees everything on disk; until the scan
is done, and for records written by other processes, lookups fall back to ``stat``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import aiofiles
import numpy as np

from kvtier.backends.base import Backend, EntryInfo, PutItem, ThreadBuffer, write_json_atomic
from kvtier.codec import MAGIC, MAX_HEADER_BYTES
from kvtier.config import CacheConfig
from kvtier.errors import RecordError

T = TypeVar("T")
SUFFIX = ".kvt"
_NS_OFFSET = 8 + 2 + 2 + 4 + 4 + 8 + 8 + 8 + 8 + 32  # namespace id position in the header
_ALIGN = 4096  # O_DIRECT offset/length/address alignment (logical block size, at most a page)
# Per-writer staging buffer: a record bigger than this is written in several aligned
# segments, which bounds staging memory at io_threads x this, and 8 MiB writes already
# run at the disk's sequential speed.
_STAGE_BYTES = 8 << 20


_FORK_ORPHANS: list[object] = []


def _owner_only(path: str, flags: int) -> int:
    return os.open(path, flags, 0o600)


class FilesBackend(Backend):
    name = "files"
    # O_DIRECT reads are implemented but off: on the benchmark VM, cold buffered reads (with
    # the device's 8 MiB readahead) ran at 0.9-2.2 GiB/s against 0.7-1.0 GiB/s for O_DIRECT
    # in every storage_bench run (4 threads, 32 MiB records; docs/benchmarks.md). Writes
    # gain from O_DIRECT here, reads do not. Set True for devices where it pays.
    direct_reads: bool = False

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
        # Keys removed while the start-up scan runs: the scan may have listed them before
        # they went, and must not bring them back into the index.
        self._gone: set[bytes] = set()
        self._bytes = 0
        self._buf = ThreadBuffer()
        self._abuf = AlignedThreadBuffer()
        self._stage: list[mmap.mmap] = []  # O_DIRECT staging buffers, reused across batches
        # None = not tried yet; False after the filesystem refused O_DIRECT (e.g. old tmpfs)
        self._direct_write: bool | None = None
        self._direct_read: bool | None = None
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
                if k not in self._gone:
                    self._index.setdefault(k, v)
            self._gone.clear()
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
                self._gone.discard(it.key)

    async def _write_temps(self, items: list[PutItem]) -> list[str]:
        # One staging buffer per concurrent O_DIRECT writer: at most io_threads records are
        # in flight, each filling and writing its buffer segment by segment.
        free: asyncio.Queue[mmap.mmap] = asyncio.Queue()
        need = min(_round_up(max(it.size for it in items)), _STAGE_BYTES)
        while len(self._stage) < min(self.config.io_threads, len(items)):
            self._stage.append(_anon_map(need))
        for i, b in enumerate(self._stage):
            if len(b) < need:  # grown records: replace (the old buffer is not in use now)
                self._stage[i] = b = _anon_map(need)
            free.put_nowait(b)
        results = await asyncio.gather(*(self._write_one(it, free) for it in items), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for r in results:
                if isinstance(r, str):
                    _unlink_quiet(r)
            raise errors[0] if isinstance(errors[0], OSError) else OSError(str(errors[0]))
        return [r for r in results if isinstance(r, str)]

    async def _write_one(self, it: PutItem, free: asyncio.Queue[mmap.mmap]) -> str:
        tmp = str(self._tmp / f"{os.getpid()}-{threading.get_ident()}-{it.key.hex()[:16]}.tmp")
        try:
            if self._direct_write is not False:
                buf = await free.get()
                try:
                    if await self._write_direct(tmp, it, buf):
                        return tmp
                finally:
                    free.put_nowait(buf)
            async with aiofiles.open(tmp, "wb", opener=lambda p, f: _owner_only(p, f | os.O_TRUNC),
                                     executor=self._pool) as f:
                await f.write(it.header)
                await f.write(it.payload)
                if self.config.durability == "power":
                    await f.flush()
                    await asyncio.get_running_loop().run_in_executor(self._pool, os.fdatasync, f.fileno())
        except BaseException:
            _unlink_quiet(tmp)
            raise
        return tmp

    async def _write_direct(self, tmp: str, it: PutItem, buf: mmap.mmap) -> bool:
        """Write the record with O_DIRECT through ``buf``; False if the filesystem refuses it."""
        loop = asyncio.get_running_loop()
        total = it.size
        try:
            # buffering=0: a raw FileIO, so each write() is one write(2) of the aligned view
            async with aiofiles.open(tmp, "wb", buffering=0, executor=self._pool,
                                     opener=lambda p, f: _owner_only(p, f | os.O_TRUNC | os.O_DIRECT)) as f:
                pos = 0
                while pos < total:
                    n = min(len(buf), total - pos)
                    # the copy runs on the pool too: numpy releases the GIL while copying
                    m = await loop.run_in_executor(self._pool, _stage_segment, buf, it, pos, n)
                    if await f.write(memoryview(buf)[:m]) != m:
                        raise OSError(errno.EIO, f"short O_DIRECT write to {tmp}")
                    pos += n
                if _round_up(total) != total:  # drop the padding: the file is exactly the record
                    await loop.run_in_executor(self._pool, os.ftruncate, f.fileno(), total)
                if self.config.durability == "power":
                    await loop.run_in_executor(self._pool, os.fdatasync, f.fileno())
        except OSError as exc:
            if exc.errno != errno.EINVAL or self._direct_write:
                raise
            self._direct_write = False  # never worked here: buffered from now on
            _unlink_quiet(tmp)
            return False
        self._direct_write = True
        return True

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
            self._forget(k)
        return freed

    def _forget(self, key: bytes) -> None:
        """Drop ``key`` from the index (its file is gone)."""
        with self._lock:
            old = self._index.pop(key, None)
            if old:
                self._bytes -= old[0]
            if not self._scanned.is_set():
                self._gone.add(key)

    # -- reads -------------------------------------------------------------------
    def read(self, key: bytes, fn: Callable[[memoryview], T]) -> T | None:
        try:
            fd, direct = self._open_read(self._path(key))
        except FileNotFoundError:
            self._forget(key)
            return None
        try:
            size = os.fstat(fd).st_size
            if size > self.config.max_record_bytes + MAX_HEADER_BYTES:
                # never size a buffer by a length nothing has checked
                raise RecordError(f"record file is {size} bytes, over max_record_bytes")
            if direct:
                try:
                    # aligned length: O_DIRECT reads whole blocks and stops short at EOF
                    view = self._abuf.get(_round_up(size))
                    got = _read_full(fd, view)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    direct = False  # this file or filesystem refuses it: read buffered
                    os.close(fd)
                    fd = -1
                    fd = os.open(self._path(key), os.O_RDONLY)
            if not direct:
                view = self._buf.get(size)
                got = _read_full(fd, view)
        finally:
            if fd >= 0:
                os.close(fd)
        return fn(view[: min(got, size)])

    def _open_read(self, path: Path) -> tuple[int, bool]:
        if self.direct_reads and self._direct_read is not False:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct_read = False
            else:
                return fd, True
        return os.open(path, os.O_RDONLY), False

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


def _anon_map(size: int) -> mmap.mmap:
    # MAP_PRIVATE: Python's default for anonymous maps is MAP_SHARED, which a forked child
    # would share with its parent, so two processes' writers would fill the same buffer.
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _stage_segment(buf: mmap.mmap, it: PutItem, pos: int, n: int) -> int:
    """Copy record bytes ``[pos, pos + n)`` (header, then payload) to the start of ``buf``,
    zero the padding up to the next 4 KiB; return the aligned length to write."""
    dst = np.frombuffer(buf, dtype=np.uint8)
    hlen = len(it.header)
    done = 0
    if pos < hlen:
        h = it.header[pos : pos + n]
        dst[: len(h)] = np.frombuffer(h, dtype=np.uint8)
        done = len(h)
    if done < n:
        p0 = pos + done - hlen
        src = np.frombuffer(it.payload.cast("B"), dtype=np.uint8)
        np.copyto(dst[done:n], src[p0 : p0 + n - done])
    m = _round_up(n)
    dst[n:m] = 0
    return m


def _read_full(fd: int, view: memoryview) -> int:
    """Read from offset 0 until ``view`` is full or EOF; return the bytes read."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], got)
        if n == 0:
            break
        got += n
    return got


class AlignedThreadBuffer(threading.local):
    """A per-thread page-aligned (mmap) read buffer for O_DIRECT, grown as needed."""

    def __init__(self) -> None:
        self.mm: mmap.mmap | None = None

    def get(self, size: int) -> memoryview:
        if self.mm is None or len(self.mm) < size:
            # the old map is freed once no view of it is left (a caller may still hold one)
            self.mm = _anon_map(max(size, _ALIGN, len(self.mm) * 3 // 2 if self.mm else 0))
        return memoryview(self.mm)[:size]


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
