"""The worker side of the connector on a synthetic paged KV cache, without a vLLM engine.

For tests of the data path and for ``benchmarks/gpu_bench.py`` on machines where vLLM cannot
be installed (GPU machines without it): the real :class:`WorkerSide`, :class:`ChunkStore`
and layouts run unchanged; only vLLM's empty metadata base class is stood in for when vLLM
is absent.
"""

from __future__ import annotations

import os
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.keys import Namespace


def ensure_metadata_base() -> None:
    """Make ``kvtier.vllm.metadata`` importable without vLLM (its base class is empty)."""
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
        return
    except ImportError:
        pass
    names = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer",
             "vllm.distributed.kv_transfer.kv_connector", "vllm.distributed.kv_transfer.kv_connector.v1",
             "vllm.distributed.kv_transfer.kv_connector.v1.base"]
    for name in names:
        sys.modules.setdefault(name, types.ModuleType(name))

    class KVConnectorMetadata:  # vLLM's is an empty ABC
        pass

    sys.modules[names[-1]].KVConnectorMetadata = KVConnectorMetadata  # type: ignore[attr-defined]


@dataclass
class Geometry:
    layers: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    block_size: int = 16
    chunk_tokens: int = 64
    num_blocks: int = 64
    dtype: torch.dtype = torch.float32

    @property
    def chunk_bytes(self) -> int:
        return self.layers * 2 * self.chunk_tokens * self.kv_heads * self.head_dim * self.dtype.itemsize


def make_kv_caches(g: Geometry, content: str, device: str | torch.device) -> dict[str, torch.Tensor]:
    """One ``[B, H, N, 2*D]`` tensor per layer, laid out in memory as the attention backend
    lays it out: ``kv_last`` (FlashAttention: per token and head, K then V) or ``cpu``
    (vLLM's CPU backend with row-major K: per block and head, K rows then V rows)."""
    caches = {}
    for i in range(g.layers):
        if content == "kv_last":
            phys = torch.zeros(g.num_blocks, g.block_size, g.kv_heads, 2 * g.head_dim, dtype=g.dtype, device=device)
            caches[f"layer.{i}"] = phys.transpose(1, 2)
        elif content == "cpu":
            caches[f"layer.{i}"] = torch.zeros(g.num_blocks, g.kv_heads, g.block_size, 2 * g.head_dim,
                                               dtype=g.dtype, device=device)
        else:
            raise ValueError(f"content layout {content!r}: use 'kv_last' or 'cpu'")
    return caches


def make_worker(store, g: Geometry, content: str, device: str | torch.device,  # noqa: ANN001, ANN201
                **worker_args: object):
    """A :class:`WorkerSide` over fresh KV caches: ``(worker, caches)`` (``worker_args``: more
    of its arguments, e.g. ``stage_bytes``)."""
    ensure_metadata_base()
    from kvtier.vllm.worker_side import WorkerSide

    ns = Namespace(model="worker-rig", weights_fingerprint="sha256:rig", dtype=str(g.dtype).removeprefix("torch."),
                   kv_shape=(g.layers, 2, g.kv_heads, g.head_dim), chunk_tokens=g.chunk_tokens)
    caches = make_kv_caches(g, content, device)
    worker = WorkerSide(store, ns, list(caches), caches, content, g.block_size, **worker_args)  # type: ignore[arg-type]
    return worker, caches


def save_step(worker, caches: dict[str, torch.Tensor], saves: list, *,  # noqa: ANN001
              layer_hooks: bool = True) -> None:
    """One engine step that saves ``saves`` (``SaveSpec``\\ s): every layer's hook, then
    wait_for_save. ``layer_hooks=False``: a step whose forward pass a full CUDA graph
    replayed, so no layer hook ran."""
    from kvtier.vllm.metadata import KVTierMetadata

    meta = KVTierMetadata(saves=saves)
    if layer_hooks:
        for name in caches:
            worker.save_layer(meta, name)
    worker.finish_saves(meta)


