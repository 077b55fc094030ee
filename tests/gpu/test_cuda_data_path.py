"""The worker's data path on a CUDA device (skipped where there is none; run on a GPU
machine with ``python -m pytest tests/gpu``): the same round trip and steady-state checks as
the CPU tests, with KV caches in GPU memory, pinned pool buffers and side-stream copies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier import CacheConfig
from kvtier.store import ChunkStore
from kvtier.testing.worker_rig import (
    Geometry,
    ensure_metadata_base,
    grouped_round_trip,
    long_load_from_disk,
    make_worker,
    save_and_reload,
)

ensure_metadata_base()  # (a GPU machine has no vLLM: any test may run first, or alone with -k)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rank(layers: int, num_blocks: int, dtype: torch.dtype = torch.bfloat16) -> Geometry:
    """A Llama-3-8B rank's KV geometry (8 KV heads, head_dim 128, block 16, 256-token chunks)."""
    return Geometry(layers=layers, kv_heads=8, head_dim=128, block_size=16, chunk_tokens=256,
                    num_blocks=num_blocks, dtype=dtype)


@pytest.mark.parametrize("content", ["kv_last", "cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_round_trip_is_bit_exact_and_allocates_nothing_when_warm(tmp_path: Path, content: str,
                                                                      dtype: torch.dtype) -> None:
    g = _rank(8, 128, dtype)
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=4 * g.chunk_bytes,
                      write_queue_bytes=4 * g.chunk_bytes)
    with ChunkStore(cfg) as store:
        assert store.pool.pin  # pinned host buffers on a CUDA machine
        worker, caches = make_worker(store, g, content, "cuda")
        got = save_and_reload(store, worker, caches, g)
        assert got["mismatches"] == []
        reserved = store.pool.cap_bytes // g.chunk_bytes  # pinned when the worker started
        assert {m[0] for m in got["save_marks"] + got["load_marks"]} == {reserved}
        assert got["save_marks"][-1] == got["save_marks"][3]
        assert got["load_marks"][-1] == got["load_marks"][7]
        if content == "kv_last":  # a GPU's layout: not one device tensor per step once warm
            # (the packed CPU layout is permuted through a new tensor per chunk and layer)
            assert got["save_device_allocs"][-1] == got["save_device_allocs"][3], got["save_device_allocs"]
            assert got["load_device_allocs"][-1] == got["load_device_allocs"][7], got["load_device_allocs"]
        worker.close()


@pytest.mark.parametrize("sync", [False, True])
def test_cuda_a_long_load_from_disk_stays_in_pinned_pool_buffers(tmp_path: Path, sync: bool) -> None:
    """Three times as many chunks as the pinned pool holds, from disk, in one load
    (asynchronous, or synchronous): each chunk's buffer comes back once its host-to-device
    copy is done, so none is loaded into pageable memory; bit-exact."""
    g = _rank(8, 2 * 48 * 16)
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=12 * g.chunk_bytes,
                      write_queue_bytes=4 * g.chunk_bytes, io_threads=2)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, g, "kv_last", "cuda")
        got = long_load_from_disk(store, worker, caches, g, chunks=48, sync=sync)
        assert got["mismatches"] == [] and got["failed_blocks"] == []
        assert got["unpooled_loads"] == 0
        worker.close()


def test_cuda_saves_under_a_full_cuda_graph_round_trip(tmp_path: Path) -> None:
    """No save_kv_layer hook runs (a full CUDA graph replays the forward pass): wait_for_save
    copies every layer, behind the forward pass, and the chunks come back bit for bit."""
    g = _rank(8, 128)
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=4 * g.chunk_bytes,
                      write_queue_bytes=4 * g.chunk_bytes)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, g, "kv_last", "cuda")
        got = save_and_reload(store, worker, caches, g, layer_hooks=False)
        assert got["mismatches"] == []
        assert worker.take_stats()["save_layers_after_forward"] == 16 * g.layers
        worker.close()


