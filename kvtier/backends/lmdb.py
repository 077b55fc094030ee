"""LMDB backend: records, LRU metadata and totals in one memory-mapped B-tree file.

Transaction discipline (after py-lmdb's documentation): one environment per process and
path (LMDB's locks break if a process opens the same file twice), reopened after ``fork``;
one write transaction at a time per process, holding a whole batch (group commit); short
read transactions. A write transaction is atomic, so a killed writer leaves either the
whole batch or none of it. ``durability="process"`` skips fsync (safe against a process
crash: committed pages are in the OS); ``"power"`` syncs each commit.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import lmdb

from kvtier.backends.base import Backend, EntryInfo, PutItem
from kvtier.config import CacheConfig

T = TypeVar("T")
_META = struct.Struct("<QQ16s")  # size, atime_ns, namespace id
_TOTALS_KEY = b"totals"
_TOTALS = struct.Struct("<QQ")  # records, bytes

# One environment per (process, path): LMDB forbids opening the same env twice per process.
_ENVS: dict[tuple[int, str], tuple[lmdb.Environment, int]] = {}
_ENVS_LOCK = threading.Lock()
# In a forked child: the parent's environments, to be closed (never used) before reopening.
_INHERITED: dict[str, lmdb.Environment] = {}


class _ForkGate:
    """Holds ``fork()`` off while an LMDB transaction is in flight in this process.

    A child must close the environment it inherited before it can open its own (py-lmdb
    refuses a second open of the same files), and closing aborts every transaction object
    it knows of, which writes to the reader table the parent shares: a transaction that
    another thread of the parent had open at the fork would lose its reader slot, and the
    parent's read could see pages a writer reuses. So fork waits for transactions to end.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._active = 0
        self._forking = False
        self.clean = True  # (in a child) no transaction was in flight at the fork

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._cv:
            while self._forking:
                self._cv.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cv:
                self._active -= 1
                self._cv.notify_all()

    def before_fork(self) -> None:
        with self._cv:
            self._forking = True
            # bounded: a fork from inside a transaction (or an abandoned iterator) must
            # not hang; such a child then leaves LMDB alone (see _acquire_env)
            self.clean = self._cv.wait_for(lambda: self._active == 0, timeout=10.0)

    def after_fork_in_parent(self) -> None:
        with self._cv:
            self._forking = False
            self._cv.notify_all()

    def after_fork_in_child(self) -> None:
        self._cv = threading.Condition()
        self._active = 0
        self._forking = False


_GATE = _ForkGate()


def _after_fork_in_child() -> None:
    global _ENVS_LOCK
    _ENVS_LOCK = threading.Lock()
    _INHERITED.update({path: env for (_, path), (env, _) in _ENVS.items()})
    _ENVS.clear()
    _GATE.after_fork_in_child()


