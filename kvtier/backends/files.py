"""Files payload store: one file per record version under hash-sharded directories.

A record is written to a temp file (many at once, on a pool of ``io_threads`` threads, each
record in one call on it), then renamed to ``<key>.<location>.kvt``, a name no other version of the record
shares: removing an old version can never remove a newer one. The rename does not make the
record visible; the index commit that names the location does (see ``index.py``). With
``durability="power"`` each file is fdatasynced before its rename and each touched
directory is fsynced before the index commit.

Where the filesystem supports it, records are written with ``O_DIRECT`` from
page-aligned, reused (already touched) staging buffers: on the VMs this was tuned on, the
page-cache write path ran at 0.1-0.4x of the disk because fresh page-cache pages are slow
to touch. The bytes on disk are exactly the encoded record: an ``O_DIRECT`` write is
padded to 4 KiB and the file is then truncated to the record's length. Filesystems that
refuse ``O_DIRECT`` (``EINVAL``) get plain buffered writes. Reads go through the page
cache, with ``readinto`` into a reused per-thread buffer.

One failed record (a temp file that could not be written) fails only itself: the rest
of its batch is stored.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import itertools
import mmap
import os
import queue
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import TypeVar

import numpy as np

from kvtier.anon_memory import anonymous_map
from kvtier.backends.fsync import fsync_path
from kvtier.backends.index import ORPHAN_GRACE_S, EntryInfo, pid_alive, pid_scope
from kvtier.backends.payloads import (
    PayloadStore,
    PutItem,
    ThreadBuffer,
    open_regular_file,
    oversized,
)
from kvtier.codec import MAX_HEADER_BYTES, RecordReader
from kvtier.errors import RecordError

T = TypeVar("T")
SUFFIX = ".kvt"
_ALIGN = 4096  # O_DIRECT offset/length/address alignment (logical block size, at most a page)
# Per-writer staging buffer: a record bigger than this is written in several aligned
# segments, which bounds staging memory at io_threads x this, and 8 MiB writes already
# run at the disk's sequential speed.
_STAGE_BYTES = 8 << 20
# A record in place is written in one write(2) (each system call lets go of the GIL and takes
# it again, and the model's thread of a serving process waits for it), up to this much:
# Linux writes at most 2 GiB - 4 KiB per call, and a short write reads as a full disk.
_DIRECT_WRITE_BYTES = 1 << 30

_FORK_ORPHANS: list[object] = []
_TEMP_SEQ = itertools.count()
_TEMP_SCOPE = pid_scope().hex()  # temp names: <pid scope>-<pid>-<seq>-<key prefix>.tmp


class FilePayloads(PayloadStore):
    name = "files"

    def __init__(self, root: Path, durability: str, io_threads: int, max_record_bytes: int,
                 *, readonly: bool = False, direct_reads: bool = False) -> None:
        self.root = root
        self.durability = durability
        self.io_threads = io_threads
        self.max_record_bytes = max_record_bytes
        self._data = root / "files"
        self._data_dir = str(self._data)  # (the write path builds strings: see _record_path)
        self._tmp = self._data / "tmp"
        if not readonly:
            for d in (self._data, self._tmp):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._remove_dead_temps()
        self._write_lock = threading.Lock()
        self._buf = ThreadBuffer()
        self._stage: list[mmap.mmap] = []  # O_DIRECT staging buffers, reused across batches
        # None = not tried yet; False after the filesystem refused O_DIRECT (e.g. old tmpfs)
        self._direct_write: bool | None = None
        # Reads of what the page cache does not hold use O_DIRECT into the caller's buffer
        # (see _FileReader.fill_record); turned off if the filesystem refuses it.
        self.direct_reads = direct_reads
        self._pool: ThreadPoolExecutor | None = None

    def after_fork_in_child(self) -> None:
        # The parent's lock may be held by a thread that does not exist here, and its I/O
        # threads are not ours: start afresh (the parent's pool is kept referenced, never
        # shut down here, so nothing of the parent's is torn down).
        _FORK_ORPHANS.append(self._pool)
        self._write_lock = threading.Lock()
        self._pool = None

    def occupied(self, size: int) -> int:
        return _round_up(size)  # what the filesystem allocates for it: whole blocks

    # -- paths ---------------------------------------------------------------------------
    def path_of(self, key: bytes, location: int) -> Path:
        return Path(self._record_path(key, location))

    def _record_path(self, key: bytes, location: int) -> str:
        """The record's path as a string: built without pathlib, which holds the GIL about
        fifteen times as long, on the I/O threads, for each record written."""
        h = key.hex()
        return f"{self._data_dir}/{h[:2]}/{h[2:4]}/{h}.{location:016x}{SUFFIX}"

    def _inside(self, key: bytes, location: int) -> str:
        """The record's path, refusing one whose directories lead out of the store (a store
        prepared by someone else may hold symlinks): kvtier never reads or removes a file
        outside it. (The file itself is opened with ``O_NOFOLLOW``.)"""
        path = self._record_path(key, location)
        self._shard_dirs(path, create=False)
        return path

    def found(self) -> Iterator[tuple[bytes, int]]:
        """Every record file on disk, as ``(key, location)``."""
        if not self._data.is_dir():
            return
        for a in os.scandir(self._data):
            if not a.is_dir(follow_symlinks=False) or a.name == "tmp":
                continue
            for b in scan_shard(a.path):
                if not b.is_dir(follow_symlinks=False):
                    continue
                for f in scan_shard(b.path):
                    parsed = _parse_name(f.name)
                    if parsed is not None:
                        yield parsed

    def remove_found(self, key: bytes, location: int) -> None:
        with contextlib.suppress(OSError):
            path = self._inside(key, location)
            _unlink_quiet(path)
            self._remove_empty({os.path.dirname(path)})

    def _remove_dead_temps(self) -> None:
        """Delete temp files of writers that no longer run (a killed writer's leftovers): of
        this pid scope, once their pid is gone; of another (a container sharing the store,
        whose pids mean nothing here), once older than the orphan grace period."""
        for f in os.scandir(self._tmp):
            parts = f.name.split("-", 2)
            try:
                if len(parts) == 3 and parts[0] == _TEMP_SCOPE and parts[1].isdigit():
                    gone = not pid_alive(int(parts[1]))
                else:
                    gone = time.time() - f.stat().st_mtime > ORPHAN_GRACE_S
                if gone:
                    os.unlink(f.path)
            except FileNotFoundError:
                pass

    # -- writes --------------------------------------------------------------------------
    def write_many(self, items: list[PutItem], locations: list[int]) -> list[BaseException | None]:
        if not items:
            return []
        with self._write_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="kvtier-aio")
            records = [_in_place(it) for it in items]
            free = self._staging_buffers([it for it, rec in zip(items, records, strict=True) if rec is None])
            # Each record whole (its temp file written, synced, renamed into place) in one
            # call on the pool, and this thread wakes once, for the batch: every wake-up of
            # a thread takes the GIL, which a serving process's model thread then waits for
            # (hook_host_bench.py --writer).
            futures = [self._on_pool(FilePayloads._write_record, [self, it, loc, rec, free])
                       for it, loc, rec in zip(items, locations, records, strict=True)]
            wait_futures(futures)
            errors: list[BaseException | None] = []
            changed: set[str] = set()  # directories that gained an entry
            for fut in futures:
                exc = fut.exception()
                if exc is not None:
                    _forget_frames(exc)
                    errors.append(exc)
                else:
                    changed |= fut.result()
                    errors.append(None)
            if self.durability == "power" and changed:  # file data was fsynced before the rename
                try:
                    self._fsync_dirs(changed)
                except OSError as exc:  # nothing of this batch is known durable
                    for it, loc, err in zip(items, locations, errors, strict=True):
                        if err is None:
                            _unlink_quiet(self._record_path(it.key, loc))
                    return [exc] * len(items)
        return errors

    def _staging_buffers(self, staged: list[PutItem]) -> queue.SimpleQueue[mmap.mmap]:
        """The staging buffers for the records ``staged`` (those not assembled in place),
        one per concurrent O_DIRECT writer: at most io_threads of them are in flight, each
        filling and writing its buffer segment by segment."""
        free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        if staged:
            need = min(_round_up(max(it.size for it in staged)), _STAGE_BYTES)
            while len(self._stage) < min(self.io_threads, len(staged)):
                self._stage.append(anonymous_map(need))
            for i, b in enumerate(self._stage):
                if len(b) < need:  # grown records: replace (the old buffer is not in use now)
                    self._stage[i] = b = anonymous_map(need)
                free.put(b)
        return free

    def _write_record(self, it: PutItem, location: int, record: memoryview | None,
                      free: queue.SimpleQueue[mmap.mmap]) -> set[str]:
        """On a pool thread: write ``it`` to a temp file, with O_DIRECT from ``record`` (the
        record in place, see ``_in_place``) or through a staging buffer from ``free``,
        buffered if the filesystem refuses O_DIRECT; then rename it into place. The
        directories that gained an entry."""
        # unique (pid scope and pid first: _remove_dead_temps judges a temp by them)
        tmp = f"{self._data_dir}/tmp/{_TEMP_SCOPE}-{os.getpid()}-{next(_TEMP_SEQ)}-{it.key.hex()[:16]}.tmp"
        try:
            written = False
            if self._direct_write is not False:
                if record is not None:
                    written = self._write_direct(tmp, it, record, in_place=True)
                else:
                    buf = free.get()
                    try:
                        written = self._write_direct(tmp, it, buf)
                    finally:
                        free.put(buf)
            if not written:
                _write_file_buffered(tmp, it, self.durability == "power")
            return self._place(tmp, it.key, location)
        except BaseException:
            _unlink_quiet(tmp)
            raise

    def _on_pool(self, fn: Callable[..., T], args: list[object]) -> Future[T]:
        """``fn(*args)`` on the I/O pool, holding no reference to ``args`` once it returns.
        A pool thread deletes its work item (and the arguments in it) only after setting
        the result, so a chunk's buffer passed as a plain argument could outlive the batch
        by a moment on a busy machine, and a save right after ``flush`` found the pool full
        (a dropped save). ``fn`` itself stays in the work item: never pass a bound method
        of something that holds a chunk."""
        assert self._pool is not None
        try:
            return self._pool.submit(_call_and_drop, fn, args)
        except RuntimeError:  # the pool takes no work (the interpreter is exiting): here, then
            fut: Future[T] = Future()
            try:
                fut.set_result(_call_and_drop(fn, args))
            except Exception as exc:
                fut.set_exception(exc)
            return fut

    def _write_direct(self, tmp: str, it: PutItem, buf: mmap.mmap | memoryview, *,
                      in_place: bool = False) -> bool:
        """Write the record with O_DIRECT, through the staging buffer ``buf``, or straight
        from ``buf`` when it is the record itself (``in_place``); False if the filesystem
        refuses O_DIRECT."""
        try:
            _write_file_direct(tmp, buf, it.size, self.durability == "power", None if in_place else it)
        except OSError as exc:
            if exc.errno != errno.EINVAL or self._direct_write:
                raise
            self._direct_write = False  # never worked here: buffered from now on
            _unlink_quiet(tmp)
            _forget_frames(exc)
            return False
        self._direct_write = True
        return True

    def _place(self, tmp: str, key: bytes, location: int) -> set[str]:
        """Rename a written temp file to its record path, creating the shard directories;
        the directories that gained an entry. Another process removes a shard directory it
        emptied (see :meth:`_remove_empty`), possibly between its creation here and the
        rename: then it is created again."""
        for _ in range(2):
            try:
                return self._rename_into(tmp, key, location)
            except FileNotFoundError:
                if not os.path.exists(tmp):  # (the temp file itself is gone: nothing to place)
                    raise
        return self._rename_into(tmp, key, location)

    def _rename_into(self, tmp: str, key: bytes, location: int) -> set[str]:
        path = self._record_path(key, location)
        changed = self._shard_dirs(path, create=True)
        os.replace(tmp, path)
        return changed | {os.path.dirname(path)}

    def _remove_empty(self, shards: set[str]) -> None:
        """Remove shard directories that removals emptied, and their parent level if that
        emptied too: else their number only grows, to 65,792 (about 257 MiB on ext4, counted
        by no budget), whatever the store holds. ``rmdir`` removes only an empty directory."""
        for shard in shards:
            for d in (shard, os.path.dirname(shard)):  # (two levels below the data directory)
                try:
                    os.rmdir(d)
                except OSError:  # not empty (a record, or a writer's), or gone already
                    break

    def _shard_dirs(self, record: str, *, create: bool) -> set[str]:
        """Check the two shard levels kvtier made for ``record`` with one ``lstat`` each (each
        system call takes the GIL again on the way out), refusing a link (see
        :meth:`_inside`); with ``create``, make those missing, owner-only
        (``mkdir(parents=True)`` would give the parent default permissions), else a missing
        one raises ``FileNotFoundError``. The directories that gained an entry."""
        changed: set[str] = set()
        shard = os.path.dirname(record)
        for d in (os.path.dirname(shard), shard):
            try:
                _refuse_link(d, os.lstat(d), record)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(d, 0o700)
                    changed.add(os.path.dirname(d))
                except FileExistsError:  # (another writer made it meanwhile)
                    _refuse_link(d, os.lstat(d), record)
        return changed

    def _fsync_dirs(self, dirs: set[str]) -> None:
        for d in dirs:
            fsync_path(d)

    def delete(self, entries: list[EntryInfo]) -> list[EntryInfo]:
        kept = []
        emptied: set[str] = set()
        for e in entries:
            try:
                path = self._inside(e.key, e.location)
                os.unlink(path)
                emptied.add(os.path.dirname(path))
            except FileNotFoundError:
                pass
            except OSError:
                kept.append(e)
        self._remove_empty(emptied)
        return kept

    # -- reads ---------------------------------------------------------------------------
    def read(self, entry: EntryInfo, fn: Callable[[memoryview], T]) -> T | None:
        try:
            fd = open_regular_file(self._inside(entry.key, entry.location))
        except FileNotFoundError:
            return None  # evicted by another process after the index was read: a miss
        try:
            size = os.fstat(fd).st_size
            if size > self.max_record_bytes:  # never size a buffer by it
                head = self._buf.get(MAX_HEADER_BYTES)
                raise oversized(head[: _read_full(fd, head)], size, self.max_record_bytes)
            view = self._buf.get(size)
            got = _read_full(fd, view)
        finally:
            os.close(fd)
        return fn(view[:got])

    def read_record(self, entry: EntryInfo, fn: Callable[[RecordReader], T]) -> T | None:
        """The record through a reader on its open file: the payload is read straight into
        the caller's buffer (one copy out of the page cache), not staged first."""
        try:
            path = self._inside(entry.key, entry.location)  # (its shard levels may be gone too)
            fd = open_regular_file(path)
        except FileNotFoundError:
            return None  # evicted by another process after the index was read: a miss
        try:
            if self.direct_reads:  # the header's read must not read ahead what O_DIRECT will read
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            return fn(_FileReader(fd, self._buf, self.max_record_bytes, self, path))
        finally:
            os.close(fd)

    def read_head(self, entry: EntryInfo, n: int) -> tuple[bytes, int] | None:
        try:
            with open(self._inside(entry.key, entry.location), "rb", buffering=0,
                      opener=lambda p, f: open_regular_file(p)) as f:
                return f.read(n), os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def scan_shard(path: str) -> list[os.DirEntry[str]]:
    """A record directory's entries; none if another process removed it (it was empty:
    see FilePayloads._remove_empty)."""
    try:
        with os.scandir(path) as it:
            return list(it)
    except FileNotFoundError:
        return []


def _parse_name(name: str) -> tuple[bytes, int] | None:
    if not name.endswith(SUFFIX):
        return None
    parts = name[: -len(SUFFIX)].split(".")
    if len(parts) != 2 or len(parts[0]) != 64 or len(parts[1]) != 16:
        return None
    try:
        return bytes.fromhex(parts[0]), int(parts[1], 16)
    except ValueError:
        return None


def _in_place(it: PutItem) -> memoryview | None:
    """The record's own buffer, if it can be written with O_DIRECT as it is (see
    ``PutItem.record``): page-aligned, in whole pages, covering the record."""
    rec = it.record
    if (rec is None or len(rec) % _ALIGN or len(rec) < it.size
            or np.frombuffer(rec, dtype=np.uint8).ctypes.data % _ALIGN):
        return None
    return rec


def _refuse_link(d: str, st: os.stat_result, record: str) -> None:
    """Refuse a record whose directory ``d`` (as ``lstat`` saw it) is a link."""
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, "a directory of the record is a link out of the store", record)


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _call_and_drop(fn: Callable[..., T], args: list[object]) -> T:
    """Call ``fn`` with ``args``, emptying the list first: the caller's list (which the pool's
    work item holds) keeps no reference past the call (see ``FilePayloads._on_pool``)."""
    taken = args[:]
    args.clear()
    return fn(*taken)


