"""What the scheduler side tells the worker side each step (plain data: it is serialized)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class ChunkLoad:
    """Fill ``block_ids`` from a stored chunk, skipping its first ``skip_blocks`` blocks."""

    keys: tuple[bytes, ...]  # the chunk's key for each tensor-parallel rank
    token_start: int
    num_tokens: int
    skip_blocks: int
    block_ids: list[int]


@dataclass
class LoadSpec:
    req_id: str
    chunks: list[ChunkLoad]
    sync: bool = False  # load before this step's forward pass instead of in the background


@dataclass
class SaveSpec:
    """Save tokens ``[token_start, token_start + num_tokens)`` held in ``block_ids``."""

    req_id: str
    keys: tuple[bytes, ...]  # per tensor-parallel rank
    token_start: int
    num_tokens: int
    block_ids: list[int]
    # per rank: the key of the chunk this one extends (empty for a chain's first chunk);
    # eviction keeps chains whole with it
    parent_keys: tuple[bytes, ...] = ()
    # per rank: the key of the chain's first chunk (lookups read a chain's chunks together)
    head_keys: tuple[bytes, ...] = ()
    # the scheduler's lookup found it stored on every rank: the worker skips it without
    # reading the index (which may wait for the disk) on the model's thread
    stored: bool = False
    # per rank: a longer stored chunk that holds this one's KV (a tail saved at a smaller
    # block size): this one is skipped, that one is used, unless its load failed here
    held_by: tuple[bytes, ...] = ()


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    # The scheduler's namespace id per tensor-parallel rank: records carry the namespace the
    # keys were derived from, even where a worker's copy of the config was changed by the
    # model while loading.
    namespace_ids: tuple[bytes, ...] = ()
    # Per rank, the keys of stored chunks that requests used from vLLM's own prefix cache, for
    # the store's LRU (an engine that saves says so through its skipped saves; one that only
    # loads, through this).
    uses: list[tuple[bytes, ...]] = field(default_factory=list)
    # The step schedules no tokens: no forward pass, the engine only waits for loads (see
    # WorkerSide.get_finished).
    idle: bool = False
