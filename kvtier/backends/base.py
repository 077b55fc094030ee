"""The one small interface every persistent backend implements.

A backend stores whole encoded records under 32-byte keys. It never exposes a partial
record: ``put_many`` makes each record visible atomically (all of it or none of it), and it
groups many records into one commit so durability costs one sync per batch, not per record.
Reads hand a view of the record to a callback so LMDB can serve it straight from its map
and the file backend from a reused buffer: no per-read allocation.
"""

from __future__ import annotations

import abc
import json
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kvtier.config import CacheConfig

T = TypeVar("T")


@dataclass(frozen=True)
class PutItem:
    """One record to store: its key, encoded header and payload, and its namespace id."""

    key: bytes
    header: bytes
    payload: memoryview
    namespace_id: bytes

    @property
    def size(self) -> int:
        return len(self.header) + self.payload.nbytes


@dataclass(frozen=True)
class EntryInfo:
    """What a backend knows about a stored record without reading it."""

    key: bytes
    size: int
    atime_ns: int
    namespace_id: bytes


def most_recent(entries: Iterable[EntryInfo], max_bytes: int) -> list[EntryInfo]:
    """The most recently used entries, newest first, as long as their sizes add up to at most
    ``max_bytes`` (what prefetching reads first)."""
    chosen, total = [], 0
    for e in sorted(entries, key=lambda e: (-e.atime_ns, e.key)):
        if total + e.size > max_bytes:
            break
        chosen.append(e)
        total += e.size
    return chosen


class Backend(abc.ABC):
    """A persistent tier. Thread-safe; one instance per process and store directory."""

    name: str = ""

    def __init__(self, root: Path, config: CacheConfig, *, readonly: bool = False) -> None:
        self.root = root
        self.config = config
        self.readonly = readonly
        _LIVE_BACKENDS.add(self)

    def after_fork_in_child(self) -> None:  # noqa: B027 - optional hook
        """Runs in a forked child: replace locks, threads and handles the parent owns."""

    @abc.abstractmethod
    def put_many(self, items: list[PutItem]) -> None:
        """Store records in one group commit. Raises ``OSError`` (e.g. disk full) on failure,
        in which case none of the batch may be visible half-written."""

    @abc.abstractmethod
    def read(self, key: bytes, fn: Callable[[memoryview], T]) -> T | None:
        """Call ``fn`` with a view of the whole record (valid only during the call), or
        return None if the key is absent."""

    @abc.abstractmethod
    def count_present_prefix(self, keys: Iterable[bytes]) -> int:
        """How many of ``keys``, from the first, are stored (stops at the first absent one)."""

    @abc.abstractmethod
    def touch(self, keys: Iterable[bytes], now_ns: int) -> None:
        """Record a use of ``keys`` for LRU eviction (best effort)."""

    @abc.abstractmethod
    def delete(self, keys: Iterable[bytes]) -> int:
        """Remove records; return the bytes freed."""

    @abc.abstractmethod
    def entries(self) -> Iterator[EntryInfo]:
        """Every stored record's metadata (a consistent snapshot where the backend allows)."""

    @abc.abstractmethod
    def usage(self) -> tuple[int, int]:
        """``(records, bytes)`` currently stored."""

    @abc.abstractmethod
    def register_namespace(self, namespace_id: bytes, description: dict[str, object]) -> None:
        """Remember what a namespace id stands for (for ``kvtier ls``)."""

    @abc.abstractmethod
    def namespaces(self) -> dict[bytes, dict[str, object]]:
        """Every registered namespace id and its description."""

    def compact(self) -> int:
        """Shrink on-disk files where the backend can; return bytes reclaimed."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files and maps."""

    def evict_lru(self, target_bytes: int) -> tuple[int, int]:
        """Delete least-recently-used records until at most ``target_bytes`` remain.

        Returns ``(records, bytes)`` removed.
        """
        return self.evict_from(list(self.entries()), target_bytes)

    def evict_from(self, entries: list[EntryInfo], target_bytes: int) -> tuple[int, int]:
        """Evict least-recently-used ``entries`` until at most ``target_bytes`` remain."""
        total = sum(e.size for e in entries)
        if total <= target_bytes:
            return 0, 0
        victims: list[bytes] = []
        for info in sorted(entries, key=lambda e: e.atime_ns):
            if total <= target_bytes:
                break
            victims.append(info.key)
            total -= info.size
        freed = self.delete(victims)
        return len(victims), freed


_LIVE_BACKENDS: weakref.WeakSet[Backend] = weakref.WeakSet()


def _backends_after_fork_in_child() -> None:
    for backend in list(_LIVE_BACKENDS):
        backend.after_fork_in_child()


os.register_at_fork(after_in_child=_backends_after_fork_in_child)


class ThreadBuffer(threading.local):
    """A per-thread reusable read buffer, grown as needed (allocation is the slow part)."""

    def __init__(self) -> None:
        self.buf = bytearray(0)

    def get(self, size: int) -> memoryview:
        if len(self.buf) < size:
            self.buf = bytearray(max(size, len(self.buf) * 3 // 2))
        return memoryview(self.buf)[:size]


def write_json_atomic(path: Path, data: dict[str, object]) -> None:
    """Write a small JSON file atomically (temp file, fsync, rename), owner-only."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