def _open_temp(path: str, direct: bool) -> io.FileIO:
    """A new temp file, owner-only, unbuffered (``O_DIRECT`` if ``direct``)."""
    extra = os.O_DIRECT if direct else 0
    return io.FileIO(path, "wb", opener=lambda p, flags: os.open(p, flags | extra, 0o600))


def _forget_frames(exc: BaseException) -> None:
    """Drop the tracebacks of a failed write's error and of the errors it chains: their
    frames hold the chunk's buffer, which the error (kept in a result, in a log record)
    would otherwise keep out of the pool."""
    todo: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += [e.__cause__, e.__context__]


def _write_view(f: io.FileIO, buf: mmap.mmap | memoryview, start: int, n: int) -> int:
    """One ``write(2)`` of ``buf[start:start + n]`` (page-aligned, for ``O_DIRECT``)."""
    return f.write(memoryview(buf)[start : start + n]) or 0


def _write_file_direct(path: str, buf: mmap.mmap | memoryview, total: int, sync: bool,
                       staged: PutItem | None) -> None:
    """Write a record of ``total`` bytes to a new file at ``path`` with ``O_DIRECT``, from
    ``buf``: the record itself, assembled in place in its page-aligned buffer (at least
    ``total`` bytes rounded up to a page), or, with ``staged`` (the record's item), a
    staging buffer each segment of it is copied into first. The record in place in one
    write(2) (up to ``_DIRECT_WRITE_BYTES``), a staged one segment by segment (a raw FileIO:
    each write() is one write(2) of the aligned view), then the page padding cut off and the
    file synced if ``sync``. Runs on a pool thread (see ``FilePayloads._write_record``).
    (:func:`_write_file_buffered` likewise, where the filesystem refuses O_DIRECT.)"""
    if staged is None:  # (the padding goes to disk, then is cut)
        np.frombuffer(buf, dtype=np.uint8)[total:] = 0
    f = _open_temp(path, True)
    try:
        pos = 0
        while pos < total:
            if staged is None:
                n = min(_DIRECT_WRITE_BYTES, total - pos)
                start, m = pos, _round_up(n)
            else:  # (numpy lets go of the GIL while it copies)
                n = min(len(buf), total - pos)
                start, m = 0, _stage_segment(buf, staged, pos, n)
            if _write_view(f, buf, start, m) != m:
                # a regular file's write falls short when the file system fills
                raise OSError(errno.ENOSPC, f"No space left on device (a short O_DIRECT write to {path})")
            pos += n
        if _round_up(total) != total:  # drop the padding: the file is exactly the record
            os.ftruncate(f.fileno(), total)
        if sync:
            os.fdatasync(f.fileno())
    finally:
        f.close()


