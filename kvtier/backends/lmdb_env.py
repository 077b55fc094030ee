"""LMDB environments shared by every part of a process, with the discipline LMDB requires.

After py-lmdb's documentation:

- one environment per process and path (LMDB's locks break if a process opens the same
  files twice), reopened after ``fork`` (a child must never use the parent's);
- ``set_mapsize`` only while no transaction of this process is open (LMDB forbids it, and a
  zero-copy view from ``buffers=True`` could point into the old map): :class:`TxnGate` holds
  new transactions off and waits for open ones to end first;
- short read transactions; one write transaction at a time (LMDB serialises writers across
  processes itself).

The map is address space, not disk (without ``MDB_WRITEMAP`` the file grows only with the
pages in use), so maps start large and a resize is rare.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb

from kvtier import forksafe
from kvtier.backends.fsync import fsync_path
from kvtier.backends.lmdb_check import damage_report, damaged_store
from kvtier.errors import StoreError


class TxnGate:
    """Counts this process's open transactions; lets a resize or a fork wait for none.

    A child must close the environment it inherited before it can open its own, and closing
    aborts every transaction object it knows of, which writes to the reader table the parent
    shares: a transaction another thread of the parent had open at the fork would lose its
    reader slot. So fork waits for transactions to end, as a map resize does.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._active = 0
        self._closed_gate = False
        self.clean = True  # (in a child) no transaction was in flight at the fork

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._cv:
            while self._closed_gate:
                self._cv.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cv:
                self._active -= 1
                self._cv.notify_all()

    @contextmanager
    def exclusive(self, timeout: float | None = None) -> Iterator[bool]:
        """No transaction of this process is open inside; yields False if ``timeout`` passed
        with some still open (the caller must then not resize)."""
        with self._cv:
            while self._closed_gate:
                self._cv.wait()
            self._closed_gate = True
            ok = self._cv.wait_for(lambda: self._active == 0, timeout=timeout)
        try:
            yield ok
        finally:
            with self._cv:
                self._closed_gate = False
                self._cv.notify_all()

    def before_fork(self) -> None:
        with self._cv:
            self._closed_gate = True
            # bounded: a fork from inside a transaction (or an abandoned iterator) must not
            # hang; such a child then leaves LMDB alone (see acquire_env)
            self.clean = self._cv.wait_for(lambda: self._active == 0, timeout=10.0)

    def after_fork_in_parent(self) -> None:
        with self._cv:
            self._closed_gate = False
            self._cv.notify_all()

    def after_fork_in_child(self) -> None:
        self._cv = threading.Condition()
        self._active = 0
        self._closed_gate = False


GATE = TxnGate()

# One environment per (process, path).
_ENVS: dict[tuple[int, str], tuple[lmdb.Environment, int]] = {}
_ENVS_LOCK = threading.Lock()
# In a forked child: the parent's environments, to be closed (never used) before reopening.
_INHERITED: dict[str, lmdb.Environment] = {}


def _after_fork_in_child() -> None:
    global _ENVS_LOCK
    _ENVS_LOCK = threading.Lock()
    _INHERITED.update({path: env for (_, path), (env, _) in _ENVS.items()})
    _ENVS.clear()
    GATE.after_fork_in_child()


forksafe.register(forksafe.LMDB, before=GATE.before_fork, after_in_parent=GATE.after_fork_in_parent,
                  after_in_child=_after_fork_in_child)


def acquire_env(path: Path, *, readonly: bool, sync: bool, map_size: int, readahead: bool,
                max_dbs: int = 16, metasync: bool = True) -> lmdb.Environment:
    """This process's environment at ``path`` (opened on first use, reference counted).

    ``metasync=False`` (with ``sync``): a commit syncs its data pages but not its meta page,
    which the next commit's sync (or :meth:`EnvHandle.sync`) makes durable; until then a
    power loss rolls that commit back whole (LMDB's ``MDB_NOMETASYNC``: still consistent).

    ``readahead``: off for an index, which is read a few pages at a time (with it, the first
    lookups after a restart read hundreds of MiB of the map); on for large values, which
    page faults would otherwise read 4 KiB at a time.
    """
    key = (os.getpid(), str(path))
    with _ENVS_LOCK:
        if key in _ENVS:
            env, refs = _ENVS[key]
            _check_same_use(path, env, readonly=readonly, sync=sync)
            _ENVS[key] = (env, refs + 1)
            return env
        inherited = _INHERITED.pop(str(path), None)
        if inherited is not None:
            if not GATE.clean:
                _INHERITED[str(path)] = inherited
                raise lmdb.Error(f"{path}: forked during an LMDB transaction; the store cannot "
                                 "be reopened in this process (open it after forking)")
            inherited.close()  # safe: no transaction of it was in flight at the fork
        # before this process reads a page it cannot trust (an index, read a few pages at a
        # time, is read whole first: see damage_report)
        damage = damage_report(path, preread=not readahead)
        if damage is not None:
            raise damaged_store(path, damage)
        if not readonly:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        env = lmdb.open(
            str(path), map_size=map_size, max_dbs=max_dbs, subdir=True, readonly=readonly,
            sync=sync, metasync=sync and metasync, readahead=readahead, meminit=False, lock=True, mode=0o600,
        )
        env.reader_check()  # free reader slots of killed processes (they pin old pages)
        _ENVS[key] = (env, 1)
        return env


