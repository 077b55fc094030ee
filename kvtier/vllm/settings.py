"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

Every :class:`kvtier.CacheConfig` setting is accepted, plus the connector-only ones below.
Unknown keys and bad values raise :class:`kvtier.ConfigError` naming the setting.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvtier.config import CacheConfig
from kvtier.errors import ConfigError
from kvtier.units import parse_size

LOAD_FAILURE_POLICIES = ("recompute", "fail")
MAX_SAVE_WAIT_S = 1200.0


@dataclass
class ConnectorSettings:
    cache: CacheConfig
    # What vLLM does when a promised chunk fails to load: recompute it (default) or fail
    # the request. Overrides vLLM's own kv_load_failure_policy default of "fail".
    load_failure_policy: str = "recompute"
    # Set when the weights are not in a local directory kvtier can hash (e.g. a remote
    # loader); must change whenever the weights change.
    weights_fingerprint: str | None = None
    # Save the prompt's trailing partial chunk (rounded down to the block size) so that an
    # exactly repeated prompt hits in full.
    save_partial_chunks: bool = True
    # Also save the full chunks a request's output completes (prompt and answer tokens), so
    # that the next turn of a conversation, whose prompt repeats the answer, hits on it too.
    save_decode_chunks: bool = False
    # Load in the background between steps (other requests keep running) or synchronously
    # before the step's forward pass (lowest time to first token for a lone request).
    load_async: bool = True
    # At start-up, load up to this many bytes of this server's most recently used chunks
    # into the host tier in the background (0: off). At most host_bytes.
    prefetch_bytes: int = 0
    # How the start-up prefetch reads: kvtier's own reader, or NVIDIA DALI's file reader
    # (files backend, the `dali` extra).
    prefetch_reader: str = "default"
    # Offline producers only (warm-up): seconds a step may wait for room in the write queue
    # and for chunk buffers instead of dropping saves. 0 (servers): never wait for storage.
    save_wait_s: float = 0.0
    # Device memory for the worker's copy stage (None: its default, 8 MiB of a batch of
    # chunks per layer slot; see WorkerSide). Never less than one chunk's every layer needs.
    device_stage_bytes: int | None = None
    # About how many bytes of a chunk's layers one copy between device and host memory
    # moves (None: 8 MiB on a GPU, one layer at a time on the CPU; 0: one layer at a time).
    device_copy_bytes: int | None = None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        own = {f.name for f in fields(cls)} - {"cache"}
        mine = {k: extra.pop(k) for k in list(extra) if k in own}
        cache = CacheConfig.from_dict(extra, where="kv_connector_extra_config", also_known=tuple(own))
        policy = mine.get("load_failure_policy", "recompute")
        if policy not in LOAD_FAILURE_POLICIES:
            raise ConfigError(
                f"load_failure_policy: must be 'recompute' or 'fail', got {policy!r}")
        fp = mine.get("weights_fingerprint")
        if fp is not None and (not isinstance(fp, str) or not fp.strip()):
            raise ConfigError("weights_fingerprint: must be a non-empty string")
        partial = mine.get("save_partial_chunks", True)
        if not isinstance(partial, bool):
            raise ConfigError(f"save_partial_chunks: must be true or false, got {partial!r}")
        decode = mine.get("save_decode_chunks", False)
        if not isinstance(decode, bool):
            raise ConfigError(f"save_decode_chunks: must be true or false, got {decode!r}")
        load_async = mine.get("load_async", True)
        if not isinstance(load_async, bool):
            raise ConfigError(f"load_async: must be true or false, got {load_async!r}")
        prefetch = parse_size(mine.get("prefetch_bytes", 0), "prefetch_bytes")
        if prefetch > cache.host_bytes:
            raise ConfigError(
                f"prefetch_bytes: {prefetch} bytes is more than host_bytes ({cache.host_bytes}); "
                "prefetched chunks are kept in the host tier, so raise host_bytes or lower prefetch_bytes")
        reader = mine.get("prefetch_reader", "default")
        if reader not in ("default", "dali"):
            raise ConfigError(f"prefetch_reader: must be 'default' or 'dali', got {reader!r}")
        if reader == "dali":
            from kvtier.dali_reader import require_dali

            require_dali()
            if cache.backend != "files":
                raise ConfigError("prefetch_reader: 'dali' reads record files; it needs \"backend\": \"files\"")
        wait = mine.get("save_wait_s", 0.0)
        # (bounded well below torch.distributed's 30-minute collective timeout: tensor-parallel
        # ranks agree on each step's loads through a collective while one rank may wait here)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= MAX_SAVE_WAIT_S:
            raise ConfigError(f"save_wait_s: must be seconds from 0 to {MAX_SAVE_WAIT_S:.0f} (0: drop saves "
                              f"that do not fit, as a server must), got {wait!r}")
        stage = mine.get("device_stage_bytes")
        stage = None if stage is None else parse_size(stage, "device_stage_bytes")
        copy = mine.get("device_copy_bytes")
        copy = None if copy is None else parse_size(copy, "device_copy_bytes")
        return cls(cache=cache, load_failure_policy=policy, weights_fingerprint=fp,
                   save_partial_chunks=partial, save_decode_chunks=decode, load_async=load_async, prefetch_bytes=prefetch,
                   prefetch_reader=reader, save_wait_s=float(wait), device_stage_bytes=stage,
                   device_copy_bytes=copy)