def _write_file_buffered(path: str, it: PutItem, sync: bool) -> None:
    """Write a record to a new file at ``path`` without ``O_DIRECT`` (a filesystem that
    refuses it), synced if ``sync``."""
    f = _open_temp(path, False)
    try:
        for part in (it.header, it.payload):
            _write_all(f, part)
        if sync:
            os.fdatasync(f.fileno())
    finally:
        f.close()


def _write_all(f: io.FileIO, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = f.write(view)
        if not n:
            raise OSError(errno.EIO, f"write to {f.name} made no progress")
        view = view[n:]


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


def _read_full(fd: int, view: memoryview | Sequence[memoryview], offset: int = 0) -> int:
    """Read from ``offset`` until ``view`` (or each of several views, back to back: one
    scattered read) is full or EOF; return the bytes read."""
    views = [v for v in ([view] if isinstance(view, memoryview) else view) if len(v)]
    got = 0
    while views:
        n = os.preadv(fd, views, offset + got)
        if n == 0:
            break
        got += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if n:
            views[0] = views[0][n:]
    return got


class _FileReader:
    """A :class:`~kvtier.codec.RecordReader` on an open record file."""

    def __init__(self, fd: int, buf: ThreadBuffer, max_record_bytes: int,
                 owner: FilePayloads | None = None, path: str = "") -> None:
        self.fd = fd
        self.size = os.fstat(fd).st_size
        self._buf = buf
        self._owner = owner
        self._path = path
        head = bytearray(min(self.size, MAX_HEADER_BYTES))
        self.head = memoryview(head)[: _read_full(fd, memoryview(head))]
        if self.size > max_record_bytes:  # never size a buffer by it
            raise oversized(self.head, self.size, max_record_bytes)

    def fill(self, dst: memoryview, offset: int) -> None:
        if _read_full(self.fd, dst, offset) != len(dst):
            raise RecordError(f"record file ends before byte {offset + len(dst)} (truncated?)")

    def fill_runs(self, runs: Sequence[memoryview], offset: int) -> None:
        # one preadv for all: the kernel sees one large sequential read, as for a whole record
        want = sum(len(r) for r in runs)
        if _read_full(self.fd, runs, offset) != want:
            raise RecordError(f"record file ends before byte {offset + want} (truncated?)")

    def whole(self) -> memoryview:
        view = self._buf.get(self.size)
        return view[: _read_full(self.fd, view)]

    def fill_record(self, region: memoryview, offset: int) -> None:
        """A record the page cache holds whole (a prefetch warmed it) is copied from it; any
        other is read from the disk with ``O_DIRECT`` straight into ``region``, in whole
        pages: no second copy, and the page cache is not filled with chunks the host tier
        keeps anyway. Whatever that cannot read is read buffered."""
        pos = offset
        if (self._owner is not None and self._owner.direct_reads
                and cached_pages(self.fd, offset, self.size) < _pages(offset, self.size)):
            pos = self._read_direct(region, offset)
        if pos < self.size:
            self.fill(region[pos : self.size], pos)

    def _read_direct(self, region: memoryview, pos: int) -> int:
        """Read from the page holding ``pos`` to the end with O_DIRECT; how far it got."""
        end = _round_up(self.size)
        start = pos // _ALIGN * _ALIGN
        if len(region) < end or np.frombuffer(region, dtype=np.uint8).ctypes.data % _ALIGN:
            return pos
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_DIRECT | os.O_NOFOLLOW)
        except OSError as exc:
            if exc.errno == errno.EINVAL and self._owner is not None:
                self._owner.direct_reads = False  # not on this filesystem: buffered from now on
            return pos
        got = start
        try:
            while got < self.size:
                n = os.preadv(fd, [region[got:end]], got)
                if n <= 0:
                    break
                got += n
        except OSError as exc:  # (e.g. EINVAL after a short read left an unaligned offset)
            if exc.errno != errno.EINVAL:
                raise
        finally:
            os.close(fd)
        return min(got, self.size)


def _pages(start: int, end: int) -> int:
    return max(0, _round_up(end) - start // _ALIGN * _ALIGN) // _ALIGN


def cached_pages(fd: int, start: int, end: int) -> int:
    """How many of the pages holding bytes ``[start, end)`` of the file the page cache holds
    (``mincore`` on a mapping of them: no read, no readahead); 0 where that cannot be asked."""
    first = start // _ALIGN * _ALIGN
    length = _round_up(end) - first
    if length <= 0 or _LIBC is None:
        return 0
    addr = _LIBC.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, first)
    if addr in (None, ctypes.c_void_p(-1).value):
        return 0
    try:
        vec = (ctypes.c_ubyte * (length // _ALIGN))()
        if _LIBC.mincore(ctypes.c_void_p(addr), length, vec) != 0:
            return 0
        return int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
    finally:
        _LIBC.munmap(ctypes.c_void_p(addr), length)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def _unlink_quiet(path: str) -> None:
    with contextlib.suppress(OSError):  # gone already, or it will be found by the orphan sweep
        os.unlink(path)
