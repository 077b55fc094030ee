"""Check an LMDB environment's pages in a helper process before this process trusts them.

LMDB does not checksum its pages. A damaged page usually makes an operation fail with
``MDB_CORRUPTED``, but it can also send LMDB's C code through a bad pointer and kill the
process that reads it (the reliability harness saw it: 3 of 800 damaged-page probes). For a
vLLM worker that would be the server. So the first time a process opens an environment that
already exists, a short-lived helper process walks it first: every named database, every
key and value read in order, and every key searched again from the root (which exercises
the branch pages a lookup uses). Then it walks LMDB's free-page list, which only a writer
reads and py-lmdb cannot open, by parsing its pages (:func:`check_free_list`). If the helper
dies, hangs or finds damage, the environment is damaged and the caller refuses it
(``StoreDamaged``) instead of crashing.

This file is also the helper, run as a script in isolated mode (this directory, whose
``lmdb.py`` would shadow py-lmdb, stays off ``sys.path``). It imports only the standard
library and ``lmdb``, so the check costs an interpreter start and the walk.

Not covered: a free-list entry that names a page still in use (well-formed, so only a walk
of every tree's pages could tell), and damage done while processes have the environment open.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import lmdb

log = logging.getLogger("kvtier")
# Exit status of the helper when LMDB itself reported the damage (its message on stderr).
_DAMAGED = 3
_READ_WHOLE = 64 << 10
# Results of successful checks in this process: (pid, path) -> the data file's identity.
_CHECKED: dict[tuple[int, str], tuple[int, int, int]] = {}
_CHECKED_LOCK = threading.Lock()


# What the OS reports when a store's files are fine but cannot be used now: never damage.
# (Not ENOMEM in general: a damaged meta page makes LMDB map an impossible size and fail with
# it. Only under an address-space limit, see _address_space_limit.)
# Free space below which an I/O error while writing is taken for a full disk (see not_damage).
NEARLY_FULL_BYTES = 64 << 20
_NOT_DAMAGE = {errno.ENOSPC: "full", errno.EDQUOT: "full", errno.EACCES: "access", errno.EPERM: "access",
               errno.EROFS: "read-only"}


def _address_space_limit() -> int | None:
    """This process's address-space limit (``ulimit -v``), if one is set. LMDB maps a whole
    environment, so under a limit a healthy store can fail to open with ENOMEM."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


def _reports(exc: BaseException, code: int) -> bool:
    """Whether ``exc`` is the OS error ``code``: an ``OSError``, or an ``lmdb.Error`` naming
    it (py-lmdb reports most OS errors as a plain ``lmdb.Error`` with the OS's message)."""
    if isinstance(exc, OSError):
        return exc.errno == code
    return isinstance(exc, lmdb.Error) and os.strerror(code) in str(exc)


def not_damage(exc: BaseException, where: Path | None = None) -> str | None:
    """What an error opening or writing an LMDB environment says about the system rather
    than about its files: ``"full"``, ``"access"``, ``"read-only"`` or ``"address-space"``;
    None for anything else (py-lmdb reports most OS errors as a plain ``lmdb.Error`` naming
    them). With ``where`` (the store), an I/O error on a file system that is all but full is
    "full": LMDB reports a write the full disk cut short as EIO, not ENOSPC."""
    if isinstance(exc, lmdb.DiskError | lmdb.MapFullError):
        return "full"
    if where is not None and _reports(exc, errno.EIO) and _nearly_full(where):
        return "full"
    if ((isinstance(exc, lmdb.MemoryError | MemoryError) or _reports(exc, errno.ENOMEM))
            and _address_space_limit() is not None):
        return "address-space"
    if isinstance(exc, lmdb.ReadonlyError):
        return "access"
    return next((kind for code, kind in _NOT_DAMAGE.items() if _reports(exc, code)), None)