def load_sync(worker, loads: list) -> None:  # noqa: ANN001
    """Load ``loads`` (``LoadSpec``\\ s with ``sync=True``) before a step, and wait for each
    layer as that step's attention layers would (on a GPU the host does not wait: reads of
    the cache on the current stream come after the copies)."""
    from kvtier.vllm.metadata import KVTierMetadata

    worker.start_loads(KVTierMetadata(loads=loads))
    for name in worker.layer_index:
        worker.wait_for_layer(name)
    worker.get_finished(set())  # the step's end: what has landed lets go of its buffers


def wait_reported(worker, *req_ids: str, timeout: float = 120.0) -> None:  # noqa: ANN001
    """Poll ``get_finished`` as vLLM's engine loop does until the asynchronous loads of
    ``req_ids`` are reported received."""
    deadline = time.monotonic() + timeout
    waiting = set(req_ids)
    while waiting:
        waiting -= set(worker.get_finished(set())[1] or ())
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"the asynchronous loads of {sorted(waiting)} were never reported")


def save_and_reload(store, worker, caches: dict[str, torch.Tensor], g: Geometry, *,  # noqa: ANN001
                    steps: int = 16, loads: int = 16, seed: int = 0, layer_hooks: bool = True,
                    ) -> dict[str, list]:
    """Save two chunks per step for ``steps`` steps (random blocks of random KV), then zero the
    caches and load the last ``loads`` chunks back into other blocks, comparing block for
    block (``layer_hooks=False``: no save hook runs, as under a full CUDA graph). Returns the
    per-step ``(pool slots, index buffer growths)`` of both phases, the device tensors the
    worker's calls allocated so far after each step (``save_device_allocs`` and
    ``load_device_allocs``; CUDA only, else 0) and the chunks that came back different
    (``mismatches``: must be empty)."""
    from kvtier.vllm.metadata import ChunkLoad, LoadSpec, SaveSpec

    per_chunk = g.chunk_tokens // g.block_size
    gen = torch.Generator().manual_seed(seed)
    for c in caches.values():
        c.copy_(torch.randn(c.shape, generator=gen).to(c.dtype))

    def blocks(cache: torch.Tensor, ids: list[int]) -> torch.Tensor:
        return cache[torch.tensor(ids, device=cache.device)].cpu()

    device = next(iter(caches.values())).device
    allocs = 0

    def counted(call: Callable[[], None]) -> int:  # device allocations made by the worker so far
        nonlocal allocs
        before = _device_allocations(device)
        call()
        allocs += _device_allocations(device) - before
        return allocs

    saved, save_marks, save_allocs = [], [], []
    for step in range(steps):
        perm = torch.randperm(g.num_blocks, generator=gen).tolist()
        specs = []
        for j in range(2):
            ids = perm[j * per_chunk:(j + 1) * per_chunk]
            key = os.urandom(32)
            specs.append(SaveSpec(f"r{step}", (key,), 0, g.chunk_tokens, ids))
            saved.append((key, [blocks(c, ids) for c in caches.values()]))
        save_allocs.append(counted(lambda specs=specs: save_step(worker, caches, specs, layer_hooks=layer_hooks)))
        store.flush(60)
        save_marks.append((store.pool.created, worker._save_index.allocations))
    for c in caches.values():
        c.zero_()
    load_marks, load_allocs, mismatches = [], [], []
    allocs = 0
    for key, want in saved[-loads:]:
        dest = torch.randperm(g.num_blocks, generator=gen)[:per_chunk].tolist()
        spec = LoadSpec("l", [ChunkLoad((key,), 0, g.chunk_tokens, 0, dest)], sync=True)
        load_allocs.append(counted(lambda spec=spec: load_sync(worker, [spec])))
        ok = not worker.take_load_errors() and all(
            torch.equal(blocks(c, dest), w) for c, w in zip(caches.values(), want, strict=True))
        if not ok:
            mismatches.append(key.hex()[:16])
        load_marks.append((store.pool.created, worker._load_index.allocations))
    return {"save_marks": save_marks, "load_marks": load_marks, "mismatches": mismatches,
            "save_device_allocs": save_allocs, "load_device_allocs": load_allocs}