os.register_at_fork(before=_GATE.before_fork, after_in_parent=_GATE.after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def _acquire_env(path: Path, readonly: bool, sync: bool, map_size: int) -> lmdb.Environment:
    key = (os.getpid(), str(path))
    with _ENVS_LOCK:
        if key in _ENVS:
            env, refs = _ENVS[key]
            _ENVS[key] = (env, refs + 1)
            return env
        inherited = _INHERITED.pop(str(path), None)
        if inherited is not None:
            if not _GATE.clean:
                _INHERITED[str(path)] = inherited
                raise lmdb.Error(f"{path}: forked during an LMDB transaction; the store cannot "
                                 "be reopened in this process (open it after forking)")
            inherited.close()  # safe: no transaction of it was in flight at the fork
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        env = lmdb.open(
            str(path), map_size=map_size, max_dbs=8, subdir=True, readonly=readonly,
            sync=sync, metasync=sync, readahead=True, meminit=False, lock=True, mode=0o600,
        )
        _ENVS[key] = (env, 1)
        return env


def _release_env(path: Path, env: lmdb.Environment) -> None:
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


class LmdbBackend(Backend):
    name = "lmdb"

    def __init__(self, root: Path, config: CacheConfig, *, readonly: bool = False) -> None:
        super().__init__(root, config, readonly=readonly)
        self._path = root / "lmdb"
        # The map is address space, not disk: start large so growth is rare.
        self._initial_map = max(2 * config.disk_bytes, 1 << 30)
        self._write_lock = threading.Lock()
        self._reopen_lock = threading.Lock()
        self._open()

    # -- environment lifecycle -------------------------------------------------
    def _open(self) -> None:
        sync = self.config.durability == "power"
        env = _acquire_env(self._path, self.readonly, sync, self._initial_map)
        with _GATE.held():
            if self.readonly:
                self._records = env.open_db(b"records", create=False)
                self._meta = env.open_db(b"meta", create=False)
                self._ns = env.open_db(b"namespaces", create=False)
                self._info = env.open_db(b"info", create=False)
            else:
                with env.begin(write=True) as txn:
                    self._records = env.open_db(b"records", txn=txn)
                    self._meta = env.open_db(b"meta", txn=txn)
                    self._ns = env.open_db(b"namespaces", txn=txn)
                    self._info = env.open_db(b"info", txn=txn)
        self._env = env
        self._pid = os.getpid()  # last: other threads reopen until the new env is in place

    def after_fork_in_child(self) -> None:
        self._write_lock = threading.Lock()
        self._reopen_lock = threading.Lock()

    def _env_now(self) -> lmdb.Environment:
        if os.getpid() != self._pid:  # forked: the parent's env must not be used here
            with self._reopen_lock:
                if os.getpid() != self._pid:
                    self._open()
        return self._env

    @contextmanager
    def _txn(self, write: bool = False, buffers: bool = False) -> Iterator[lmdb.Transaction]:
        """A transaction (committed on success, aborted on error); fork waits for it."""
        env = self._env_now()
        with _GATE.held():
            try:
                txn = env.begin(write=write, buffers=buffers)
            except lmdb.MapResizedError:  # another process grew the map: adopt its size
                env.set_mapsize(0)
                txn = env.begin(write=write, buffers=buffers)
            with txn:
                yield txn

    def close(self) -> None:
        if os.getpid() == self._pid:
            _release_env(self._path, self._env)

    # -- writes ----------------------------------------------------------------
    def put_many(self, items: list[PutItem]) -> None:
        if not items:
            return
        with self._write_lock:
            for attempt in range(8):
                try:
                    self._put_txn(items)
                    return
                except lmdb.MapFullError:
                    if attempt == 7:
                        raise
                    env = self._env_now()
                    env.set_mapsize(env.info()["map_size"] * 2)
                except lmdb.Error as exc:
                    # ENOSPC and other I/O errors: the transaction was aborted, nothing is
                    # visible; report as an OSError the store counts as dropped saves.
                    raise OSError(f"LMDB write failed: {exc}") from exc

    def _put_txn(self, items: list[PutItem]) -> None:
        staging = bytearray(max(it.size for it in items))
        with self._txn(write=True) as txn:
            records, nbytes = _TOTALS.unpack(txn.get(_TOTALS_KEY, db=self._info) or _TOTALS.pack(0, 0))
            now = time.time_ns()
            for it in items:
                old = txn.get(it.key, db=self._meta)
                if old is not None:
                    nbytes -= _META.unpack(old)[0]
                    records -= 1
                hl = len(it.header)
                staging[:hl] = it.header
                staging[hl : it.size] = it.payload
                txn.put(it.key, memoryview(staging)[: it.size], db=self._records)
                txn.put(it.key, _META.pack(it.size, now, it.namespace_id), db=self._meta)
                records += 1
                nbytes += it.size
            txn.put(_TOTALS_KEY, _TOTALS.pack(records, nbytes), db=self._info)

    def touch(self, keys: Iterable[bytes], now_ns: int) -> None:
        keys = list(keys)
        if not keys or self.readonly:
            return
        with self._write_lock, self._txn(write=True) as txn:
            for k in keys:
                old = txn.get(k, db=self._meta)
                if old is not None:
                    size, _, ns = _META.unpack(old)
                    txn.put(k, _META.pack(size, now_ns, ns), db=self._meta)

    def delete(self, keys: Iterable[bytes]) -> int:
        freed = 0
        with self._write_lock, self._txn(write=True) as txn:
            records, nbytes = _TOTALS.unpack(txn.get(_TOTALS_KEY, db=self._info) or _TOTALS.pack(0, 0))
            for k in keys:
                old = txn.get(k, db=self._meta)
                if old is None:
                    txn.delete(k, db=self._records)
                    continue
                size = _META.unpack(old)[0]
                txn.delete(k, db=self._meta)
                txn.delete(k, db=self._records)
                freed += size
                records -= 1
                nbytes -= size
            txn.put(_TOTALS_KEY, _TOTALS.pack(max(records, 0), max(nbytes, 0)), db=self._info)
        return freed

    # -- reads -----------------------------------------------------------------
    def read(self, key: bytes, fn: Callable[[memoryview], T]) -> T | None:
        # buffers=True: a zero-copy view into the map, valid until the transaction ends (a
        # plain get would copy the whole value, however large, before anything checks it)
        with self._txn(buffers=True) as txn:
            view = txn.get(key, db=self._records)
            if view is None:
                return None
            return fn(memoryview(view))

    def count_present_prefix(self, keys: Iterable[bytes]) -> int:
        n = 0
        with self._txn() as txn:
            cur = txn.cursor(db=self._meta)
            for k in keys:
                if not cur.set_key(k):
                    break
                n += 1
        return n

    def entries(self) -> Iterator[EntryInfo]:
        with self._txn() as txn:
            for k, v in txn.cursor(db=self._meta):
                size, atime, ns = _META.unpack(v)
                yield EntryInfo(bytes(k), size, atime, ns)

    def usage(self) -> tuple[int, int]:
        with self._txn() as txn:
            raw = txn.get(_TOTALS_KEY, db=self._info)
        return _TOTALS.unpack(raw) if raw else (0, 0)

    def register_namespace(self, namespace_id: bytes, description: dict[str, object]) -> None:
        blob = json.dumps(description, sort_keys=True).encode()
        with self._write_lock, self._txn(write=True) as txn:
            txn.put(namespace_id, blob, db=self._ns, overwrite=True)

    def namespaces(self) -> dict[bytes, dict[str, object]]:
        with self._txn() as txn:
            return {bytes(k): json.loads(bytes(v)) for k, v in txn.cursor(db=self._ns)}

    def compact(self) -> int:
        """Rewrite the data file without free pages (LMDB never shrinks it in place).

        The caller must hold the store exclusively (no other process may have it open).
        """
        data = self._path / "data.mdb"
        before = data.stat().st_size
        tmp = self._path / "compact.tmp"
        tmp.mkdir(mode=0o700, exist_ok=True)
        with self._write_lock:
            env = self._env_now()
            with _GATE.held():
                env.copy(str(tmp), compact=True)
            with _ENVS_LOCK:
                _ENVS.pop((os.getpid(), str(self._path)), None)
                self._env.close()
            os.replace(tmp / "data.mdb", data)
            tmp.rmdir()
            self._open()
        return before - data.stat().st_size