def full_cause(exc: BaseException, where: Path | None = None) -> BaseException | None:
    """The error in ``exc``'s chain (itself, or what it was raised from or during) that
    says the file system is full (see :func:`not_damage`); None if none does."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if not_damage(cause, where) == "full":
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _nearly_full(where: Path) -> bool:
    """Whether the file system holding ``where`` (or its nearest existing parent) has less
    free space than LMDB may write in one commit."""
    for p in (where, *where.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize < NEARLY_FULL_BYTES
    return False


def unusable_store(path: Path, exc: BaseException) -> Exception:
    """The error for an LMDB failure at ``path``: what to do about a full disk, missing
    permissions or memory, else :func:`damaged_store`."""
    from kvtier.errors import StoreError, StoreFull

    kind = not_damage(exc, path)
    what = f"{type(exc).__name__}: {exc}"
    if kind == "full":
        return StoreFull(f"{path}: no space left on the store's file system ({what}); free space "
                         "(or lower disk_bytes), then retry")
    if kind == "address-space":
        return StoreError(f"{path}: the store's LMDB files cannot be mapped under this process's "
                          f"address-space limit (ulimit -v: {_address_space_limit()} bytes; {what}); LMDB "
                          "maps each environment whole (an lmdb store's records: up to disk_bytes): "
                          "raise or remove the limit, or use a store on the files backend")
    if kind == "read-only":
        return StoreError(f"{path}: the store's file system is mounted read-only ({what}); remount it "
                          "read-write, or open the store read-only (readonly=True: loads and lookups only)")
    if kind == "access":
        return StoreError(f"{path}: the store's files cannot be opened for what this process needs "
                          f"({what}); LMDB needs write access to its lock files even to read: run as "
                          "the store's owner, or grant write access to the store's directory")
    return damaged_store(path, what)


def damaged_store(path: Path, reason: str) -> Exception:
    """The error for an LMDB environment (or its store) that cannot be trusted or opened."""
    from kvtier.errors import StoreDamaged  # (not at the top: the helper runs without kvtier)

    return StoreDamaged(f"{path}: the store's LMDB database is damaged or unreadable ({reason}); if its "
                        "files are damaged, move the store directory away or delete it (the cache "
                        "refills itself); if they are not readable, check their permissions")


def _file_identity(data: Path) -> tuple[int, int, int]:
    st = data.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns


def _timeout_s(data: Path) -> float:
    # generous: a slow disk must not make an intact store look damaged (reading 32 MiB/s)
    return 60.0 + data.stat().st_size / (32 << 20)


def damage_report(path: Path, *, preread: bool = False) -> str | None:
    """Why the LMDB environment at ``path`` cannot be trusted, or None if its pages read
    back sound (or it does not exist yet). A result is remembered while the data file is
    unchanged, so a process pays for one check per environment.

    ``preread``: read the data file front to back before the walk (for an index, whose pages
    the walk would otherwise fault in 4 KiB at a time from a cold disk, and which lookups
    want in the page cache anyway); not for payloads, of which the walk reads little."""
    data = path / "data.mdb"
    try:
        ident = _file_identity(data)
    except OSError:  # not created yet, or unreadable: opening it reports that
        return None
    key = (os.getpid(), str(path))
    with _CHECKED_LOCK:
        if _CHECKED.get(key) == ident:
            return None
    timeout = _timeout_s(data)
    try:
        proc = subprocess.run(_helper_command(path, preread), stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"checking its pages did not finish in {timeout:.0f} s"
    except OSError as exc:  # no interpreter to run (an embedded Python): open unchecked
        log.warning("kvtier: cannot check the pages of %s (%s); opening it unchecked", path, exc)
        return None
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        return f"reading its pages crashed the checking process ({name})"
    said = (proc.stderr.decode(errors="replace").strip().splitlines() or [""])[-1]
    if proc.returncode == _DAMAGED:
        return said or "LMDB reported damage"
    if proc.returncode != 0:  # the helper could not run (not the store's fault): open as before
        log.warning("kvtier: cannot check the pages of %s (the helper exited with %d: %s); opening it "
                    "unchecked", path, proc.returncode, said)
        return None
    with _CHECKED_LOCK:
        _CHECKED[key] = ident
    return None


def _helper_command(path: Path, preread: bool) -> list[str]:
    # isolated (-I: no environment variables, no current directory on sys.path), with the
    # directory this process imported py-lmdb from, so the helper finds the same one
    boot = "import sys, runpy; sys.path.insert(0, sys.argv[1]); runpy.run_path(sys.argv[2], run_name='__main__')"
    return [sys.executable, "-I", "-c", boot, str(Path(lmdb.__file__).resolve().parent.parent),
            str(Path(__file__).resolve()), *(["--preread"] if preread else []), str(path)]


def _preread(data: str) -> None:
    buf = bytearray(8 << 20)
    with open(data, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def _open_db(env: lmdb.Environment, txn: lmdb.Transaction, name: bytes) -> object:
    try:
        return env.open_db(name, txn=txn, create=False)
    except lmdb.IncompatibleError:  # a dupsort database must be opened as one
        return env.open_db(name, txn=txn, create=False, dupsort=True)


def walk(path: str) -> int:
    """Read every page a reader can reach, then check the free list (in the helper process);
    the number of rows."""
    env = lmdb.open(path, readonly=True, lock=True, max_dbs=64, subdir=True, readahead=False,
                    map_size=0)
    rows = 0
    try:
        for _ in range(5):  # (other processes may be committing: catch a meta page of ours)
            with env.begin() as txn:
                if check_free_list(os.path.join(path, "data.mdb"), txn.id()) is not None:
                    break
        with env.begin(buffers=True) as txn:
            names = [bytes(k) for k in txn.cursor().iternext(values=False)]
            for name in names:
                db = _open_db(env, txn, name)
                dupsort = bool(db.flags(txn)["dupsort"])  # type: ignore[attr-defined]
                order, search = txn.cursor(db), txn.cursor(db)
                for k, v in order.iternext(keys=True, values=True):
                    bytes(k)
                    # a damaged length sends a reader past the map: read small values whole,
                    # the first and last byte of large ones (payloads: not gigabytes)
                    if len(v) <= _READ_WHOLE:
                        bytes(v)
                    else:
                        v[0], v[-1]  # noqa: B018
                    found = search.set_key_dup(k, v) if dupsort else search.set_key(k)
                    if not found:
                        raise lmdb.CorruptedError(f"{name!r}: a key read in order is not found by a search")
                    rows += 1
    finally:
        env.close()
    return rows


# LMDB's on-disk layout (lmdb.h / mdb.c, 64-bit builds), as far as the free list needs it.
_MAGIC = 0xBEEFC0DE
_PAGE_HEAD = 16  # mp_pgno (u64), mp_pad, mp_flags, mp_lower, mp_upper (u16 each)
_META = _PAGE_HEAD  # MDB_meta: magic, version (u32), address, mapsize (u64), dbs[2], last_pg, txnid
_DB = struct.Struct("<IHHQQQQQ")  # MDB_db: pad (a meta's page size), flags, depth, 3 page counts, entries, root
_NODE = struct.Struct("<HHHH")  # MDB_node: data size lo, hi (a branch: the child's page), flags, key size
_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_P_TRANSIENT = 0x10 | 0x4000 | 0x8000  # P_DIRTY, P_LOOSE, P_KEEP: may be left set, mean nothing here
_F_BIGDATA = 0x01  # a leaf's value lives in overflow pages
_NO_ROOT = (1 << 64) - 1


def check_free_list(data: str, txnid: int) -> int | None:
    """Check LMDB's free-page list in ``data`` (a ``data.mdb``) the way a writer will read it,
    as of transaction ``txnid``, which the caller holds open as a reader so that no writer
    reuses its pages meanwhile; the number of free pages listed, or None if neither meta
    page describes that transaction any more (two commits since: try again). Raises
    ``lmdb.CorruptedError`` naming what is wrong.

    Only a writer reads the free list (to reuse pages, and at each commit), and LMDB trusts
    it: a damaged node offset or page count sends the writer past its map (the reliability
    harness saw SIGBUS). py-lmdb cannot open this database, so its pages are parsed here:
    every page's number, kind and bounds, every node inside its page, every record an ID
    list whose count fits its size, sorted as LMDB writes it, naming pages the file has,
    and the totals the meta page records. (Not checked: that no page is listed twice or is
    still in use, which would take a walk of every tree's pages.)"""
    if struct.calcsize("P") != 8:  # (a 32-bit build has another layout; nothing checked)
        return 0
    with open(data, "rb", buffering=0) as f:
        fd = f.fileno()
        head = os.pread(fd, _PAGE_HEAD + 160, 0)
        if len(head) < _META + 40 or struct.unpack_from("<I", head, _META)[0] != _MAGIC:
            return 0  # not a meta page LMDB would open: its own open says why
        psize = _DB.unpack_from(head, _META + 24)[0]
        if psize < 512 or psize & (psize - 1) or psize > 1 << 16:
            raise lmdb.CorruptedError(f"free list: the meta page names a page size of {psize}")
        meta = next((m for m in (os.pread(fd, _PAGE_HEAD + 160, n * psize) for n in (0, 1))
                     if len(m) == _PAGE_HEAD + 160 and struct.unpack_from("<I", m, _META)[0] == _MAGIC
                     and struct.unpack_from("<Q", m, _META + 128)[0] == txnid), None)
        if meta is None:
            return None
        _, _, depth, *pages_and_entries, root = _DB.unpack_from(meta, _META + 24)
        last_pg = struct.unpack_from("<Q", meta, _META + 120)[0]
        return _FreeListWalk(fd, psize, last_pg, txnid).walk(root, depth, tuple(pages_and_entries))


class _FreeListWalk:
    """One walk of the free-list B-tree (see :func:`check_free_list`)."""

    def __init__(self, fd: int, psize: int, last_pg: int, txnid: int) -> None:
        self.fd, self.psize, self.last_pg, self.txnid = fd, psize, last_pg, txnid
        self.seen: set[int] = set()  # pages of the tree itself
        self.free = 0  # page numbers it lists
        self.counts = [0, 0, 0, 0]  # branch, leaf and overflow pages, entries (as MDB_db)
        self.last_key = 0

    def bad(self, what: str) -> lmdb.CorruptedError:
        return lmdb.CorruptedError(f"free list: {what}")

    def page(self, pgno: int, pages: int = 1) -> bytes:
        if pgno < 2 or pgno + pages - 1 > self.last_pg:
            raise self.bad(f"page {pgno} (+{pages}) is outside the file's pages 2..{self.last_pg}")
        if any(p in self.seen for p in range(pgno, pgno + pages)):
            raise self.bad(f"page {pgno} is reached twice")
        self.seen.update(range(pgno, pgno + pages))
        buf = os.pread(self.fd, pages * self.psize, pgno * self.psize)
        if len(buf) < pages * self.psize:
            raise self.bad(f"page {pgno} (+{pages}) is past the file's end")
        if struct.unpack_from("<Q", buf)[0] != pgno:
            raise self.bad(f"page {pgno} says it is page {struct.unpack_from('<Q', buf)[0]}")
        return buf

    def walk(self, root: int, depth: int, want: tuple[int, ...]) -> int:
        if root != _NO_ROOT:
            if not 1 <= depth <= 32:
                raise self.bad(f"a depth of {depth}")
            self.tree(root, depth)
        if tuple(self.counts) != want:
            raise self.bad(f"(branch, leaf, overflow pages, entries) = {tuple(self.counts)}, the meta page "
                           f"says {want}")
        return self.free

    def tree(self, pgno: int, depth: int) -> None:
        buf = self.page(pgno)
        _, _, flags, lower, upper = struct.unpack_from("<QHHHH", buf)
        kind = flags & ~_P_TRANSIENT
        if kind != (_P_LEAF if depth == 1 else _P_BRANCH):
            raise self.bad(f"page {pgno} has flags {flags:#x} at depth {depth}")
        if not _PAGE_HEAD <= lower <= upper <= self.psize or lower % 2 or lower == _PAGE_HEAD:
            raise self.bad(f"page {pgno}: node table bounds {lower}..{upper}")
        self.counts[0 if depth > 1 else 1] += 1
        for ptr in struct.unpack_from(f"<{(lower - _PAGE_HEAD) // 2}H", buf, _PAGE_HEAD):
            if not upper <= ptr <= self.psize - _NODE.size or ptr % 2:
                raise self.bad(f"page {pgno}: a node at offset {ptr}, outside {upper}..{self.psize}")
            lo, hi, nflags, ksize = _NODE.unpack_from(buf, ptr)
            body = ptr + _NODE.size
            if body + ksize > self.psize or (ksize != 8 and not (depth > 1 and ksize == 0)):
                raise self.bad(f"page {pgno}: a key of {ksize} bytes (transaction ids have 8)")
            if depth > 1:
                self.tree(lo | hi << 16 | nflags << 32, depth - 1)
            else:
                self.record(pgno, buf, body, ksize, lo | hi << 16, nflags)

    def record(self, pgno: int, buf: bytes, body: int, ksize: int, size: int, flags: int) -> None:
        key = struct.unpack_from("<Q", buf, body)[0]
        if not self.last_key < key <= self.txnid:
            raise self.bad(f"page {pgno}: transaction {key} after {self.last_key} (the last is {self.txnid})")
        self.last_key = key
        self.counts[3] += 1
        at = body + ksize
        if flags & _F_BIGDATA:
            if at + 8 > self.psize:
                raise self.bad(f"page {pgno}: an overflow page number past the page's end")
            first = struct.unpack_from("<Q", buf, at)[0]
            head = os.pread(self.fd, _PAGE_HEAD, first * self.psize) if first <= self.last_pg else b""
            kind, pages = struct.unpack_from("<HI", head, 10) if len(head) == _PAGE_HEAD else (0, 0)
            if kind & ~_P_TRANSIENT != _P_OVERFLOW or pages * self.psize - _PAGE_HEAD < size:
                raise self.bad(f"page {first}: no run of overflow pages holding {size} bytes")
            self.counts[2] += pages
            value, at = self.page(first, pages), _PAGE_HEAD
        else:
            value = buf
            if at + size > self.psize:
                raise self.bad(f"page {pgno}: a {size}-byte record past the page's end")
        if size < 8 or size % 8:
            raise self.bad(f"page {pgno}: a record of {size} bytes is no list of page numbers")
        ids = memoryview(value)[at : at + size].cast("Q")[1:]
        if struct.unpack_from("<Q", value, at)[0] != len(ids):
            raise self.bad(f"page {pgno}: a record of {len(ids)} page numbers says it has "
                           f"{struct.unpack_from('<Q', value, at)[0]}")
        # LMDB writes each list sorted, descending (checked a slice at a time: lists can
        # name millions of pages)
        step = 1 << 20
        for i in range(0, len(ids), step):
            part = ids[i : i + step + 1].tolist()
            if part != sorted(part, reverse=True):
                raise self.bad(f"page {pgno}: free page numbers out of order")
        if ids and not (ids[0] <= self.last_pg and ids[-1] >= 2):
            raise self.bad(f"page {pgno}: free page numbers outside 2..{self.last_pg}")
        self.free += len(ids)


def _main(argv: list[str]) -> int:
    try:
        if "--preread" in argv:
            _preread(os.path.join(argv[-1], "data.mdb"))
        walk(argv[-1])
    except lmdb.Error as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        # a full disk or missing permissions say nothing about the pages: not checked
        return 1 if not_damage(exc) else _DAMAGED
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
