"""Fill a small demo store with the library API, to try the ``kvtier`` CLI on.

    python examples/cli_demo_store.py /tmp/demo-cache            # LMDB
    python examples/cli_demo_store.py /tmp/demo-files files zstd  # files, compressed
    kvtier ls /tmp/demo-cache

Two models (one of them tensor-parallel rank 0 of 2), a few shared-prefix prompts, and one
prompt saved under a tenant's ``cache_salt``. The KV is random: this exercises storage,
not a model. ``docs/cli.md`` shows the CLI's output on such a store.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from kvtier import CacheConfig, KVCache, Namespace, RequestExtras


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/demo-cache"
    backend = sys.argv[2] if len(sys.argv) > 2 else "lmdb"
    compression = sys.argv[3] if len(sys.argv) > 3 else "none"
    rng = np.random.default_rng(0)
    models = [
        Namespace(model="llama-3.2-1b", weights_fingerprint="sha256:5f1c0a9e2b7d4c31",
                  dtype="bfloat16", kv_shape=(16, 2, 8, 64), chunk_tokens=256),
        Namespace(model="qwen2.5-7b", weights_fingerprint="sha256:a03e91bb7c2d0f44",
                  dtype="float16", kv_shape=(28, 2, 2, 128), chunk_tokens=256, tp_rank=0, tp_size=2),
    ]
    config = CacheConfig(path=path, backend=backend, chunk_tokens=256, compression=compression)
    system_prompt = rng.integers(0, 32000, 1024)
    for ns in models:
        layers, two, heads, dim = ns.kv_shape
        dtype = getattr(torch, ns.dtype)
        with KVCache.open(path, ns, config) as cache:
            for _ in range(4):  # a shared system prompt, then a different question each time
                tokens = np.concatenate([system_prompt, rng.integers(0, 32000, 300)])
                cache.save(tokens, torch.randn(layers, two, len(tokens), heads, dim).to(dtype))
            if ns is models[0]:
                tokens = np.arange(600)
                cache.save(tokens, torch.randn(layers, two, len(tokens), heads, dim).to(dtype),
                           RequestExtras(cache_salt="tenant-a"))
            cache.flush()
            print(f"saved {ns.model}; the store holds {cache.stats()['disk_records']} records")


if __name__ == "__main__":
    main()