def _device_allocations(device: torch.device) -> int:
    """Tensors allocated on ``device`` so far by this process (CUDA's caching allocator
    counts every request, cached or not); 0 elsewhere."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("allocation.all.allocated", 0))


def long_load_from_disk(store, worker, caches: dict[str, torch.Tensor], g: Geometry, *,  # noqa: ANN001
                        chunks: int, seed: int = 0, idle_s: float = 0.0, sync: bool = False,
                        requests: int = 1) -> dict[str, object]:
    """Save ``chunks`` chunks of random KV (a few per step, as the write queue allows), let
    them go to disk, empty the host tier, then load them all back in one load into other
    blocks: asynchronous, polling ``get_finished`` as vLLM's engine loop does until the
    request is reported, or (``sync``) synchronous, before a step whose layers each wait
    for their copies. Returns the chunks that came back different (``mismatches``: must be empty),
    the failed blocks, and the store's ``unpooled_loads`` (chunks that found no free pooled
    buffer). ``idle_s``: the engine makes no step for that long after the load starts (a long
    forward pass); ``idle_waiting`` is how many chunks then wait for their copies and
    ``idle_done`` whether the load had finished reading. ``requests``: the chunks split
    between that many asynchronous loads, all started in one step (``idle_*`` then describe
    the first). Needs ``g.num_blocks`` ≥ 2 × ``chunks`` × blocks per chunk."""
    from kvtier.vllm.metadata import ChunkLoad, KVTierMetadata, LoadSpec, SaveSpec

    per_chunk = g.chunk_tokens // g.block_size
    gen = torch.Generator().manual_seed(seed)
    for c in caches.values():
        c.copy_(torch.randn(c.shape, generator=gen).to(c.dtype))

    def blocks(ids: list[int]) -> list[torch.Tensor]:
        return [c[torch.tensor(ids, device=c.device)].cpu() for c in caches.values()]

    keys = [os.urandom(32) for _ in range(chunks)]
    src = [list(range(i * per_chunk, (i + 1) * per_chunk)) for i in range(chunks)]
    step = max(1, int(store.config.write_queue_bytes) // g.chunk_bytes)
    for first in range(0, chunks, step):
        save_step(worker, caches, [SaveSpec("r", (keys[i],), i * g.chunk_tokens, g.chunk_tokens, src[i])
                                   for i in range(first, min(chunks, first + step))])
        store.flush(60)
        worker.get_finished(set())  # a step in between: the saves' buffers are let go
    want = [blocks(ids) for ids in src]
    store.host.clear()
    before = store.counters.snapshot()["unpooled_loads"]
    dest = [list(range((chunks + i) * per_chunk, (chunks + i + 1) * per_chunk)) for i in range(chunks)]
    per_request = -(-chunks // requests)
    specs = [LoadSpec(chr(ord("a") + r), [ChunkLoad((keys[i],), i * g.chunk_tokens, g.chunk_tokens, 0, dest[i])
                                          for i in range(r * per_request, min(chunks, (r + 1) * per_request))],
                      sync=sync) for r in range(requests)]
    idle: dict[str, object] = {}
    if sync:
        load_sync(worker, specs)
    else:
        worker.start_loads(KVTierMetadata(loads=specs))
        if idle_s:
            time.sleep(idle_s)
            job = worker._loads["a"]
            idle = {"idle_waiting": job.arrived.qsize(), "idle_done": job.future.done()}
        wait_reported(worker, *(spec.req_id for spec in specs))
    failed = worker.take_load_errors()
    mismatches = [keys[i].hex()[:16] for i, d in enumerate(dest)
                  if not all(torch.equal(a, b) for a, b in zip(blocks(d), want[i], strict=True))]
    return {"mismatches": mismatches, "failed_blocks": sorted(failed),
            "unpooled_loads": store.counters.snapshot()["unpooled_loads"] - before, **idle}


def grouped_round_trip(store, g: Geometry, content: str, device: str | torch.device,  # noqa: ANN001
                       saves_grouped: bool = True) -> dict[str, object]:
    """The worker with layers copied two at a time (``copy_bytes`` two layers of a chunk;
    saves too with ``saves_grouped``, else one layer at a time, a GPU's default) and
    the smallest stage (every group of one chunk: with ``g.layers`` 5, three chunks per
    batch), over a step of four full chunks and a partial one (two batches) whose layer hooks
    come in reverse order, each layer's KV written just before its hook as a forward pass
    writes it, a five-chunk step replayed as a CUDA graph (no hook: copied after the forward,
    batch by batch) and a one-chunk one (every gather first, then its copies). Then every
    chunk is loaded into other blocks, synchronously and asynchronously, and the first once
    more skipping its first block. Returns the worker's grouping, the stage's rows, the
    layers copied after the forward pass, and the loads' failed blocks and ``mismatches``
    (both must be empty); ``loaded``: chunk loads compared."""
    from kvtier.vllm.metadata import ChunkLoad, KVTierMetadata, LoadSpec, SaveSpec

    per = g.chunk_tokens // g.block_size
    two = 2 * g.chunk_bytes // g.layers
    worker, caches = make_worker(store, g, content, device, stage_bytes=0, copy_bytes=two,
                                 save_copy_bytes=two if saves_grouped else 0)
    out: dict[str, object] = {"per_copy": worker.per_copy, "save_per_copy": worker.save_per_copy,
                              "groups": [len(r) for r in worker._groups],
                              "sync_groups": [len(r) for r in worker._sync_groups],
                              "stage_rows": worker._stage.shape[0], "rows_per_chunk": worker.rows.rows_per_chunk(per)}
    gen = torch.Generator().manual_seed(1)
    final = {name: torch.randn(c.shape, generator=gen).to(c.dtype).to(c.device) for name, c in caches.items()}
    for name, c in caches.items():
        c.copy_(final[name])
    blocks = torch.randperm(g.num_blocks, generator=gen).tolist()
    saved: list[tuple[bytes, int, list[int]]] = []  # key, tokens, source blocks

    def spec(n_blocks: int) -> SaveSpec:
        ids, blocks[:] = blocks[:n_blocks], blocks[n_blocks:]
        key = os.urandom(32)
        saved.append((key, n_blocks * g.block_size, ids))
        return SaveSpec("r", (key,), 0, n_blocks * g.block_size, ids)

    steps = [([spec(per) for _ in range(4)] + [spec(2)], True),
             ([spec(per) for _ in range(5)], False),
             ([spec(per)], False)]
    for specs, hooks in steps:
        meta = KVTierMetadata(saves=specs)
        if hooks:
            for c in caches.values():
                c.fill_(float("nan"))
            for name in reversed(list(caches)):
                caches[name].copy_(final[name])
                worker.save_layer(meta, name)
        worker.finish_saves(meta)
    store.flush(60)
    out["late_layers"] = worker.take_stats().get("save_layers_after_forward", 0)
    store.host.clear()

    def read(ids: list[int]) -> list[torch.Tensor]:
        return [c[torch.tensor(ids, device=c.device)].cpu() for c in caches.values()]

    expected = [read(ids) for _, _, ids in saved]
    for c in caches.values():
        c.zero_()

    def chunk(i: int, skip: int = 0) -> tuple[ChunkLoad, list[int]]:
        key, tokens, ids = saved[i]
        dest, blocks[:] = blocks[: len(ids) - skip], blocks[len(ids) - skip:]
        return ChunkLoad((key,), 0, tokens, skip, dest), dest

    failed: set[int] = set()
    mismatches: list[str] = []
    for sync in (True, False):
        loads = [chunk(i) for i in range(len(saved))]
        load = LoadSpec(f"sync={sync}", [c for c, _ in loads], sync=sync)
        if sync:
            load_sync(worker, [load])
        else:
            worker.start_loads(KVTierMetadata(loads=[load]))
            wait_reported(worker, load.req_id)
        failed |= worker.take_load_errors()
        mismatches += [f"{load.req_id} chunk {i}" for i, ((_, dest), want) in enumerate(zip(loads, expected, strict=True))
                       if not all(torch.equal(a, b) for a, b in zip(read(dest), want, strict=True))]
    skipped, dest = chunk(0, skip=1)
    load_sync(worker, [LoadSpec("skip", [skipped], sync=True)])
    failed |= worker.take_load_errors()
    if not all(torch.equal(a, b[1:]) for a, b in zip(read(dest), expected[0], strict=True)):
        mismatches.append("skip chunk 0")
    worker.close()
    return {**out, "failed": sorted(failed), "mismatches": mismatches, "loaded": 2 * len(saved) + 1}