def _check_same_use(path: Path, env: lmdb.Environment, *, readonly: bool, sync: bool) -> None:
    """LMDB allows one environment per file and process, opened once: a later user of the
    same store in this process shares the first one's, which must then serve it. One that
    would silently not (writes through a read-only one, ``durability="power"`` through one
    that does not sync) is refused, saying what to change."""
    flags = env.flags()
    if not readonly and flags.get("readonly"):
        raise StoreError(f"{path}: this process opened the store read-only first; it cannot also "
                         "write it: open the writer first (a writer's handle serves readers too), "
                         "or write from another process")
    if sync and not flags.get("sync", True):
        raise StoreError(f"{path}: this process opened the store with durability 'process' first; "
                         "it cannot also write it with durability 'power': use one durability for "
                         "a store within a process")


def release_env(path: Path, env: lmdb.Environment) -> None:
    key = (os.getpid(), str(path))
    with _ENVS_LOCK:
        held = _ENVS.get(key)
        if held is None or held[0] is not env:
            return
        if held[1] > 1:
            _ENVS[key] = (env, held[1] - 1)
        else:
            del _ENVS[key]
            env.close()


def forget_env(path: Path, env: lmdb.Environment) -> None:
    """Close ``env`` and drop it from the table, whatever its count (``compact`` swaps files)."""
    with _ENVS_LOCK:
        _ENVS.pop((os.getpid(), str(path)), None)
        env.close()


def _same_owner_and_mode(copy: Path, original: Path) -> None:
    """Give a compacted copy the original file's owner and permissions: LMDB creates it for
    whoever runs the compaction, readable by all under a usual umask (the KV of users'
    prompts is private data), and a file the store's owner cannot open would stop its server.
    Raises :class:`StoreError` (nothing replaced) where this user cannot."""
    st = original.stat()
    os.chmod(copy, st.st_mode & 0o7777)
    try:
        os.chown(copy, st.st_uid, st.st_gid)
    except PermissionError:  # (a group this user is not in: the owner can still open it)
        if os.stat(copy).st_uid != st.st_uid:
            raise StoreError(f"{original}: owned by user {st.st_uid}, and this user cannot give the "
                             "compacted copy to it; run compact as the store's owner "
                             "(e.g. sudo -u OWNER kvtier compact ...)") from None


def _remove_copy(tmp: Path) -> None:
    """Remove ``compact.tmp`` (a copy of an environment being compacted) if it is there."""
    if tmp.is_symlink() or tmp.is_file():
        tmp.unlink()
    elif tmp.exists():
        shutil.rmtree(tmp)


