"""Helpers of the remote-tier tests: caches with a local store each and one remote tier."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier import CacheConfig, KVCache, Namespace
from kvtier.keys import chain_seed
from kvtier.keys import chunk_keys as chunk_keys_of

KV_SHAPE = (2, 2, 4, 32)  # layers, k/v, kv_heads, head_dim
CHUNK = 32


def namespace() -> Namespace:
    return Namespace(model="remote-test", weights_fingerprint="sha256:0123", dtype="float32",
                     kv_shape=KV_SHAPE, chunk_tokens=CHUNK)


def open_cache(path: Path, remote: str | None, **kw: Any) -> KVCache:
    kw.setdefault("remote_part_bytes", "64K")  # several parts per chunk in these small tests
    cfg = CacheConfig(path=path, chunk_tokens=CHUNK, io_threads=2, remote=remote, **kw)
    return KVCache.open(path, namespace(), cfg, tail_granularity=8)


def keys_of(toks: np.ndarray) -> list[bytes]:
    """The chunk keys a cache of :func:`open_cache` stores ``toks`` under."""
    return [ref.key for ref in chunk_keys_of(toks, chain_seed(namespace()), CHUNK)]


def tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.int64).astype(np.uint32)


def kv_for(toks: np.ndarray) -> torch.Tensor:
    """KV that is a deterministic function of the tokens: [layers, 2, tokens, heads, dim]."""
    g = torch.Generator().manual_seed(int(toks.sum()) % (1 << 31))
    return torch.randn(KV_SHAPE[0], 2, len(toks), *KV_SHAPE[2:], generator=g)


def chunk_keys(client: Any) -> list[bytes]:
    """The remote tier's chunks on one server (one hash each)."""
    return list(client.scan_iter(match="kvt2:*"))


def wait_for(cond: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def random_key() -> bytes:
    return os.urandom(32)
