"""kvtier: storage-tiered KV-cache offload for LLM serving.

The library API is :class:`KVCache` (save, lookup and load the KV of token sequences) over
a :class:`ChunkStore` (host tier + LMDB or files). The vLLM connector lives in
``kvtier.vllm`` and is imported only when vLLM loads it.
"""

from kvtier.cache import KVCache
from kvtier.config import CacheConfig
from kvtier.errors import ConfigError, KVTierError, RecordError, StoreError, StoreFormatError
from kvtier.keys import Namespace, RequestExtras
from kvtier.store import ChunkStore

__all__ = [
    "CacheConfig", "ChunkStore", "ConfigError", "KVCache", "KVTierError", "Namespace",
    "RecordError", "RequestExtras", "StoreError", "StoreFormatError",
]
__version__ = "0.1.0"