class EnvHandle:
    """One user's handle on a shared environment: transactions that respect :data:`GATE`,
    reopening after ``fork``, and map growth done safely."""

    def __init__(self, path: Path, *, readonly: bool, sync: bool, map_size: int,
                 dbs: tuple[tuple[bytes, bool], ...], readahead: bool = False,
                 metasync: bool = True, added: frozenset[bytes] = frozenset()) -> None:
        self.path = path
        self.readonly = readonly
        self._sync = sync
        self._metasync = metasync
        self._readahead = readahead
        self._map_size = map_size
        self._db_specs = dbs  # (name, dupsort)
        # databases a newer kvtier added: an environment no writer of that version has opened
        # yet lacks them, and a read-only handle goes without (a writer's open creates them)
        self._added = added
        self._reopen_lock = threading.Lock()
        self.dbs: dict[bytes, object] = {}
        self._open()

    def _open(self) -> None:
        env = acquire_env(self.path, readonly=self.readonly, sync=self._sync, map_size=self._map_size,
                          readahead=self._readahead, metasync=self._metasync)
        with GATE.held():
            if self.readonly:
                dbs = {}
                for n, d in self._db_specs:
                    try:
                        dbs[n] = env.open_db(n, create=False, dupsort=d)
                    except lmdb.NotFoundError:
                        if n not in self._added:
                            raise
            else:
                with env.begin(write=True) as txn:
                    dbs = {n: env.open_db(n, txn=txn, dupsort=d) for n, d in self._db_specs}
        self.dbs = dbs
        self.env = env
        self._pid = os.getpid()  # last: other threads reopen until the new env is in place

    def env_now(self) -> lmdb.Environment:
        if os.getpid() != self._pid:  # forked: the parent's env must not be used here
            with self._reopen_lock:
                if os.getpid() != self._pid:
                    self._reopen_lock = threading.Lock()
                    self._open()
        return self.env

    @contextmanager
    def txn(self, write: bool = False, buffers: bool = False) -> Iterator[lmdb.Transaction]:
        """A transaction (committed on success, aborted on error)."""
        env = self.env_now()
        for _ in range(3):
            with GATE.held():
                try:
                    txn = env.begin(write=write, buffers=buffers)
                except lmdb.MapResizedError:
                    txn = None
                if txn is not None:
                    with txn:
                        yield txn
                    return
            self._adopt_new_size(env)
        raise lmdb.MapResizedError(f"{self.path}: the map keeps being resized by another process")

    @property
    def synced(self) -> bool:
        """Commits sync (durability "power"): the environment's own flag, set by whichever
        user of this path opened it first in this process (one environment per path)."""
        return bool(self.env_now().flags()["sync"])

    def sync(self) -> None:
        """Make every commit so far durable (its meta page too, without ``metasync``)."""
        env = self.env_now()
        with GATE.held():
            env.sync(True)

    def _adopt_new_size(self, env: lmdb.Environment) -> None:
        """Another process grew the map: adopt its size, with no transaction of ours open."""
        with GATE.exclusive(timeout=30.0) as ok:
            if ok:
                env.set_mapsize(0)

    def grow(self) -> bool:
        """Double the map (after ``MapFullError``); False if transactions stayed open."""
        env = self.env_now()
        with GATE.exclusive(timeout=30.0) as ok:
            if ok:
                env.set_mapsize(env.info()["map_size"] * 2)
            return ok

    def close(self) -> None:
        if os.getpid() == self._pid:
            release_env(self.path, self.env)

    def compact(self) -> int:
        """Rewrite the data file without free pages (LMDB never shrinks it in place); bytes
        reclaimed. The caller must hold the store exclusively (no other process has it)."""
        data = self.path / "data.mdb"
        before = data.stat().st_size
        tmp = self.path / "compact.tmp"
        # A copy left by a compact that failed or was killed is never data (the live file is
        # data.mdb; a copy replaces it only once complete), and under the exclusive lock no
        # other compact is writing it. LMDB refuses to copy over it ("File exists").
        _remove_copy(tmp)
        tmp.mkdir(mode=0o700)
        env = self.env_now()
        forgotten = False
        try:
            with GATE.held():
                env.copy(str(tmp), compact=True)
            _same_owner_and_mode(tmp / "data.mdb", data)
            # (LMDB's copy is not synced: replaced unsynced, a power loss soon after could
            # leave the store's only data file empty or partial, whatever its durability)
            fsync_path(tmp / "data.mdb")
            with GATE.exclusive(timeout=30.0) as ok:
                if not ok:
                    raise lmdb.Error(f"{self.path}: transactions stayed open; compact later")
                forget_env(self.path, env)
                forgotten = True
                os.replace(tmp / "data.mdb", data)
                fsync_path(self.path)  # (the rename itself)
                tmp.rmdir()
        except BaseException:
            _remove_copy(tmp)  # a partial copy (e.g. on a full disk) must not stay behind
            if forgotten:
                self._open()  # keep this handle usable, on whichever file is in place
            raise
        self._open()
        return before - data.stat().st_size

    def file_bytes(self) -> int:
        """Bytes of the data file's pages, used and free (what it holds on its disk)."""
        env = self.env_now()
        return (env.info()["last_pgno"] + 1) * env.stat()["psize"]

    def page_bytes(self, txn: lmdb.Transaction) -> int:
        """Bytes of the pages this environment's databases use (what its data occupies)."""
        st = txn.stat()
        pages = 2 + st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        for db in self.dbs.values():
            s = txn.stat(db)
            pages += s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]
        return pages * st["psize"]
