"""Connector statistics for vLLM's periodic log line and its Prometheus endpoint.

The payload is a flat ``{name: number}`` dict (it crosses process boundaries); counters are
summed across workers and steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# Prometheus counters exported, with their help text.
PROM_COUNTERS = {
    "load_tokens": "Tokens whose KV kvtier loaded instead of recomputing",
    "load_requests": "Requests whose KV load finished",
    "load_failed_blocks": "KV blocks whose load failed (missing or corrupt); vLLM recomputed them",
    "load_seconds": "Seconds spent loading KV (sum)",
    "save_chunks": "Chunks handed to the write-behind store",
    "save_tokens": "Tokens whose KV was handed to the write-behind store",
    "save_skipped_chunks": "Chunks not saved because they were stored already",
    "save_dropped_chunks": "Chunks not saved because the write queue was full or no pooled buffer was free",
    "save_unsafe_chunks": "Chunks not saved because a synchronous load failed in their step or the one "
                          "before (their KV was computed over blocks the load did not fill)",
    "save_layers_after_forward": "Layers of saved chunks copied in wait_for_save, after the forward pass "
                                 "(a full CUDA graph ran no save_kv_layer hook, or fewer ran than the one "
                                 "that plans, the third or a smaller model's last, or a hook's copy failed)",
    "store_hits_host": "Chunk loads served from host memory",
    "store_hits_disk": "Chunk loads served from the persistent tier",
    "store_misses": "Chunk loads that found nothing usable",
    "store_bytes_loaded": "Bytes of chunks loaded",
    "store_saves_queued": "Chunks queued for the persistent tier",
    "store_saves_committed": "Chunks committed to the persistent tier",
    "store_bytes_saved": "Bytes committed to the persistent tier",
    "store_saves_duplicate": "Chunks written but left out because another copy was stored meanwhile "
                             "(two servers computing the same prefix)",
    "store_saves_unreachable": "Chunks written but left out because the chunk they extend was evicted "
                               "before their commit (no lookup could reach them)",
    "store_dropped_saves": "Saves dropped (queue full, disk full, I/O error)",
    "store_dropped_disk_full": "Saves dropped because the store's file system was full (free space "
                               "or lower disk_bytes); not counted as I/O errors",
    "store_corrupt_records": "Records that failed verification (served as misses)",
    "store_incompatible_records": "Intact records of another format version (misses, kept)",
    "store_oversized_records": "Intact records over max_record_bytes (misses, kept)",
    "store_evicted_host": "Chunks evicted from host memory",
    "store_evicted_disk": "Records evicted from the persistent tier",
    "store_evicted_disk_bytes": "Bytes evicted from the persistent tier",
    "store_orphans_removed": "Record payloads no index entry named (a killed writer's), removed",
    "store_io_errors": "Storage I/O errors",
    "store_read_timeouts": "Chunk reads given up after read_timeout_s (a hung file system?): misses, "
                           "records kept",
    "store_missing_payloads": "Index entries whose record file was gone (removed by hand?); dropped from "
                              "the index, the chunk is saved again",
    "store_unpooled_loads": "Chunks loaded into newly allocated host memory because every pooled buffer was "
                            "in use (pageable with CUDA: slower copies to the device); 0 in steady state",
    "store_remote_hits": "Chunk loads served from the remote tier",
    "store_remote_saves": "Chunks uploaded to the remote tier",
    "store_remote_bytes_saved": "Bytes uploaded to the remote tier",
    "store_remote_dropped": "Uploads to the remote tier not done (queue full, server down or full)",
    "store_remote_errors": "Remote-tier operations that found the server unavailable (misses)",
    "store_remote_corrupt": "Remote records that failed verification (served as misses)",
}


@dataclass
class KVTierStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data)
        if self.data.get("load_seconds"):
            out["load_tokens_per_s"] = round(self.data.get("load_tokens", 0) / self.data["load_seconds"])
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVTierPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"vllm:kvtier_{name}_total", documentation=doc,
                                    labelnames=self._labelnames)
            for name, doc in PROM_COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            counter = self._counters.get(name)
            if counter is not None and value > 0:
                counter.labels(*labels).inc(value)
