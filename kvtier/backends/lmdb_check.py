"""Check an LMDB environment's pages in a helper process before this process trusts them.

LMDB does not checksum its pages. A damaged page usually makes an operation fail with
``MDB_CORRUPTED``, but it can also send LMDB's C code through a bad pointer and kill the
process that uses it (the reliability harness saw readers and writers die). For a vLLM
worker that would be the server. So the first time a process opens an environment that
already exists, a short-lived helper process walks it first, twice:

- through py-lmdb, as a reader: every named database, every key and value read in order,
  and every key searched again from the root (the branch pages a lookup uses);
- by parsing the pages itself (:func:`check_structure`), for what a writer trusts and a
  reader never looks at: the layout of every page's nodes, the free-page list (which
  py-lmdb cannot open), overflow runs, the inline pages of sorted duplicates, the totals
  the meta page records, and that no page is both free and in use.

If the helper dies, hangs or finds damage, the environment is damaged and the caller
refuses it (``StoreDamaged``) instead of crashing.

This file is also the helper, run as a script in isolated mode (this directory, whose
``lmdb.py`` would shadow py-lmdb, stays off ``sys.path``). It imports only the standard
library, ``lmdb`` and ``numpy``, so the check costs an interpreter start and the walks.

Not covered: damage done while processes have the environment open.
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
import numpy as np

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
    key = (os.getpid(), os.path.abspath(path))  # (a store named relatively and absolutely: one check)
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
    # directories this process imported py-lmdb and numpy from, so the helper finds the same
    where = dict.fromkeys(str(Path(m.__file__).resolve().parent.parent) for m in (lmdb, np))  # type: ignore[arg-type]
    boot = ("import os, sys, runpy; sys.path[:0] = sys.argv[1].split(os.pathsep); "
            "runpy.run_path(sys.argv[2], run_name='__main__')")
    return [sys.executable, "-I", "-c", boot, os.pathsep.join(where), str(Path(__file__).resolve()),
            *(["--preread"] if preread else []), str(path)]


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
    """Check every page's structure (:func:`check_structure`), then read every page a reader
    can reach (in the helper process); the number of rows."""
    env = lmdb.open(path, readonly=True, lock=True, max_dbs=64, subdir=True, readahead=False,
                    map_size=0)
    rows = 0
    try:
        for _ in range(5):  # (other processes may be committing: catch a meta page of ours)
            with env.begin() as txn:
                if check_structure(os.path.join(path, "data.mdb"), txn.id()) is not None:
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


# LMDB's on-disk layout (lmdb.h / mdb.c, 64-bit builds), as far as the page structure needs it.
_MAGIC = 0xBEEFC0DE
_PAGE_HEAD = 16  # mp_pgno (u64), mp_pad, mp_flags, mp_lower, mp_upper (u16 each)
_META = _PAGE_HEAD  # MDB_meta: magic, version (u32), address, mapsize (u64), dbs[2], last_pg, txnid
_DB = struct.Struct("<IHHQQQQQ")  # MDB_db: pad (a meta's page size), flags, depth, 3 page counts, entries, root
_NODE = struct.Struct("<HHHH")  # MDB_node: data size lo, hi (a branch: the child's page), flags, key size
_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_LEAF2, _P_SUBP = 0x01, 0x02, 0x04, 0x20, 0x40
_P_DIRTY = 0x10  # never on a committed page (cleared before every write), but kept on inline pages
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04  # a leaf node's value: overflow pages, a tree, dups
_MDB_DUPSORT = 0x04
_MDB_NOT_FREE_LIST = 0x02 | 0x04 | 0x10 | 0x20 | 0x40  # flags the free list never has (REVERSEKEY, DUP*)
_MAX_KEY = 511  # MDB_MAXKEYSIZE
_NO_ROOT = (1 << 64) - 1
_NO_NODES = tuple(np.zeros(0, dtype=np.int64) for _ in range(6))  # (what _PageWalk.nodes returns)


def check_structure(data: str, txnid: int) -> int | None:
    """Check the structure of every page of the LMDB environment ``data`` (a ``data.mdb``)
    that a writer will use, as of transaction ``txnid``, which the caller holds open as a
    reader so that no writer reuses those pages meanwhile; the number of free pages listed,
    or None if neither meta page describes that transaction any more (two commits since:
    try again). Raises ``lmdb.CorruptedError`` naming what is wrong.

    Reading a damaged page can pass where writing it crashes: LMDB trusts a page's layout
    when it copies, inserts into or deletes from it, and a writer also reads the free-page
    list, which no reader (and not py-lmdb) opens. The reliability harness saw both: SIGBUS
    from a free-list node offset sent past its page, and heap corruption ("free(): invalid
    size") from a node whose key size overlapped its neighbours. So every tree is walked
    from the meta page here: every page's number, kind and bounds; its nodes must lie
    exactly end to end from ``mp_upper`` to the page's end, as LMDB keeps them; overflow
    runs, sub-databases and the inline pages of sorted duplicates likewise; free-list
    records must be lists of page numbers whose count fits their size, sorted as LMDB writes
    them and within the file, no page listed twice nor both free and in use; and the page
    and entry totals of the free list and of each database without duplicates must match
    the meta page and the database's record (mdb.c keeps them exact; a database of
    duplicates adds its sub-databases' pages into its own)."""
    if struct.calcsize("P") != 8:  # (a 32-bit build has another layout; nothing checked)
        return 0
    with open(data, "rb", buffering=0) as f:
        fd = f.fileno()
        head = os.pread(fd, _PAGE_HEAD + 160, 0)
        if _meta_txnid(head) is None:
            return 0  # not a meta page LMDB would open: its own open says why
        psize = _DB.unpack_from(head, _META + 24)[0]
        if psize < 512 or psize & (psize - 1) or psize > 1 << 16:
            raise lmdb.CorruptedError(f"page structure: the meta page names a page size of {psize}")
        metas = [head, os.pread(fd, _PAGE_HEAD + 160, psize)]
        slot = next((n for n in (0, 1) if _meta_txnid(metas[n]) == txnid), None)
        if slot is None:
            return None
        meta = metas[slot]
        if struct.unpack_from("<I", meta, _META + 4)[0] != 1:  # (LMDB 1.0's format: another layout)
            return 0
        try:
            walk = _PageWalk(fd, psize, struct.unpack_from("<Q", meta, _META + 120)[0], txnid)
            free_list = _DB.unpack_from(meta, _META + 24)
            if free_list[1] & _MDB_NOT_FREE_LIST:
                raise walk.bad(f"the free list: database flags {free_list[1]:#x}")
            walk.database("the free list", free_list, free_list=True)
            walk.database("the main database", _DB.unpack_from(meta, _META + 72))
            return walk.free_and_used()
        except lmdb.CorruptedError:
            # a commit rewriting this slot for a later transaction can be read half done
            # (the transaction id is written last): damage only if the slot reads the same
            if os.pread(fd, _PAGE_HEAD + 160, slot * psize) != meta:
                return None
            raise


def _meta_txnid(meta: bytes) -> int | None:
    """The transaction a meta page describes, or None if it is not one."""
    if len(meta) < _PAGE_HEAD + 160 or struct.unpack_from("<I", meta, _META)[0] != _MAGIC:
        return None
    return struct.unpack_from("<Q", meta, _META + 128)[0]


class _PageWalk:
    """One walk of an environment's trees (see :func:`check_structure`), a level of a tree
    at a time: the pages of a level are read together and checked as arrays (numpy), so a
    million-row index costs a few array operations per 1,024 pages, not Python per row."""

    _BATCH = 1024  # pages read and checked together

    def __init__(self, fd: int, psize: int, last_pg: int, txnid: int) -> None:
        self.fd, self.psize, self.last_pg, self.txnid = fd, psize, last_pg, txnid
        self.seen = np.zeros(last_pg + 1, dtype=bool)  # pages of the trees (overflow runs included)
        self.free_map = np.zeros(last_pg + 1, dtype=bool)  # pages the free list names
        self.last_key = 0  # (the free list's keys: transaction ids, ascending)

    def bad(self, what: str) -> lmdb.CorruptedError:
        return lmdb.CorruptedError(f"page structure: {what}")

    def pages(self, name: str, pgnos: np.ndarray) -> np.ndarray:
        """Tree pages ``pgnos`` of database ``name`` (a row of bytes each): inside the file,
        each reached once, and numbered as where they lie."""
        outside = (pgnos < 2) | (pgnos > self.last_pg)
        if outside.any():
            raise self.bad(f"{name}: page {pgnos[outside][0]} is outside the file's pages 2..{self.last_pg}")
        if self.seen[pgnos].any() or len(np.unique(pgnos)) < len(pgnos):
            twice = next(int(p) for i, p in enumerate(pgnos) if self.seen[p] or p in pgnos[:i])
            raise self.bad(f"{name}: page {twice} is reached twice")
        self.seen[pgnos] = True
        raw = b"".join(os.pread(self.fd, self.psize, int(p) * self.psize) for p in pgnos)
        if len(raw) < len(pgnos) * self.psize:
            raise self.bad(f"{name}: a page among {pgnos.tolist()[:8]}... is past the file's end")
        rows = np.frombuffer(raw, dtype=np.uint8).reshape(len(pgnos), self.psize)
        said = rows[:, :8].copy().view("<u8")[:, 0]
        if (said != pgnos).any():
            i = int(np.argmax(said != pgnos))
            raise self.bad(f"{name}: page {pgnos[i]} says it is page {said[i]}")
        return rows

    def database(self, name: str, db: tuple[int, ...], *, free_list: bool = False, dups: bool = False) -> None:
        """Walk one tree from its ``MDB_db`` record ``db`` a level at a time; ``dups``: a
        sub-database of sorted duplicates (keys only)."""
        pad, flags, depth, *want, root = db
        counts = [0, 0, 0, 0]  # branch, leaf and overflow pages, entries (as MDB_db)
        if root != _NO_ROOT:
            if not 1 <= depth <= 32:
                raise self.bad(f"{name}: a depth of {depth}")
            level = np.array([root], dtype=np.int64)
            for d in range(depth, 0, -1):
                below = []
                for at in range(0, len(level), self._BATCH):
                    below.extend(self.level(name, level[at : at + self._BATCH], d == 1, counts, free_list, dups, pad))
                level = np.concatenate(below) if below else np.zeros(0, dtype=np.int64)
        # (a database of duplicates adds its sub-databases' pages and entries into its own
        # totals: left alone)
        if not flags & _MDB_DUPSORT and not dups and counts != want:
            raise self.bad(f"{name}: (branch, leaf, overflow pages, entries) = {tuple(counts)}, its "
                           f"record says {tuple(want)}")

    def level(self, name: str, pgnos: np.ndarray, leaf: bool, counts: list[int], free_list: bool,
              dups: bool, pad: int = 0) -> list[np.ndarray]:
        """Check pages ``pgnos`` of one level; the next level's page numbers, in key order."""
        rows = self.pages(name, pgnos)
        kind = rows[:, 10:12].copy().view("<u2")[:, 0]
        if leaf and dups:  # duplicates of a fixed size: no nodes, keys packed
            fixed = kind == _P_LEAF | _P_LEAF2
            self.nodes(name, pgnos[fixed], rows[fixed], self.psize, leaf=True, fixed=True, pad=pad)
            pgnos, rows, kind, counts[1] = pgnos[~fixed], rows[~fixed], kind[~fixed], counts[1] + int(fixed.sum())
        wrong = kind != (_P_LEAF if leaf else _P_BRANCH)
        if wrong.any():
            i = int(np.argmax(wrong))
            raise self.bad(f"{name}: page {pgnos[i]} has flags {kind[i]:#x} where a "
                           f"{'leaf' if leaf else 'branch'} page belongs")
        r, ptr, lo, hi, nflags, ksize = self.nodes(name, pgnos, rows, self.psize, leaf=leaf)
        if not leaf:
            counts[0] += len(pgnos)
            return [lo | hi << 16 | nflags << 32]
        counts[1] += len(pgnos)
        counts[3] += len(r)
        special = np.nonzero(nflags & (_F_BIGDATA | _F_SUBDATA | _F_DUPDATA))[0]
        for i in range(len(r)) if free_list else special:
            pgno, buf, body = int(pgnos[r[i]]), rows[r[i]].tobytes(), int(ptr[i]) + _NODE.size
            size, flags, ks = int(lo[i] | hi[i] << 16), int(nflags[i]), int(ksize[i])
            if free_list:
                self.free_record(pgno, buf, body, ks, size, flags, counts)
            elif flags & _F_BIGDATA:
                self.overflow(name, struct.unpack_from("<Q", buf, body + ks)[0], size, counts)
            elif flags & _F_SUBDATA:  # a named database (in the main one), or a tree of duplicates
                if size != _DB.size:
                    raise self.bad(f"{name}: page {pgno}: a database record of {size} bytes")
                sub = _DB.unpack_from(buf, body + ks)
                if flags & _F_DUPDATA:
                    self.database(f"{name}'s duplicates", sub, dups=True)
                else:
                    self.database(repr(buf[body : body + ks]), sub)
            else:  # sorted duplicates kept inline, in a page of their own
                self.sub_page(name, pgno, buf[body + ks : body + ks + size])
        return []

    def nodes(self, name: str, pgnos: np.ndarray, rows: np.ndarray, end: int, *, leaf: bool,
              fixed: bool = False, pad: int = 0) -> tuple[np.ndarray, ...]:
        """The nodes of pages ``rows`` (bytes ``0..end`` of each), checked: each inside its
        page, and all end to end from ``mp_upper`` to ``end`` (LMDB adds a node just below
        the others and closes the gap a removed one leaves), which is what a writer's copies
        and moves rely on. Returns (row, offset, data size lo, hi, flags, key size) arrays,
        the nodes of each row in key order. ``fixed``: pages of fixed-size keys (no nodes)."""
        u16 = rows.view("<u2")
        lower, upper = u16[:, 6].astype(np.int64), u16[:, 7].astype(np.int64)
        if fixed:  # LEAF2: keys of `pad` bytes packed after the header; mp_upper only counts
            # (mdb_node_add: lower += 2, upper -= pad - 2, modulo 2**16), so it may pass `end`
            n = (lower - _PAGE_HEAD) // 2
            wrong = ((lower < _PAGE_HEAD) | (lower % 2 == 1) | (_PAGE_HEAD + n * pad > end)
                     | ((end - n * (pad - 2)) % 65536 != upper)) if pad else np.ones(len(rows), dtype=bool)
            if wrong.any():
                i = int(np.argmax(wrong))
                raise self.bad(f"{name}: page {pgnos[i]}: fixed-size key table bounds {lower[i]}..{upper[i]} "
                               f"(keys of {pad} bytes, the page has {end} bytes)")
            return _NO_NODES
        wrong = (lower < _PAGE_HEAD) | (lower > upper) | (upper > end) | (lower % 2 == 1)
        if wrong.any():
            i = int(np.argmax(wrong))
            raise self.bad(f"{name}: page {pgnos[i]}: node table bounds {lower[i]}..{upper[i]} (the page "
                           f"has {end} bytes)")
        count = (lower - _PAGE_HEAD) // 2
        if not len(rows):
            return _NO_NODES
        table = u16[:, _PAGE_HEAD // 2 : _PAGE_HEAD // 2 + int(count.max())]
        r = np.repeat(np.arange(len(rows)), count)
        ptr = table[np.arange(table.shape[1]) < count[:, None]].astype(np.int64)  # (row by row, in key order)
        wrong = (ptr < upper[r]) | (ptr > end - _NODE.size) | (ptr % 2 == 1)
        if wrong.any():
            i = int(np.argmax(wrong))
            raise self.bad(f"{name}: page {pgnos[r[i]]}: a node at offset {ptr[i]}, outside {upper[r[i]]}..{end}")
        half = ptr // 2
        lo, hi, nflags, ksize = (u16[r, half + k].astype(np.int64) for k in range(4))
        if (ksize > _MAX_KEY).any():
            i = int(np.argmax(ksize > _MAX_KEY))
            raise self.bad(f"{name}: page {pgnos[r[i]]}: a key of {ksize[i]} bytes")
        data = np.where(nflags & _F_BIGDATA, 8, lo | hi << 16) if leaf else 0
        extent = (_NODE.size + ksize + data + 1) & ~1
        order = np.lexsort((ptr, r))  # each page's nodes by offset: they must follow one another
        at, until, page = ptr[order], (ptr + extent)[order], r[order]
        first = np.ones(len(page), dtype=bool)
        first[1:] = page[1:] != page[:-1]
        last = np.ones(len(page), dtype=bool)
        last[:-1] = first[1:]
        expect = np.where(first, upper[page], np.roll(until, 1))
        wrong = (at != expect) | (last & (until != end))
        empty = (count == 0) & (upper != end)
        if wrong.any() or empty.any():
            i = int(np.argmax(wrong)) if wrong.any() else None
            where = f"page {pgnos[page[i]]}: a node at {at[i]}..{until[i]}" if i is not None else \
                f"page {pgnos[int(np.argmax(empty))]}: no nodes"
            raise self.bad(f"{name}: {where}, where the nodes must run end to end from mp_upper to {end} "
                           "(overlapping, or with a gap)")
        return r, ptr, lo, hi, nflags, ksize

    def sub_page(self, name: str, pgno: int, sub: bytes) -> None:
        if len(sub) < _PAGE_HEAD or len(sub) % 2:
            raise self.bad(f"{name}: page {pgno}: an inline page of duplicates of {len(sub)} bytes")
        kind = struct.unpack_from("<H", sub, 10)[0] & ~_P_DIRTY
        if kind not in (_P_SUBP | _P_LEAF, _P_SUBP | _P_LEAF | _P_LEAF2):
            raise self.bad(f"{name}: page {pgno}: an inline page of duplicates with flags {kind:#x}")
        row = np.frombuffer(sub, dtype=np.uint8).reshape(1, len(sub))
        self.nodes(f"{name} (inline duplicates)", np.array([pgno]), row, len(sub), leaf=True,
                   fixed=bool(kind & _P_LEAF2), pad=struct.unpack_from("<H", sub, 8)[0])

    def page(self, name: str, pgno: int) -> bytes:
        return self.pages(name, np.array([pgno], dtype=np.int64))[0].tobytes()

    def overflow(self, name: str, first: int, size: int, counts: list[int]) -> int:
        """Check the run of overflow pages from ``first`` holding ``size`` bytes; its length.
        (Only its first page is read: the rest is the value's bytes.)"""
        head = self.page(name, first)  # (inside the file, numbered as where it lies, reached once)
        kind, pages = struct.unpack_from("<HI", head, 10)
        if kind != _P_OVERFLOW or pages * self.psize - _PAGE_HEAD < size or first + pages - 1 > self.last_pg:
            raise self.bad(f"{name}: page {first}: no run of overflow pages holding {size} bytes")
        if self.seen[first + 1 : first + pages].any():
            raise self.bad(f"{name}: overflow pages {first}..{first + pages - 1} overlap another page")
        self.seen[first + 1 : first + pages] = True
        counts[2] += pages
        return pages

    def free_record(self, pgno: int, buf: bytes, body: int, ksize: int, size: int, flags: int,
                    counts: list[int]) -> None:
        if ksize != 8:
            raise self.bad(f"the free list: page {pgno}: a key of {ksize} bytes (transaction ids have 8)")
        key = struct.unpack_from("<Q", buf, body)[0]
        if not self.last_key < key <= self.txnid:
            raise self.bad(f"the free list: page {pgno}: transaction {key} after {self.last_key} (the "
                           f"last is {self.txnid})")
        self.last_key = key
        if flags & _F_BIGDATA:
            first = struct.unpack_from("<Q", buf, body + 8)[0]
            pages = self.overflow("the free list", first, size, counts)
            value, at = os.pread(self.fd, pages * self.psize, first * self.psize), _PAGE_HEAD
        else:
            value, at = buf, body + 8
        if size < 8 or size % 8:
            raise self.bad(f"the free list: page {pgno}: a record of {size} bytes is no list of page numbers")
        room = size // 8 - 1
        count = struct.unpack_from("<Q", value, at)[0]
        if count > room:  # (a reserved record may be longer than its list; a writer reads count)
            raise self.bad(f"the free list: page {pgno}: a record with room for {room} page numbers says "
                           f"it has {count}")
        ids = np.frombuffer(value, dtype="<u8", count=count, offset=at + 8).astype(np.int64)
        if count and (ids[0] > self.last_pg or ids[-1] < 2):
            raise self.bad(f"the free list: page {pgno}: free page numbers outside 2..{self.last_pg}")
        if (np.diff(ids) >= 0).any():  # LMDB writes each list sorted, descending
            raise self.bad(f"the free list: page {pgno}: free page numbers out of order, or one twice")
        if self.free_map[ids].any():
            raise self.bad(f"the free list: page {ids[self.free_map[ids]][0]} is listed free twice")
        self.free_map[ids] = True

    def free_and_used(self) -> int:
        """After the walk: no page is both listed free and part of a tree (a writer would
        hand it out again, over what it holds); the number of free pages."""
        both = self.free_map & self.seen
        if both.any():
            raise self.bad(f"page {int(np.argmax(both))} is listed free and is in use")
        return int(self.free_map.sum())


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
