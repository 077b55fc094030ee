"""LMDB payload store: record bytes inline in an LMDB environment (``<store>/lmdb``).

Records are keyed by ``location + key``, so a new version of a record never overwrites the
one the index still names. A batch goes in write transactions of at most ``txn_bytes``
(LMDB holds a copy of a transaction's new pages until it commits), each synced with
``durability="power"`` and followed by one sync of the last meta page; without it, safe
against a process crash since committed pages are in the OS. Reads are zero-copy views into
the map, valid for the read transaction.
This environment holds payloads only; the index (``index.py``) is a separate, small one, so
lookups never wait behind a large payload commit.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import lmdb
import numpy as np

from kvtier.backends.index import EntryInfo
from kvtier.backends.lmdb_env import EnvHandle
from kvtier.backends.payloads import PayloadStore, PutItem, oversized

T = TypeVar("T")
_LOC = struct.Struct(">Q")
_PAGE = 4096
DATA_DIR = "lmdb"


def _dbkey(key: bytes, location: int) -> bytes:
    return _LOC.pack(location) + key


def _txn_ends(items: list[PutItem], max_bytes: int) -> list[int]:
    """Where each transaction of :meth:`LmdbPayloads.write_many` ends: at most ``max_bytes``
    of records each, at least one record."""
    ends, size = [], 0
    for i, it in enumerate(items):
        if size and size + it.size > max_bytes:
            ends.append(i)
            size = 0
        size += it.size
    return [*ends, len(items)] if items else []


class LmdbPayloads(PayloadStore):
    name = "lmdb"
    # most record bytes per write transaction (what an open transaction holds a copy of), so
    # LMDB stays inside the budgets + 64 MiB; no slower than a transaction per batch with
    # durability "power", slower on this VM's page cache with "process" (benchmarks.md)
    txn_bytes = 16 << 20

    def __init__(self, root: Path, durability: str, disk_bytes: int, max_record_bytes: int,
                 *, readonly: bool = False) -> None:
        self.max_record_bytes = max_record_bytes
        # Address space, not disk: room for the budget, a commit batch and free pages.
        self.env = EnvHandle(root / DATA_DIR, readonly=readonly, sync=durability == "power",
                             map_size=max(4 * disk_bytes, 1 << 30), dbs=((b"records", False),),
                             readahead=True,  # records are large, read front to back
                             metasync=False)  # write_many syncs once more at its end
        self._staging = bytearray(0)  # only the writer thread uses it (one commit at a time)

    @property
    def _records(self) -> object:  # looked up on each use: a fork replaces the environment
        return self.env.dbs[b"records"]

    # A record needs a run of free pages, which a file filled to the brim rarely has: it
    # then grows the file instead, until the disk is full. So records fill only this share
    # of what the file can hold on its disk (its size plus the free space).
    disk_fill = 0.75

    def held_on_disk(self, occupied: int) -> int:
        return self.env.file_bytes()  # used and free pages: what the file holds

    def occupied(self, size: int) -> int:
        # a value over about half a page is stored in its own run of overflow pages
        if size > _PAGE // 2 - 64:
            return -(-(size + 16) // _PAGE) * _PAGE
        return size + 48

    def write_many(self, items: list[PutItem], locations: list[int]) -> list[BaseException | None]:
        """Write ``items`` in transactions of at most :attr:`txn_bytes` each (and at least one
        record): LMDB keeps an open transaction's new pages in allocated memory until it
        commits, so one transaction for a whole batch would hold a second copy of all of it.

        A failed transaction fails its records and the batch's later ones. With
        ``durability="power"`` each commit syncs its data pages, one sync at the end makes
        the last commit's meta page durable too, before the index names any record, and a
        batch is stored whole or not at all: an I/O error is reported once, so a failed
        commit may stand for an earlier commit's pages that never reached the disk."""
        results: list[BaseException | None] = [None] * len(items)
        done = 0
        for end in _txn_ends(items, self.txn_bytes):
            err = self._write_txn(items[done:end], locations[done:end])
            if err is not None:  # nothing of this transaction is visible; stop here
                results[done:] = [err] * (len(items) - done)
                break
            done = end
        if done and self.env.synced:
            failed = results[done] if done < len(items) else None
            if failed is None:
                try:
                    self.env.sync()
                except lmdb.Error as exc:
                    failed = OSError(f"LMDB sync failed: {exc}")
            if failed is not None:  # committed, but not known to be durable: not published
                results[:done] = [failed] * done
                self._forget(items[:done], locations[:done])
        return results

    def _write_txn(self, items: list[PutItem], locations: list[int]) -> BaseException | None:
        for _ in range(8):
            try:
                self._put_txn(items, locations)
                return None
            except lmdb.MapFullError as exc:
                if not self.env.grow():
                    return _failed(f"LMDB map full and could not grow: {exc}", exc)
            except lmdb.Error as exc:
                # ENOSPC and other I/O errors: the transaction was aborted, nothing of it is
                # visible; its records (and the batch's later ones) fail together
                return _failed(f"LMDB write failed: {exc}", exc)
            except Exception as exc:  # e.g. MemoryError staging a record: earlier
                # transactions of the batch are committed, so this one must not escape
                return _failed(f"LMDB write failed: {exc!r}", exc)
        return OSError("LMDB map full after growing it 8 times")

    def _forget(self, items: list[PutItem], locations: list[int]) -> None:
        with contextlib.suppress(lmdb.Error):  # best effort: what stays is an orphan, which nothing reads
            self._remove([(it.key, loc) for it, loc in zip(items, locations, strict=True)])

    def _remove(self, records: list[tuple[bytes, int]]) -> None:
        with self.env.txn(write=True) as txn:
            for key, loc in records:
                txn.delete(_dbkey(key, loc), db=self._records)
        if self.env.synced:  # the removal's meta page too: a removal a power loss undid
            self.env.sync()  # would leave an orphan that no sweep looks for

    def _put_txn(self, items: list[PutItem], locations: list[int]) -> None:
        # py-lmdb has no MDB_RESERVE: a value not already assembled in place (PutItem.record)
        # is assembled in one reused staging buffer
        need = max((it.size for it in items if it.record is None), default=0)
        if len(self._staging) < need:
            self._staging = bytearray(need)
        staging = memoryview(self._staging)
        with self.env.txn(write=True) as txn:
            for it, loc in zip(items, locations, strict=True):
                if it.record is not None:
                    value = it.record[: it.size]
                else:
                    hl = len(it.header)
                    staging[:hl] = it.header
                    np.copyto(np.frombuffer(staging[hl : it.size], dtype=np.uint8),
                              np.frombuffer(it.payload.cast("B"), dtype=np.uint8))  # without the GIL
                    value = staging[: it.size]
                txn.put(_dbkey(it.key, loc), value, db=self._records)

    def delete(self, entries: list[EntryInfo]) -> list[EntryInfo]:
        if not entries or self.env.readonly:
            return []
        try:
            self._remove([(e.key, e.location) for e in entries])
        except lmdb.Error:  # (e.g. a full disk: LMDB needs free pages to commit a removal)
            return list(entries)
        return []

    def read(self, entry: EntryInfo, fn: Callable[[memoryview], T]) -> T | None:
        # buffers=True: a zero-copy view into the map, valid until the transaction ends (a
        # plain get would copy the whole value, however large, before anything checks it)
        with self.env.txn(buffers=True) as txn:
            view = txn.get(_dbkey(entry.key, entry.location), db=self._records)
            if view is None:
                return None
            if len(view) > self.max_record_bytes:
                raise oversized(view, len(view), self.max_record_bytes)
            return fn(memoryview(view))

    def read_head(self, entry: EntryInfo, n: int) -> tuple[bytes, int] | None:
        with self.env.txn(buffers=True) as txn:
            view = txn.get(_dbkey(entry.key, entry.location), db=self._records)
            return None if view is None else (bytes(view[:n]), len(view))

    def found(self) -> Iterator[tuple[bytes, int]]:
        with self.env.txn() as txn:
            keys = [bytes(k) for k in txn.cursor(db=self._records).iternext(values=False)]
        for k in keys:
            if len(k) == 40:
                yield k[8:], _LOC.unpack(k[:8])[0]

    def remove_found(self, key: bytes, location: int) -> None:
        self._remove([(key, location)])

    def close(self) -> None:
        self.env.close()


def _failed(message: str, cause: BaseException) -> OSError:
    """A write's error, returned rather than raised, still chained to its cause (which says,
    for one, whether the disk was full: see lmdb_check.full_cause)."""
    err = OSError(message)
    err.__cause__ = cause
    return err
