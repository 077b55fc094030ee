"""LMCache 0.5.6 side of the storage benchmark; runs under .venv-lmcache's python.

Started by ``storage_bench.py`` as ``python lmcache_worker.py MODE JSON_PARAMS``; prints one
``RESULT {...}`` line. Modes:

- ``store_load``: LocalDiskBackend through LMCache's ``StorageManager`` (the level LMCache's
  own engine uses): allocate a MemoryObj, copy the chunk in, ``batched_put``, wait until
  every key is in the disk index (its ``write()`` returned). Then fsync every file (LMCache
  never does; that gives a durable figure), evict the files from the page cache, and load every chunk with
  ``batched_get(location="LocalDiskBackend")`` copying it out into one pre-touched tensor.
  Loads run in the *same* process: LMCache's disk index lives in memory only, so a new
  process would find nothing. Every loaded byte is compared with the source.
- ``lookup``: a full ``LMCacheEngine`` (MockGPUConnector: moves no KV, which a lookup does
  not need) with the disk backend; stores a prompt, then times ``engine.lookup(tokens)``.

LMCache's vLLM connector refuses the CPU backend, so its disk backend is driven here through
its storage manager and engine directly (see docs/benchmarks.md).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import GIB, emit, evict, fill_kv, time_calls, tokens_for

os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
logging.getLogger("lmcache").setLevel(logging.WARNING)

from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.event_manager import EventManager  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402

DISK = "LocalDiskBackend"


def _config(disk_dir: Path, cpu_gib: float, disk_gib: float, io_threads: int,
            odirect: bool) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(
        chunk_size=256, local_cpu=False, max_local_cpu_size=cpu_gib,
        local_disk=f"file://{disk_dir}/", max_local_disk_size=disk_gib,
        extra_config={"disk_io_threads": io_threads, "use_odirect": odirect},
    )


def _metadata(kv_shape: tuple[int, int, int, int, int]) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=kv_shape, role="worker",
    )


def _wait_indexed(sm: StorageManager, keys: list[CacheEngineKey], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    pending = list(keys)
    while pending:
        pending = [k for k in pending if sm.contains(k, [DISK]) is None]
        if pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending)} chunks never reached LMCache's disk index")
            time.sleep(0.0005)


def store_load(p: dict[str, Any]) -> dict[str, object]:
    layers, heads, dim, ct = p["layers"], p["kv_heads"], p["head_dim"], p["chunk_tokens"]
    n, batch = p["n_chunks"], p["batch"]
    disk_dir = Path(p["dir"])
    disk_dir.mkdir(parents=True, exist_ok=True)
    chunk_bytes = layers * 2 * ct * heads * dim * 2
    total = n * chunk_bytes
    kv = fill_kv(torch.empty(layers, 2, n * ct, heads, dim, dtype=torch.bfloat16), p["seed"], ct)
    # Staging buffer: room for two batches in flight (its allocator back-pressures the loop).
    cpu_gib = max(0.25, 2 * batch * chunk_bytes * 1.05 / GIB)
    cfg = _config(disk_dir, cpu_gib, 2 * total / GIB + 1, p["io_threads"], p["odirect"])
    sm = StorageManager(cfg, _metadata((layers, 2, ct, heads, dim)), EventManager())
    shape = torch.Size([2, layers, ct, heads * dim])
    keys = [CacheEngineKey("bench", 1, 0, 1000 + i, torch.bfloat16) for i in range(n)]
    res: dict[str, object] = {"bytes": total, "chunk_bytes": chunk_bytes, "odirect": p["odirect"]}
    try:
        os.sync()
        t0 = time.perf_counter()
        for b in range(0, n, batch):
            objs = []
            for i in range(b, min(b + batch, n)):
                obj = sm.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
                assert obj is not None and obj.tensor is not None
                obj.tensor.view(2, layers, ct, heads, dim).copy_(
                    kv[:, :, i * ct : (i + 1) * ct].transpose(0, 1))
                objs.append(obj)
            sm.batched_put(keys[b : b + len(objs)], objs)
        _wait_indexed(sm, keys)
        t_store = time.perf_counter() - t0
        files = sorted(disk_dir.rglob("*.pt"))
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        t_durable = time.perf_counter() - t0
        res.update(store_s=t_store, store_durable_s=t_durable, files=len(files))

        res["cold"] = evict(disk_dir)
        out = torch.empty_like(kv)
        out.zero_()  # pre-touch the destination: we time the load, not first-touch faults
        t0 = time.perf_counter()
        for b in range(0, n, batch):
            got = sm.batched_get(keys[b : b + batch], location=DISK)
            for j, obj in enumerate(got):
                if obj is None or obj.tensor is None:
                    raise RuntimeError(f"LMCache lost chunk {b + j}")
                i = b + j
                out[:, :, i * ct : (i + 1) * ct].copy_(
                    obj.tensor.view(2, layers, ct, heads, dim).transpose(0, 1))
                obj.ref_count_down()
        res["load_s"] = time.perf_counter() - t0
        res["verified"] = bool(torch.equal(out.view(torch.int16), kv.view(torch.int16)))
    finally:
        sm.close()
    return res


def lookup(p: dict[str, Any]) -> dict[str, object]:
    from lmcache.utils import mock_up_broadcast_fn, mock_up_broadcast_object_fn
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector

    kv_shape = (1, 2, 256, 1, 8)  # tiny chunks: a lookup never reads KV
    disk_dir = Path(p["dir"])
    disk_dir.mkdir(parents=True, exist_ok=True)
    cfg = _config(disk_dir, 0.25, 4.0, 4, False)
    engine = LMCacheEngineBuilder.get_or_create(
        "bench", cfg, _metadata(kv_shape), MockGPUConnector(kv_shape),
        mock_up_broadcast_fn, mock_up_broadcast_object_fn)
    engine.post_init()
    n = p["prompt_tokens"]
    hit = torch.tensor(tokens_for(n, p["seed"]), dtype=torch.long)
    miss = torch.tensor(tokens_for(n, p["seed"] + 1), dtype=torch.long)
    half = torch.cat([hit[: n // 2], miss[n // 2 :]])
    res: dict[str, object] = {"prompt_tokens": n, "hash": "builtin (vLLM not importable)"}
    try:
        engine.store(hit)
        deadline = time.monotonic() + 300
        while engine.lookup(hit) < n:
            if time.monotonic() > deadline:
                raise TimeoutError("LMCache never indexed the stored prompt")
            time.sleep(0.01)
        runs = p["runs"]
        res["full_hit"] = time_calls(lambda: engine.lookup(hit), runs)
        res["half_hit"] = time_calls(lambda: engine.lookup(half), runs)
        res["miss"] = time_calls(lambda: engine.lookup(miss), runs)
        res["hash_only"] = time_calls(
            lambda: list(engine.token_database.process_tokens(tokens=hit)), runs)
        res["hits"] = [engine.lookup(hit), engine.lookup(half), engine.lookup(miss)]
    finally:
        LMCacheEngineBuilder.destroy("bench")
    return res


def main() -> None:
    mode, params = sys.argv[1], json.loads(sys.argv[2])
    fn = {"store_load": store_load, "lookup": lookup}[mode]
    emit(fn(params))
    sys.stdout.flush()
    # LMCache leaves non-daemon threads behind on some paths; do not hang the benchmark.
    os._exit(0)


if __name__ == "__main__":
    main()
