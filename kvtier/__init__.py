"""kvtier: storage-tiered KV-cache offload for LLM serving.

The library API is :class:`KVCache` (save, lookup and load the KV of token sequences) over
a :class:`ChunkStore` (host tier + LMDB or files). The vLLM connector lives in
``kvtier.vllm`` and is imported only when vLLM loads it.

Names are imported on first use, so ``import kvtier`` (and the ``kvtier`` command, whose
read-only commands parse record headers without tensors) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvtier.config import CacheConfig
from kvtier.errors import ConfigError, KVTierError, RecordError, StoreError, StoreFormatError
from kvtier.keys import Namespace, RequestExtras

if TYPE_CHECKING:
    from kvtier.cache import KVCache
    from kvtier.store import ChunkStore, Loaded, Outcome

__all__ = [
    "CacheConfig", "ChunkStore", "ConfigError", "KVCache", "KVTierError", "Loaded", "Namespace",
    "Outcome", "RecordError", "RequestExtras", "StoreError", "StoreFormatError",
]
__version__ = "0.1.0"

_LAZY = {"KVCache": "kvtier.cache", "ChunkStore": "kvtier.store", "Loaded": "kvtier.store",
         "Outcome": "kvtier.store"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
