"""Where record bytes live: the interface of the two payload stores (files, LMDB).

A payload store only holds bytes under ``(key, location)``. It never decides what is
stored: the index does (``index.py``). Writes happen before the index commit that makes
them visible, removals after the commit that hides them.
"""

from __future__ import annotations

import abc
import errno
import os
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from kvtier.backends.index import EntryInfo
from kvtier.codec import MAX_HEADER_BYTES, RecordReader, decode_header
from kvtier.errors import RecordError, RecordTooLarge

T = TypeVar("T")


def open_regular_file(path: str | os.PathLike[str], *, follow_links: bool = False) -> int:
    """``path`` opened for reading, refusing anything but a regular file. A store prepared by
    someone else must not hang a read (a FIFO in a file's place: ``O_NONBLOCK`` opens it
    without waiting, and means nothing for a file) nor, unless ``follow_links``, lead it out
    of the store (``O_NOFOLLOW``)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow_links else os.O_NOFOLLOW))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


@dataclass(frozen=True)
class PutItem:
    """One record to store: its key, encoded header and payload, and where it belongs."""

    key: bytes
    header: bytes
    payload: memoryview
    namespace_id: bytes
    group: bytes | None = None  # the chunk's rank-0 key (None: the key itself)
    parent: bytes | None = None  # the key of the chunk this one extends (None: a chain head)
    token_start: int = 0
    num_tokens: int = 0
    head: bytes | None = None  # the key of its chain's first chunk (None: found from the parent)
    # The record already assembled in one buffer (header in front of the payload, see
    # codec.record_in_place): page-aligned, running to the end of the record's last page;
    # the record is its first ``size`` bytes. None: the store assembles header + payload.
    record: memoryview | None = None
    # replace a stored record of the key (its writer could not load it); else a stored one is
    # kept and this copy dropped (see StoreIndex.publish)
    replace: bool = False

    @property
    def size(self) -> int:
        return len(self.header) + self.payload.nbytes


class PayloadStore(abc.ABC):
    """Record bytes under ``(key, location)``. Thread-safe; one per process and store."""

    name: str = ""

    @abc.abstractmethod
    def write_many(self, items: list[PutItem], locations: list[int]) -> list[BaseException | None]:
        """Write records durably (per the store's durability); one error (or None) per item."""

    @abc.abstractmethod
    def read(self, entry: EntryInfo, fn: Callable[[memoryview], T]) -> T | None:
        """Call ``fn`` with a view of the record (valid only during the call); None if the
        payload is gone (removed after the caller read the index: a miss)."""

    def read_record(self, entry: EntryInfo, fn: Callable[[RecordReader], T]) -> T | None:
        """Call ``fn`` with a :class:`~kvtier.codec.RecordReader` of the record (valid only
        during the call); None if the payload is gone. This default reads through
        :meth:`read`, whose view already is the stored bytes (a map)."""
        return self.read(entry, lambda view: fn(ViewReader(view)))

    @abc.abstractmethod
    def read_head(self, entry: EntryInfo, n: int) -> tuple[bytes, int] | None:
        """The record's first ``n`` bytes and its length; None if gone."""

    @abc.abstractmethod
    def delete(self, entries: list[EntryInfo]) -> list[EntryInfo]:
        """Remove payloads the index no longer names (one already gone counts as removed);
        return those an I/O error kept. Never raises: the index commit that hid them is done."""

    @abc.abstractmethod
    def found(self) -> Iterator[tuple[bytes, int]]:
        """Every payload present, as ``(key, location)`` (for the orphan sweep)."""

    @abc.abstractmethod
    def remove_found(self, key: bytes, location: int) -> None:
        """Remove one payload the sweep found unreferenced."""

    @abc.abstractmethod
    def occupied(self, size: int) -> int:
        """Bytes a record of ``size`` bytes takes on disk (what the budget counts)."""

    # The share of what the records could hold on their disk that they may fill (see
    # Backend._make_room_on_disk): files take the free space as it is.
    disk_fill = 1.0

    def held_on_disk(self, occupied: int) -> int:
        """Bytes the records hold on their file system now (``occupied``: what the index
        counts them at)."""
        return occupied

    def after_fork_in_child(self) -> None:  # noqa: B027 - optional hook
        """Runs in a forked child: replace locks and threads the parent owns."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files and maps."""


class ViewReader:
    """A :class:`~kvtier.codec.RecordReader` over a record already in memory (or mapped)."""

    def __init__(self, view: memoryview) -> None:
        self.view = memoryview(view).cast("B")
        self.size = len(self.view)
        self.head = self.view[:MAX_HEADER_BYTES]

    def fill(self, dst: memoryview, offset: int) -> None:
        src = self.view[offset : offset + len(dst)]
        if len(src) != len(dst):
            raise RecordError(f"record ends at {self.size} bytes, {offset + len(dst)} needed")
        # numpy copies without the GIL (a memoryview assignment holds it, and a mapped
        # record's page faults then stall every other thread; measured 7x slower besides)
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))

    def fill_runs(self, runs: Sequence[memoryview], offset: int) -> None:
        for run in runs:
            self.fill(run, offset)
            offset += len(run)

    def whole(self) -> memoryview:
        return self.view

    def fill_record(self, region: memoryview, offset: int) -> None:
        self.fill(region[offset : self.size], offset)


def oversized(head: bytes | memoryview, size: int, limit: int) -> Exception:
    """What a record of ``size`` bytes, over this process's ``limit``, is (judged by its first
    bytes only, never sizing a buffer by it): corrupt if its header is damaged or disagrees
    with its length, else intact and too large (kept for a process with a higher limit)."""
    try:
        decode_header(memoryview(head)[:MAX_HEADER_BYTES], max_record_bytes=size, record_len=size)
    except RecordError as exc:
        return exc
    return RecordTooLarge(f"record is {size} bytes, over this process's max_record_bytes ({limit}); "
                          "skipped, not deleted (raise max_record_bytes to read it)")


class ThreadBuffer(threading.local):
    """A per-thread reusable read buffer, grown as needed (allocation is the slow part)."""

    def __init__(self) -> None:
        self.buf = bytearray(0)

    def get(self, size: int) -> memoryview:
        if len(self.buf) < size:
            self.buf = bytearray(max(size, len(self.buf) * 3 // 2))
        return memoryview(self.buf)[:size]
