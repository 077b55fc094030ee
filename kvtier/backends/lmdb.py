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


def _acquire_env(path: Path, readonly: bool, sync: bool, map_size: int) -> lmdb.Environment:
    key = (os.getpid(), str(path))
    with _ENVS_LOCK:
        if key in _ENVS:
            env, refs = _ENVS[key]
            _ENVS[key] = (env, refs + 1)
            return env
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
        self._open()

    # -- environment lifecycle -------------------------------------------------
    def _open(self) -> None:
        self._pid = os.getpid()
        sync = self.config.durability == "power"
        self._env = _acquire_env(self._path, self.readonly, sync, self._initial_map)
        if self.readonly:
            self._records = self._env.open_db(b"records", create=False)
            self._meta = self._env.open_db(b"meta", create=False)
            self._ns = self._env.open_db(b"namespaces", create=False)
            self._info = self._env.open_db(b"info", create=False)
        else:
            with self._env.begin(write=True) as txn:
                self._records = self._env.open_db(b"records", txn=txn)
                self._meta = self._env.open_db(b"meta", txn=txn)
                self._ns = self._env.open_db(b"namespaces", txn=txn)
                self._info = self._env.open_db(b"info", txn=txn)

    def _env_now(self) -> lmdb.Environment:
        if os.getpid() != self._pid:  # forked: the parent's env must not be used here
            self._open()
        return self._env

    def _begin(self, write: bool = False) -> lmdb.Transaction:
        env = self._env_now()
        try:
            return env.begin(write=write)
        except lmdb.MapResizedError:  # another process grew the map: adopt its size
            env.set_mapsize(0)
            return env.begin(write=write)

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
        with self._begin(write=True) as txn:
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
        with self._write_lock, self._begin(write=True) as txn:
            for k in keys:
                old = txn.get(k, db=self._meta)
                if old is not None:
                    size, _, ns = _META.unpack(old)
                    txn.put(k, _META.pack(size, now_ns, ns), db=self._meta)

    def delete(self, keys: Iterable[bytes]) -> int:
        freed = 0
        with self._write_lock, self._begin(write=True) as txn:
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
        with self._begin() as txn:
            view = txn.get(key, db=self._records)  # zero-copy view into the map (buffers)
            if view is None:
                return None
            return fn(memoryview(view))

    def count_present_prefix(self, keys: Iterable[bytes]) -> int:
        n = 0
        with self._begin() as txn:
            cur = txn.cursor(db=self._meta)
            for k in keys:
                if not cur.set_key(k):
                    break
                n += 1
        return n

    def entries(self) -> Iterator[EntryInfo]:
        with self._begin() as txn:
            for k, v in txn.cursor(db=self._meta):
                size, atime, ns = _META.unpack(v)
                yield EntryInfo(bytes(k), size, atime, ns)

    def usage(self) -> tuple[int, int]:
        with self._begin() as txn:
            raw = txn.get(_TOTALS_KEY, db=self._info)
        return _TOTALS.unpack(raw) if raw else (0, 0)

    def register_namespace(self, namespace_id: bytes, description: dict[str, object]) -> None:
        blob = json.dumps(description, sort_keys=True).encode()
        with self._write_lock, self._begin(write=True) as txn:
            txn.put(namespace_id, blob, db=self._ns, overwrite=True)

    def namespaces(self) -> dict[bytes, dict[str, object]]:
        with self._begin() as txn:
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
            self._env_now().copy(str(tmp), compact=True)
            with _ENVS_LOCK:
                _ENVS.pop((os.getpid(), str(self._path)), None)
                self._env.close()
            os.replace(tmp / "data.mdb", data)
            tmp.rmdir()
            self._open()
        return before - data.stat().st_size
