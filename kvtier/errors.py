"""Exceptions kvtier raises to its callers.

Storage faults on the serving path (corrupt records, I/O errors, a full disk) are *not*
raised: they become misses and counters. These exceptions are for mistakes a user can fix.
"""

from __future__ import annotations


class KVTierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is invalid; the message names the setting and what is allowed."""


class StoreError(KVTierError):
    """A store directory cannot be used as asked (not a store, other backend, other format)."""


class StoreFormatError(StoreError):
    """The store was written by a kvtier whose on-disk format this version cannot read."""


class StoreDamaged(StoreError):
    """The store's own structures (its LMDB index or record environment) are damaged beyond
    what a miss can cover. The cache is disposable: move the directory away or delete it."""


class StoreFull(StoreError):
    """The store's file system (or its LMDB map) has no room for what opening or changing it
    needs. Nothing is wrong with its files: free space and retry."""


class RecordError(KVTierError):
    """A stored record failed validation (bad magic, header, length, shape or checksum)."""


class IncompatibleRecord(RecordError):
    """A record is intact but of another record-format version: treated as a miss."""


class DestinationMismatch(KVTierError, ValueError):
    """An intact record does not fit the destination tensor a caller passed (shape or dtype):
    the caller's mistake, not damage; the record is kept."""


class RecordTooLarge(KVTierError):
    """An intact record is larger than this process's ``max_record_bytes``: skipped (a miss),
    never deleted, since another process with a higher limit wrote it and can read it."""
