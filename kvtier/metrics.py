"""Counters every store keeps; cheap to bump from any thread, copied out as a dict."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class Counters:
    hits_host: int = 0
    hits_disk: int = 0
    misses: int = 0
    bytes_loaded: int = 0
    saves_queued: int = 0
    saves_committed: int = 0
    saves_duplicate: int = 0  # written, but the key was stored already: that copy was kept
    # written, but the chunk it extends was gone by its commit (evicted meanwhile): left out,
    # since a lookup, which walks a prompt's chunks from its first, could never reach it
    saves_unreachable: int = 0
    bytes_saved: int = 0
    dropped_saves: int = 0
    dropped_disk_full: int = 0  # of those, dropped because the store's file system was full
    corrupt_records: int = 0
    incompatible_records: int = 0
    oversized_records: int = 0  # intact, over this process's max_record_bytes: skipped, kept
    io_errors: int = 0
    # chunk reads given up on after read_timeout_s (a miss each; the record is kept)
    read_timeouts: int = 0
    # index entries whose payload file was gone (deleted behind kvtier's back): entry removed
    missing_payloads: int = 0
    # loads into host memory that found every pooled buffer in use and allocated one (pageable
    # memory with CUDA: a slower copy to the device); steady state: 0
    unpooled_loads: int = 0
    evicted_host: int = 0
    evicted_disk: int = 0
    evicted_disk_bytes: int = 0
    orphans_removed: int = 0  # payloads no index entry named (a killed writer's leftovers)
    # the remote tier (docs/scale-out.md)
    remote_hits: int = 0
    remote_saves: int = 0  # records uploaded
    remote_bytes_saved: int = 0
    remote_dropped: int = 0  # uploads not done: queue full, server down or refusing writes
    remote_errors: int = 0  # operations that found the server unavailable (each a miss)
    remote_corrupt: int = 0  # damaged remote records (removed; a miss)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