def _busy_compute(seconds: float = 0.3) -> None:
    """Queue about ``seconds`` of matmuls on the compute stream (returns at once). Large ones,
    timed after a warm-up (the first includes cuBLAS's start-up, and timing it queued too
    few), and a few hundred at most: CUDA blocks the thread that enqueues work once about a
    thousand operations are pending, which would make this wait instead of the code tested."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    a @ a
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    a @ a
    end.record()
    end.synchronize()
    for _ in range(min(400, max(1, int(seconds * 1e3 / max(start.elapsed_time(end), 1e-3))))):
        a @ a


def test_cuda_the_model_thread_never_waits_for_copies(tmp_path: Path) -> None:
    """With compute queued, a step's saves and a synchronous load return before the compute
    stream is done: the host waited for neither; the data still round-trips."""
    from kvtier.testing.worker_rig import load_sync, save_step
    from kvtier.vllm.metadata import ChunkLoad, LoadSpec, SaveSpec

    g = _rank(8, 128)
    per_chunk = g.chunk_tokens // g.block_size
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=4 * g.chunk_bytes,
                      write_queue_bytes=4 * g.chunk_bytes)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, g, "kv_last", "cuda")
        for c in caches.values():
            c.copy_(torch.randn(c.shape, device="cuda").to(c.dtype))
        src = list(range(per_chunk))
        want = [c[torch.tensor(src, device="cuda")].cpu() for c in caches.values()]
        key = b"k" * 32
        _busy_compute()
        save_step(worker, caches, [SaveSpec("r", (key,), 0, g.chunk_tokens, src)])
        assert not torch.cuda.current_stream().query()  # the compute is still running
        assert store.flush(60)  # the writer thread waited for the copies
        dest = list(range(per_chunk, 2 * per_chunk))
        _busy_compute()
        load_sync(worker, [LoadSpec("l", [ChunkLoad((key,), 0, g.chunk_tokens, 0, dest)], sync=True)])
        assert not torch.cuda.current_stream().query()
        assert not worker.take_load_errors()
        got = [c[torch.tensor(dest, device="cuda")].cpu() for c in caches.values()]  # after the layer waits
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        # A load that skips the blocks vLLM already holds and stops short of the chunk's end
        # (its prompt's last token is computed, not loaded): each plane's rows are copied from
        # the pinned buffer as they are, never through a pageable copy that waits.
        dest = list(range(2 * per_chunk, 3 * per_chunk))
        skip, take = 3, per_chunk - 5
        _busy_compute()
        load_sync(worker, [LoadSpec("l2", [ChunkLoad((key,), 0, g.chunk_tokens, skip, dest[skip:take])], sync=True)])
        assert not torch.cuda.current_stream().query()
        assert not worker.take_load_errors()
        got = [c[torch.tensor(dest[skip:take], device="cuda")].cpu() for c in caches.values()]
        assert all(torch.equal(a, b[skip:take]) for a, b in zip(got, want, strict=True))
        worker.close()


@pytest.mark.parametrize("content", ["kv_last", "cpu"])
def test_cuda_each_layer_is_saved_as_its_compute_wrote_it(tmp_path: Path, content: str) -> None:
    """As in a forward pass, each layer's KV is written on the compute stream behind about
    30 ms of device work of its own (``torch.cuda._sleep``), and then that layer's hook runs
    (the step's first two hooks enqueue nothing; the third copies the first two layers
    with its own). Every layer of every chunk is saved as written, none as the NaNs the blocks held
    before, and the host was done before the compute: the side stream waited on the device
    for each layer (a hook that did not wait would gather its layer while the compute
    stream still sleeps before writing it)."""
    from kvtier.testing.worker_rig import load_sync, save_step
    from kvtier.vllm.metadata import ChunkLoad, KVTierMetadata, LoadSpec, SaveSpec

    chunks = 2
    g = _rank(8, 5 * chunks * 16)
    per_chunk = g.chunk_tokens // g.block_size
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=4 * chunks * g.chunk_bytes,
                      write_queue_bytes=4 * chunks * g.chunk_bytes)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, g, content, "cuda")
        final = {name: torch.randn(c.shape, device="cuda").to(c.dtype) for name, c in caches.items()}
        # every kernel below runs once first: CUDA loads a kernel's code on its first launch
        # and may synchronize the device to do it, which under the queued work would fail
        # the host's check below for the wrong reason
        for name, c in caches.items():
            c.copy_(final[name])
        torch.cuda._sleep(1)
        save_step(worker, caches, [SaveSpec("w", (b"w" * 32,), 0, g.chunk_tokens,
                                            list(range(4 * chunks * per_chunk, (4 * chunks + 1) * per_chunk)))])
        assert store.flush(60)
        for c in caches.values():
            c.fill_(float("nan"))
        torch.cuda.synchronize()
        src = [list(range(j * per_chunk, (j + 1) * per_chunk)) for j in range(chunks)]
        keys = [(bytes([j + 1]) * 32,) for j in range(chunks)]
        meta = KVTierMetadata(saves=[SaveSpec("r", k, 0, g.chunk_tokens, ids) for k, ids in zip(keys, src, strict=True)])
        for name, c in caches.items():
            torch.cuda._sleep(50_000_000)  # (cycles: about 30 ms at a GPU's 1.5-2 GHz)
            c.copy_(final[name])
            worker.save_layer(meta, name)
        worker.finish_saves(meta)
        assert not torch.cuda.current_stream().query()  # the compute is still running
        assert store.flush(60)
        dest = [[b + chunks * per_chunk for b in ids] for ids in src]
        load_sync(worker, [LoadSpec("l", [ChunkLoad(k, 0, g.chunk_tokens, 0, ids)
                                          for k, ids in zip(keys, dest, strict=True)], sync=True)])
        assert not worker.take_load_errors()
        flat = torch.tensor([b for ids in src for b in ids], device="cuda")
        moved = torch.tensor([b for ids in dest for b in ids], device="cuda")
        for name, c in caches.items():
            assert torch.equal(c[moved], final[name][flat]), name
        worker.close()


@pytest.mark.parametrize("content", ["kv_last", "cpu"])
def test_cuda_back_to_back_steps_reload_what_each_step_wrote(tmp_path: Path, content: str) -> None:
    """Steps as a server runs them, never flushed or synchronized in between. Each writes
    its chunk's blocks on the compute stream behind queued work and saves them; right after
    the step the compute stream overwrites every block (only the step's fence orders that
    after the side stream's gathers); the next step loads the chunk saved one step before,
    still on its way to the disk (a host-tier hit on a buffer whose device copy may not
    have landed: the side stream's order, or the store's wait for the copy, makes it
    right). Every chunk reads back as its step wrote it."""
    from kvtier.testing.worker_rig import load_sync, save_step
    from kvtier.vllm.metadata import ChunkLoad, LoadSpec, SaveSpec

    steps = 8
    g = _rank(4, 64)
    per_chunk = g.chunk_tokens // g.block_size
    src, dest = list(range(per_chunk)), list(range(per_chunk, 2 * per_chunk))
    src_t = torch.tensor(src, device="cuda")
    dest_t = torch.tensor(dest, device="cuda")
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=steps * g.chunk_bytes,
                      write_queue_bytes=steps * g.chunk_bytes)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, g, content, "cuda")
        written = [{name: torch.randn(c.shape, device="cuda").to(c.dtype) for name, c in caches.items()}
                   for _ in range(steps)]
        for name, c in caches.items():  # every kernel once first (a first launch may synchronize)
            c.copy_(written[0][name])
            c.fill_(float("nan"))
        torch.cuda._sleep(1)
        torch.cuda.synchronize()
        keys = [(bytes([i + 1]) * 32,) for i in range(steps)]
        loaded = []
        for i in range(steps):
            torch.cuda._sleep(20_000_000)  # (cycles: about 10 ms) the forward pass so far
            if i:
                load_sync(worker, [LoadSpec(f"l{i}", [ChunkLoad(keys[i - 1], 0, g.chunk_tokens, 0, dest)],
                                            sync=True)])
                loaded.append({name: c[dest_t].clone() for name, c in caches.items()})
            for name, c in caches.items():
                c.copy_(written[i][name])  # this step's KV
            save_step(worker, caches, [SaveSpec(f"r{i}", keys[i], 0, g.chunk_tokens, src)])
            for c in caches.values():  # the blocks reused at once
                c.fill_(float("nan"))
        assert store.flush(60)
        assert not worker.take_load_errors()
        torch.cuda.synchronize()
        for i, got in enumerate(loaded):
            for name, blocks in got.items():
                assert torch.equal(blocks, written[i][name][src_t]), (i, name)
        assert len(loaded) == steps - 1
        worker.close()


@pytest.mark.parametrize("content", ["kv_last", "cpu"])
def test_cuda_a_long_prefill_steps_saves_and_load_never_wait(tmp_path: Path, content: str) -> None:
    """A Llama-3-8B-sized rank (32 layers) saving 16 chunks in one step, then loading them
    synchronously, with the forward pass queued: neither blocks the host until the compute
    is done (copied chunk by chunk, 1,536 operations queued behind the compute made CUDA
    block the thread: 140 ms on an H100), and the data round-trips."""
    from kvtier.testing.worker_rig import load_sync, save_step
    from kvtier.vllm.metadata import ChunkLoad, LoadSpec, SaveSpec

    chunks = 16
    g = _rank(32, 2 * chunks * 16)
    per_chunk = g.chunk_tokens // g.block_size
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=2 * chunks * g.chunk_bytes,
                      write_queue_bytes=2 * chunks * g.chunk_bytes)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, g, content, "cuda")
        for c in caches.values():
            c.copy_(torch.randn(c.shape, device="cuda").to(c.dtype))
        src = [list(range(j * per_chunk, (j + 1) * per_chunk)) for j in range(chunks)]
        keys = [(bytes([j + 1]) * 32,) for j in range(chunks)]
        _busy_compute()
        save_step(worker, caches, [SaveSpec("r", k, 0, g.chunk_tokens, ids) for k, ids in zip(keys, src, strict=True)])
        assert not torch.cuda.current_stream().query()  # the compute is still running
        assert store.flush(60)
        dest = [[b + chunks * per_chunk for b in ids] for ids in src]
        _busy_compute()
        load_sync(worker, [LoadSpec("l", [ChunkLoad(k, 0, g.chunk_tokens, 0, ids)
                                          for k, ids in zip(keys, dest, strict=True)], sync=True)])
        assert not torch.cuda.current_stream().query()
        assert not worker.take_load_errors()
        flat = [b for ids in src for b in ids]
        moved = [b for ids in dest for b in ids]
        assert all(torch.equal(c[torch.tensor(flat, device="cuda")], c[torch.tensor(moved, device="cuda")])
                   for c in caches.values())
        worker.close()


@pytest.mark.parametrize("saves_grouped", [True, False])
@pytest.mark.parametrize("content", ["kv_last", "cpu"])
def test_cuda_layers_copied_in_groups_through_a_small_stage_round_trip(tmp_path: Path, content: str,
                                                                       saves_grouped: bool) -> None:
    """The CPU test of the same name on CUDA: layers two per copy (saves too, or one at a
    time, the default), a stage of three chunks' groups (two batches), a partial chunk,
    hooks in reverse order, steps replayed as CUDA graphs; every chunk loads back bit-exact
    (sync, async, skipping a block)."""
    g = _rank(5, 512)
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=16 * g.chunk_bytes,
                      write_queue_bytes=16 * g.chunk_bytes, io_threads=2)
    with ChunkStore(cfg) as store:
        got = grouped_round_trip(store, g, content, "cuda", saves_grouped)
    assert (got["per_copy"], got["groups"], got["save_per_copy"]) == (2, [2, 2, 1], 2 if saves_grouped else 1)
    assert got["late_layers"] == 2 * g.layers
    assert got["failed"] == [] and got["mismatches"] == []


def test_cuda_worker_groups_a_llama_ranks_layers_eight_per_copy(tmp_path: Path) -> None:
    """On a GPU the default groups a chunk's layers for loads so each copy is about 8 MiB:
    8 layers of a 256-token chunk of a Llama-3-8B rank (1 MiB per layer), in a 72 MiB stage;
    saves go one layer at a time."""
    g = _rank(32, 64)
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=2 * g.chunk_bytes,
                      write_queue_bytes=2 * g.chunk_bytes)
    with ChunkStore(cfg) as store:
        worker, _ = make_worker(store, g, "kv_last", "cuda")
        assert (worker.per_copy, worker.save_per_copy) == (8, 1)
        assert worker._stage.numel() * worker._stage.element_size() == 72 << 20
        worker.close()


@pytest.mark.parametrize("content", ["kv_last", "cpu"])
def test_cuda_blocks_move_as_16_byte_elements_bit_for_bit(content: str) -> None:
    """On the device, a Llama-3-8B layer's bf16 blocks are gathered and scattered as 16-byte
    elements (``complex128`` standing in for a 16-byte integer) and every bit comes back,
    float64 signalling NaNs and NaN payloads included: CUDA's indexing kernels only move them."""
    from kvtier.testing.worker_rig import make_kv_caches
    from kvtier.vllm.block_rows import BlockRows
    from kvtier.vllm.layout import blocks_view

    g = _rank(1, 64)
    (kv,) = make_kv_caches(g, content, "cuda").values()
    words = kv.view(torch.int64) if kv.is_contiguous() else kv.transpose(1, 2).view(torch.int64)
    words.copy_(torch.randint(-2**62, 2**62, words.shape, device="cuda"))
    words.view(-1)[::3] = 0x7FF0_0000_0000_0001  # float64 signalling NaNs
    view = blocks_view(kv, content, g.head_dim)
    rows = BlockRows(view)
    tables = rows.tables(view)
    assert {t.dtype for t in tables} == {torch.complex128}
    chunks = [list(range(40, 56)), [3, 1, 60, 7], list(range(16, 32))]
    lists, sizes = rows.id_lists(chunks)
    plan = rows.plan(chunks, [torch.tensor(ids, device="cuda") for ids in lists], sizes)
    stage = torch.zeros((plan.stage_rows, *rows.row_shape), dtype=g.dtype, device="cuda")
    BlockRows.gather(tables, plan, stage)
    restored = torch.zeros_like(kv)
    BlockRows.scatter(rows.tables(blocks_view(restored, content, g.head_dim)), plan, stage)
    moved = sorted(b for ids in chunks for b in ids)
    assert torch.equal(restored[moved].view(torch.int16), kv[moved].view(torch.int16))
    assert not restored[[b for b in range(64) if b not in moved]].view(torch.int16).any()


def test_cuda_a_closed_or_refused_pool_unpins_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch keeps freed pinned allocations in its cache: a closed pool's memory, and the
    pieces a reservation pinned before it failed, are given back to the system (a retry with
    smaller budgets in the same process could not have used them)."""
    import gc

    from kvtier.buffer_pool import BufferPool, release_pinned_cache
    from kvtier.errors import ConfigError

    torch.cuda.init()
    if not hasattr(torch.cuda, "host_memory_stats"):
        pytest.skip("this PyTorch has no pinned-memory statistics")

    def pinned() -> int:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))

    release_pinned_cache()
    base = pinned()
    pool = BufferPool(64 << 20, pin=True)
    assert pool.reserve((1 << 20,), torch.uint8) > 0
    assert pinned() >= base + (64 << 20)
    pool.close()
    del pool
    gc.collect()
    assert pinned() <= base

    real, calls = BufferPool._new_arena, []

    def second_fails(self: BufferPool, nbytes: int, used: int) -> object:
        calls.append(nbytes)
        if len(calls) > 1:
            raise RuntimeError("CUDA error: out of memory")
        return real(self, nbytes, used)

    monkeypatch.setattr(BufferPool, "_new_arena", second_fails)
    with pytest.raises(ConfigError, match="allocating"):
        BufferPool(40 << 20, pin=True).reserve((1 << 20,), torch.uint8)
    assert len(calls) == 2 and pinned() <= base
