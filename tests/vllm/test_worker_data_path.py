"""The worker's data path on a synthetic paged KV cache: bit-exact round trips through the
real WorkerSide and ChunkStore, and no buffer allocated by any step (the worker reserves
them all when it starts)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
import torch

from kvtier import CacheConfig
from kvtier.store import ChunkStore
from kvtier.testing.worker_rig import (
    Geometry,
    ensure_metadata_base,
    long_load_from_disk,
    make_kv_caches,
    make_worker,
    save_and_reload,
    save_step,
)

REPO = Path(__file__).resolve().parents[2]

G = Geometry()
PER_CHUNK = G.chunk_tokens // G.block_size


@pytest.mark.parametrize(("content", "layer_hooks"), [("kv_last", True), ("cpu", True), ("kv_last", False)])
def test_steady_state_saves_and_loads_allocate_nothing_and_round_trip(tmp_path: Path, content: str,
                                                                      layer_hooks: bool) -> None:
    """``layer_hooks=False``: steps as a full CUDA graph replays them, with no save_kv_layer
    call; wait_for_save copies every layer then, and the chunks round-trip all the same."""
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=G.chunk_tokens, host_bytes=4 * G.chunk_bytes,
                      write_queue_bytes=4 * G.chunk_bytes, io_threads=2)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, G, content, "cpu")
        got = save_and_reload(store, worker, caches, G, layer_hooks=layer_hooks)
        late = worker.take_stats().get("save_layers_after_forward", 0)
        assert late == (0 if layer_hooks else 16 * G.layers)  # 16 steps, every layer after the forward
        assert got["mismatches"] == []  # bit-exact, block for block, into other blocks
        # every buffer was made when the worker started (one allocation, the cap's worth):
        # no step allocates, the first ones included
        # (marks: pool slots made, index buffers made, after each step)
        reserved = store.pool.cap_bytes // G.chunk_bytes
        marks = got["save_marks"]
        assert {m[0] for m in marks} == {reserved}, f"buffers allocated by saves: {marks} (reserved {reserved})"
        assert marks[-1][1] == marks[3][1], f"index buffers grew after warm-up: {marks}"
        marks = got["load_marks"]
        assert {m[0] for m in marks} == {reserved}, f"buffers allocated while loading: {marks}"
        assert marks[-1][1] == marks[7][1], f"index buffers grew after warm-up: {marks}"
        assert store.pool.allocated_bytes <= store.pool.cap_bytes
        assert store.counters.snapshot()["dropped_saves"] == 0
        worker.close()


@pytest.mark.parametrize("saves_grouped", [True, False])
@pytest.mark.parametrize("content", ["kv_last", "cpu"])
def test_layers_copied_in_groups_through_a_small_stage_round_trip(tmp_path: Path, content: str,
                                                                  saves_grouped: bool) -> None:
    """Layers moved two at a time (five layers: groups of 2, 2 and 1), through a stage that
    holds three chunks' groups (five chunks: two batches), a partial chunk among them, hooks
    called in reverse order, a step replayed as a CUDA graph (no hook) and a one-chunk one
    (whose gathers all go first): every chunk loads back bit-exact, synchronously (first
    group one layer), asynchronously, and skipping its first block (tests/gpu runs the same
    on CUDA). Saves grouped the same way, or one layer at a time (a GPU's default) while
    loads group."""
    from kvtier.testing.worker_rig import grouped_round_trip

    g = Geometry(layers=5, num_blocks=256)
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=16 * g.chunk_bytes,
                      write_queue_bytes=16 * g.chunk_bytes, io_threads=2)
    with ChunkStore(cfg) as store:
        got = grouped_round_trip(store, g, content, "cpu", saves_grouped)
    assert (got["per_copy"], got["groups"], got["sync_groups"]) == (2, [2, 2, 1], [1, 2, 2])
    assert got["save_per_copy"] == (2 if saves_grouped else 1)
    assert got["stage_rows"] == 3 * 3 * got["rows_per_chunk"]  # 3 groups of 2 slots + scratch
    assert got["late_layers"] == 2 * g.layers
    assert got["failed"] == [] and got["mismatches"] == []
    assert got["loaded"] == 2 * 11 + 1


@pytest.mark.parametrize("offline", [False, True])
def test_a_steps_saves_reach_the_writer_together(tmp_path: Path, offline: bool) -> None:
    """wait_for_save hands the step's chunks to the store in one ``put_batch``: the writer,
    woken once, takes them as one batch (woken per chunk it took the first alone, and took
    the GIL and the queue's lock from the model's thread between the puts). So does an
    offline producer's step (``save_wait_s``: its puts may wait for room, and there is room)."""
    from kvtier.vllm.metadata import SaveSpec

    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=G.chunk_tokens, host_bytes=4 * G.chunk_bytes,
                      write_queue_bytes=4 * G.chunk_bytes, commit_bytes=4 * G.chunk_bytes)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, G, "kv_last", "cpu", save_wait_s=30.0 if offline else 0.0)
        batches: list[int] = []
        put_many, put = store.backend.put_many, store.put
        store.backend.put_many = lambda items: (batches.append(len(items)), put_many(items))[1]  # type: ignore[method-assign]

        def slow_put(*args: object, **kwargs: object) -> bool:  # time for a woken writer to take the chunk
            ok = put(*args, **kwargs)  # type: ignore[arg-type]
            time.sleep(0.1)
            return ok

        store.put = slow_put  # type: ignore[method-assign]
        save_step(worker, caches, [SaveSpec("r", (os.urandom(32),), 0, G.chunk_tokens,
                                            list(range(j * PER_CHUNK, (j + 1) * PER_CHUNK))) for j in range(4)])
        assert store.flush(30)
        assert batches == [4]
        worker.close()


def test_a_worker_whose_buffers_the_host_cannot_hold_does_not_start(
        tmp_path: Path, beyond_this_machine: int,
        forbid_pool_allocations: Callable[[], AbstractContextManager[None]]) -> None:
    """host_bytes beyond the machine's memory: the worker (which reserves every buffer when
    it starts) refuses to start, saying which settings to lower, instead of being killed by
    the kernel while it touches them (here an allocation fails the test instead); the store
    it was given stays usable."""
    from kvtier.errors import ConfigError

    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=G.chunk_tokens, host_bytes=beyond_this_machine)
    with ChunkStore(cfg) as store:
        with forbid_pool_allocations(), pytest.raises(ConfigError, match="cannot reserve its chunk buffers.*Lower host_bytes"):
            make_worker(store, G, "kv_last", "cpu")
        assert store.pool.allocated_bytes == 0
        chunk = torch.ones((G.layers, 2, G.chunk_tokens, G.kv_heads, G.head_dim), dtype=G.dtype)
        assert store.put(b"k" * 32, chunk, namespace_id=bytes(16), token_start=0, num_tokens=G.chunk_tokens)
        store.flush()
        assert store.counters.snapshot()["saves_committed"] == 1


def test_the_device_stage_is_sized_by_device_stage_bytes_and_never_below_a_chunk(tmp_path: Path) -> None:
    """``device_stage_bytes`` (connector setting) sizes the worker's stage; unset, it holds
    BATCH_BYTES of a batch per layer slot and scratch; too small, what one chunk's every
    layer needs. ``device_copy_bytes`` is read beside it (0: one layer per copy, also on a
    GPU, where grouped copies are the default)."""
    from kvtier.vllm.block_rows import BATCH_BYTES
    from kvtier.vllm.settings import ConnectorSettings

    def stage_bytes(worker) -> int:  # noqa: ANN001
        return worker._stage.numel() * worker._stage.element_size()

    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=G.chunk_tokens, host_bytes=4 * G.chunk_bytes,
                      write_queue_bytes=4 * G.chunk_bytes)
    given = ConnectorSettings.from_extra_config({"path": str(cfg.path), "device_stage_bytes": "3M",
                                                 "device_copy_bytes": 0})
    assert (given.device_stage_bytes, given.device_copy_bytes) == (3 << 20, 0)
    default = ConnectorSettings.from_extra_config({"path": str(cfg.path)})
    assert (default.device_stage_bytes, default.device_copy_bytes) == (None, None)
    assert ConnectorSettings.from_extra_config({"path": str(cfg.path), "device_copy_bytes": "8M"}).device_copy_bytes == 8 << 20
    with ChunkStore(cfg) as store:
        for stage, copy_bytes, want in ((given.device_stage_bytes, None, 3 << 20),
                                        (None, None, BATCH_BYTES),  # one layer per copy: no scratch
                                        (None, G.chunk_bytes, BATCH_BYTES * (G.layers + 1)),
                                        (1, None, G.chunk_bytes)):  # (at least one chunk's every layer)
            worker, _ = make_worker(store, G, "kv_last", "cpu", stage_bytes=stage, copy_bytes=copy_bytes)
            assert stage_bytes(worker) == want, (stage, copy_bytes)
            worker.close()


@pytest.mark.parametrize(("content", "grouped"), [("kv_last", False), ("kv_last", True), ("cpu", False)])
def test_the_worker_runs_every_copy_kernel_once_when_it_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                content: str, grouped: bool) -> None:
    """CUDA loads a kernel's code on its first launch and may synchronize the device to do it
    (115 ms behind a queued forward pass on an H100), so the worker runs its copies once at
    start-up. PyTorch's CUDA ``index_select`` has one kernel for up to 16 indices and another
    above: the start-up copies use both, on every table (``grouped``: loads through the
    scratch, saves, one layer at a time, straight into the stage: both ways are run)."""
    from kvtier.vllm.block_rows import BlockRows

    counts: dict[str, list[list[int]]] = {"gather": [], "scatter": []}
    scratch: set[bool] = set()  # whether each plan run went through the scratch
    for name in counts:
        real = getattr(BlockRows, name)

        def logged(tables, plan, stage, slot=0, _real=real, _name=name):  # noqa: ANN001, ANN202
            counts[_name].append([rows.numel() for rows in plan.rows])
            scratch.add(plan.slots is not None)
            return _real(tables, plan, stage, slot)

        monkeypatch.setattr(BlockRows, name, staticmethod(logged))
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=G.chunk_tokens, host_bytes=4 * G.chunk_bytes,
                      write_queue_bytes=4 * G.chunk_bytes)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, G, content, "cpu", copy_bytes=G.chunk_bytes if grouped else None)
        assert (worker.per_copy, worker.save_per_copy) == (G.layers if grouped else 1, 1)
        assert scratch == ({False, True} if grouped else {False})
        assert all(torch.count_nonzero(c) == 0 for c in caches.values())  # read and written back unchanged
        for name, calls in counts.items():
            assert any(max(c) <= 16 for c in calls), (name, calls)
            assert any(min(c) > 16 for c in calls), (name, calls)
        worker.close()


def test_a_layer_indexed_as_other_elements_has_its_kernels_run_at_start_too(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer whose memory starts 8 bytes off a 16-byte boundary (memory PyTorch did not
    allocate) is indexed as 8-byte elements, the others as 16-byte ones: the start-up copies
    run both kinds of tables, so no kernel is first launched in a step; and its blocks still
    save and load bit for bit."""
    import numpy as np

    from kvtier.keys import Namespace
    from kvtier.vllm.block_rows import BlockRows

    ensure_metadata_base()
    from kvtier.vllm.worker_side import WorkerSide

    kinds: set[tuple[torch.dtype, ...]] = set()
    real = BlockRows.gather

    def logged(tables, plan, stage, slot=0):  # noqa: ANN001, ANN202
        kinds.add(tuple(t.dtype for t in tables))
        return real(tables, plan, stage, slot)

    monkeypatch.setattr(BlockRows, "gather", staticmethod(logged))
    caches = make_kv_caches(G, "cpu", "cpu")
    shape, nbytes = caches["layer.1"].shape, caches["layer.1"].numel() * G.dtype.itemsize
    raw = np.zeros(nbytes + 64, dtype=np.uint8)
    start = (8 - raw.ctypes.data % 16) % 16
    caches["layer.1"] = torch.from_numpy(raw[start : start + nbytes]).view(G.dtype).view(shape)
    for c in caches.values():
        c.copy_(torch.randn(c.shape))
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=G.chunk_tokens, host_bytes=4 * G.chunk_bytes,
                      write_queue_bytes=4 * G.chunk_bytes)
    with ChunkStore(cfg) as store:
        ns = Namespace(model="worker-rig", weights_fingerprint="sha256:rig", dtype="float32",
                       kv_shape=(G.layers, 2, G.kv_heads, G.head_dim), chunk_tokens=G.chunk_tokens)
        worker = WorkerSide(store, ns, list(caches), caches, "cpu", G.block_size)
        assert [tables[0].dtype for tables in worker.tables] == [torch.complex128, torch.int64] + [torch.complex128] * 2
        assert kinds == {(torch.complex128,), (torch.int64,)}
        got = save_and_reload(store, worker, caches, G)
        assert got["mismatches"] == []
        worker.close()


def test_a_micro_batched_forward_pass_is_saved_after_it_whole(tmp_path: Path) -> None:
    """With dual-batch overlap vLLM runs a forward pass as two micro-batches, on threads that
    take turns layer by layer, and each calls save_kv_layer for each layer after writing its
    own part of that layer's KV. Taken as "this layer is written", the first call would copy
    the second micro-batch's blocks before they hold their new KV, and that chunk would be
    stored with a valid checksum. The connector tells the worker to ignore the hooks there
    (``layer_hooks=False``): every layer is copied in wait_for_save, after both."""
    from kvtier.vllm.metadata import KVTierMetadata, SaveSpec

    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=G.chunk_tokens, host_bytes=4 * G.chunk_bytes,
                      write_queue_bytes=4 * G.chunk_bytes)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, G, "kv_last", "cpu", layer_hooks=False)
        micro = [list(range(PER_CHUNK)), list(range(PER_CHUNK, 2 * PER_CHUNK))]  # one request each
        keys = [os.urandom(32), os.urandom(32)]
        meta = KVTierMetadata(saves=[SaveSpec(f"r{i}", (k,), 0, G.chunk_tokens, ids)
                                     for i, (k, ids) in enumerate(zip(keys, micro, strict=True))])
        gen = torch.Generator().manual_seed(3)
        for name, cache in caches.items():  # layer by layer, the micro-batches in turn
            for ids in micro:
                for b in ids:
                    cache[b].copy_(torch.randn(cache[b].shape, generator=gen))
                worker.save_layer(meta, name)
        worker.finish_saves(meta)
        assert store.flush(30)
        store.host.clear()
        for key, ids in zip(keys, micro, strict=True):
            got = store.load(key).tensor
            for li, cache in enumerate(caches.values()):  # [blocks, H, N, 2D] against [2, tokens, H, D]
                want = cache[torch.tensor(ids)]
                assert torch.equal(got[li][0], want[..., : G.head_dim].transpose(1, 2).reshape(-1, G.kv_heads, G.head_dim))
                assert torch.equal(got[li][1], want[..., G.head_dim :].transpose(1, 2).reshape(-1, G.kv_heads, G.head_dim))
        assert worker.take_stats()["save_layers_after_forward"] == G.layers
        worker.close()


def _stored_on_disk(store: ChunkStore, worker, caches: dict[str, torch.Tensor], n: int) -> list[bytes]:  # noqa: ANN001
    """Save ``n`` chunks (blocks ``0 .. n * PER_CHUNK``, four per step) and empty the host
    tier: a load of them reads the disk. Their keys."""
    from kvtier.vllm.metadata import SaveSpec

    keys = [os.urandom(32) for _ in range(n)]
    for first in range(0, n, 4):
        save_step(worker, caches, [SaveSpec("r", (keys[i],), i * G.chunk_tokens, G.chunk_tokens,
                                            list(range(i * PER_CHUNK, (i + 1) * PER_CHUNK)))
                                   for i in range(first, min(n, first + 4))])
        assert store.flush(30)
    store.host.clear()
    return keys


@contextlib.contextmanager
def _on_disk(tmp_path: Path, n: int, host_chunks: int, **cfg_args: object):  # noqa: ANN202
    """A store and a worker over 16 chunks' blocks, ``n`` chunks saved to disk and the host
    tier emptied (see ``_stored_on_disk``): ``(store, worker, keys)``."""
    g = Geometry(num_blocks=16 * PER_CHUNK)
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=host_chunks * g.chunk_bytes,
                      write_queue_bytes=4 * g.chunk_bytes, io_threads=2, **cfg_args)  # type: ignore[arg-type]
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, g, "kv_last", "cpu")
        yield store, worker, _stored_on_disk(store, worker, caches, n)


def _slow_reads(store: ChunkStore, hold: threading.Event | None = None) -> list[bytes]:
    """Make the store's reads slow (50 ms each; past the second, held until ``hold`` is
    set, if given): the keys read, in order, as they begin."""
    reads: list[bytes] = []
    real = store.load

    def slow(key: bytes, *args: object, **kwargs: object) -> object:
        reads.append(key)
        if hold is not None and len(reads) > 2:
            hold.wait(60)
        time.sleep(0.05)
        return real(key, *args, **kwargs)

    store.load = slow  # type: ignore[method-assign]
    return reads


def _load_spec(req: str, keys: list[bytes], first_block: int):  # noqa: ANN202
    from kvtier.vllm.metadata import ChunkLoad, LoadSpec

    return LoadSpec(req, [ChunkLoad((k,), i * G.chunk_tokens, G.chunk_tokens, 0,
                                    list(range(first_block + i * PER_CHUNK, first_block + (i + 1) * PER_CHUNK)))
                          for i, k in enumerate(keys)])


@pytest.mark.parametrize("case", ["reading", "past a miss", "hung read"])
def test_closing_the_worker_stops_its_loads(tmp_path: Path, case: str) -> None:
    """A server shutting down closes the worker with asynchronous loads in flight: they stop
    at their next chunk, also past a missing one (where the rest is read only to find bad
    records), instead of reading on to the end; and a read that hangs (a network file
    system) holds ``close`` no longer than the store's ``close_timeout_s``."""
    from kvtier.vllm.metadata import KVTierMetadata

    with _on_disk(tmp_path, 8, 64, close_timeout_s=1.0) as (store, worker, keys):
        cfg = store.config
        hung = threading.Event()
        reads = _slow_reads(store, hung if case == "hung read" else None)
        ks = (keys * 5)[:40] if case != "past a miss" else [os.urandom(32)] + (keys * 5)[:39]
        worker.start_loads(KVTierMetadata(loads=[_load_spec("a", ks, 8 * PER_CHUNK)]))
        time.sleep(0.2)
        t, before = time.monotonic(), len(reads)
        worker.close()
        took = time.monotonic() - t
        hung.set()
        time.sleep(0.3)  # (reads already under way finish)
        # at most the reads already asked for (the read-ahead, one per I/O thread) and a few
        # that began as the test counted (33-36 more before these changes)
        assert len(reads) - before <= worker._read_ahead + cfg.io_threads + 4, (before, len(reads))
        assert took < cfg.close_timeout_s + 2.0, took  # (a hung read held it for good)
        assert worker._loads == {}


def test_a_load_whose_request_was_aborted_stops_reading(tmp_path: Path) -> None:
    """A request aborted while its asynchronous load reads (the client went away) comes in
    ``finished_req_ids``; vLLM holds its blocks until the load is reported. The load stops at
    its next chunk instead of reading the whole prompt, copies nothing more, and is reported
    soon, with no blocks reported failed (the request is gone)."""
    from kvtier.vllm.metadata import KVTierMetadata

    with _on_disk(tmp_path, 8, 64) as (store, worker, keys):
        cfg = store.config
        reads = _slow_reads(store)
        worker.start_loads(KVTierMetadata(loads=[_load_spec("a", (keys * 5)[:40] + [os.urandom(32)], 8 * PER_CHUNK)]))
        time.sleep(0.2)
        before = len(reads)
        done: set[str] = set()
        deadline = time.monotonic() + 30
        finished = {"a"}  # (vLLM passes a finished request once)
        while "a" not in done and time.monotonic() < deadline:
            _, got = worker.get_finished(finished)
            finished = set()
            done |= got or set()
            time.sleep(0.01)
        assert "a" in done
        # at most the reads already asked for (the read-ahead, one per I/O thread) and a few
        # that began as the test counted (33-36 more before these changes)
        assert len(reads) - before <= worker._read_ahead + cfg.io_threads + 4, (before, len(reads))
        assert worker.take_load_errors() == set()  # (not even the missing last chunk's blocks)
        assert worker._loads == {} and worker._arrived_slots._value == worker._arrived_max
        worker.close()


@pytest.mark.parametrize("sync", [False, True])
def test_a_load_whose_read_hangs_gives_up_after_read_timeout(tmp_path: Path, sync: bool) -> None:
    """A chunk read that never returns (a hung network mount) costs its load at most the
    store's ``read_timeout_s``: what was read before it is copied, its blocks and the later
    ones are reported failed (vLLM recomputes them), and the request is not held for good
    (an asynchronous load was never reported; a synchronous one held the model's thread)."""
    import dataclasses

    from kvtier.testing.worker_rig import load_sync, wait_reported
    from kvtier.vllm.metadata import KVTierMetadata

    with _on_disk(tmp_path, 4, 16, read_timeout_s=0.4) as (store, worker, keys):
        hung = threading.Event()
        reads = _slow_reads(store, hung)  # (reads past the second hang)
        spec = _load_spec("a", keys, 8 * PER_CHUNK)
        worker.take_stats()
        t = time.monotonic()
        if sync:
            load_sync(worker, [dataclasses.replace(spec, sync=True)])
        else:
            worker.start_loads(KVTierMetadata(loads=[spec]))
            wait_reported(worker, "a", timeout=30)
        took = time.monotonic() - t
        hung.set()
        assert 0.4 <= took < 5.0, took
        assert len(reads) >= 3
        assert worker.take_load_errors() == {b for chunk in spec.chunks[2:] for b in chunk.block_ids}
        stats = worker.take_stats()
        assert stats["load_tokens"] == 2 * G.chunk_tokens  # the two read before it were copied
        assert stats["store_read_timeouts"] == 1 and "store_corrupt_records" not in stats
        worker.close()


def test_a_finished_load_whose_copies_cannot_be_marked_is_still_reported(tmp_path: Path) -> None:
    """The event after an asynchronous load's last copies cannot be recorded (a CUDA error,
    which vLLM does not survive): the error reaches the caller, and the load, which has left
    the worker's loads, is still reported at the next look, every block failed (before, it
    was never reported: vLLM would wait for it for good)."""
    from kvtier.vllm.metadata import KVTierMetadata

    with _on_disk(tmp_path, 2, 16) as (_, worker, keys):
        spec = _load_spec("a", keys, 8 * PER_CHUNK)
        worker.start_loads(KVTierMetadata(loads=[spec]))
        worker._loads["a"].future.result(timeout=30)  # read: the next look takes it and finishes it

        def broken() -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        worker.copies.record = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="CUDA error"):
            worker.get_finished(set())
        del worker.copies.record  # (the class's again)
        assert worker._loads == {}
        _, done = worker.get_finished(set())
        assert done == {"a"}
        assert worker.take_load_errors() == {b for chunk in spec.chunks for b in chunk.block_ids}
        worker.close()


def test_a_record_larger_than_the_reserved_buffers_leaves_them_as_they_are(tmp_path: Path) -> None:
    """The worker reserves every pool buffer at start-up, sized for its chunks. A record of
    a larger shape found under a key (another geometry's, a damaged store's) is read into
    memory of its own and refused: the reserved buffers keep their size and number (else
    every later buffer would be a new allocation, pinned, on the model's thread)."""
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=G.chunk_tokens, host_bytes=4 * G.chunk_bytes,
                      write_queue_bytes=4 * G.chunk_bytes)
    with ChunkStore(cfg) as store:
        worker, _ = make_worker(store, G, "kv_last", "cpu")
        before = (store.pool.chunk_bytes, store.pool.free_slots, store.pool.created)
        key = os.urandom(32)
        big = torch.randn(2 * G.layers, 2, G.chunk_tokens, G.kv_heads, G.head_dim)
        assert store.put(key, big, namespace_id=worker.namespace.id, token_start=0, num_tokens=G.chunk_tokens)
        assert store.flush(30)
        store.host.clear()
        got = store.load(key)
        assert got.tensor is not None and torch.equal(got.tensor, big)  # (the store's reads are whole)
        assert not worker._usable(_load_spec("a", [key], 0).chunks[0], got)  # not this rank's shape
        del got
        store.host.clear()
        assert (store.pool.chunk_bytes, store.pool.free_slots, store.pool.created) == before
        assert store.counters.snapshot()["unpooled_loads"] == 1
        worker.close()


def test_a_warning_about_a_failed_copy_keeps_no_chunk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed copy is logged with its message only: a handler that keeps records (a
    MemoryHandler) would otherwise keep the exception, whose frames hold the chunks' pool
    buffers, and the pool would run dry."""
    import logging

    from kvtier.vllm import worker_side
    from kvtier.vllm.metadata import KVTierMetadata

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=G.chunk_tokens, host_bytes=8 * G.chunk_bytes,
                      write_queue_bytes=4 * G.chunk_bytes, io_threads=2)
    keep = Keep()
    logging.getLogger("kvtier").addHandler(keep)
    try:
        with ChunkStore(cfg) as store:
            worker, caches = make_worker(store, G, "kv_last", "cpu")
            keys = _stored_on_disk(store, worker, caches, 4)

            def failing(*args: object) -> None:
                raise RuntimeError("an injected device error")

            monkeypatch.setattr(worker_side.BlockRows, "scatter", staticmethod(failing))
            worker.start_loads(KVTierMetadata(loads=[_load_spec("f", keys, 4 * PER_CHUNK)]))
            from kvtier.testing.worker_rig import wait_reported

            wait_reported(worker, "f")
            assert worker.take_load_errors()  # the blocks are recomputed
            warned = [r for r in records if "copying loaded KV" in r.getMessage()]
            assert warned and all(isinstance(a, str) for r in warned for a in (r.args or ()))
            worker.close()
    finally:
        logging.getLogger("kvtier").removeHandler(keep)


def test_an_index_buffer_taken_by_a_save_plan_that_failed_is_given_back(tmp_path: Path) -> None:
    """A step's block ids go to the device through a reused index buffer; one taken by a
    step whose planning failed (the connector logs it and the step goes on) is given back,
    not lost, so the next steps do not make new ones."""
    from kvtier.vllm.metadata import KVTierMetadata, SaveSpec

    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=G.chunk_tokens, host_bytes=4 * G.chunk_bytes,
                      write_queue_bytes=4 * G.chunk_bytes)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, G, "kv_last", "cpu")
        real = worker._plan_rows

        def fails_once(*args: object) -> object:
            worker._plan_rows = real
            raise RuntimeError("an unforeseen fault")

        worker._plan_rows = fails_once
        spec = SaveSpec("r", (os.urandom(32),), 0, G.chunk_tokens, list(range(PER_CHUNK)))
        meta = KVTierMetadata(saves=[spec])
        worker.save_layer(meta, "layer.0")  # (the step's first two hooks plan nothing)
        worker.save_layer(meta, "layer.1")
        with pytest.raises(RuntimeError, match="unforeseen"):
            worker.save_layer(meta, "layer.2")
        for step in range(3):  # (the next steps plan, and then it works)
            save_step(worker, caches, [SaveSpec("r", (os.urandom(32),), 0, G.chunk_tokens,
                                                list(range(step * PER_CHUNK, (step + 1) * PER_CHUNK)))])
        assert len(worker._save_index._all) == 1  # (on the CPU a buffer is free again at once)
        assert store.flush(30)
        worker.close()


@pytest.mark.parametrize(("content", "sync"), [("kv_last", False), ("cpu", False), ("kv_last", True)])
def test_a_long_load_from_disk_stays_in_the_pool(tmp_path: Path, content: str, sync: bool) -> None:
    """Three times as many chunks as the buffer pool holds, loaded in one load (asynchronous,
    polled as vLLM polls it; or synchronous, before a step): bit-exact, and no chunk lands
    outside the pool (tests/gpu runs the same on CUDA, where such a chunk would be pageable
    memory)."""
    g = Geometry(num_blocks=2 * 48 * PER_CHUNK)
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=12 * g.chunk_bytes,
                      write_queue_bytes=4 * g.chunk_bytes, io_threads=2)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, g, content, "cpu")
        got = long_load_from_disk(store, worker, caches, g, chunks=48, sync=sync)
        assert got["mismatches"] == [] and got["failed_blocks"] == []
        assert got["unpooled_loads"] == 0
        assert store.counters.snapshot()["hits_disk"] == 48
        worker.close()


def test_on_a_gpu_only_a_step_without_a_forward_pass_waits_for_a_pending_load(tmp_path: Path) -> None:
    """While an asynchronous load is pending and no chunk has arrived, ``get_finished`` waits
    briefly for the readers (handing them the GIL) in a step that ran no forward pass
    (``idle``: the engine has nothing else to do). In a step with one it waits on the CPU
    (the readers share its cores) and, as on a GPU (``busy_step_load_wait`` off), returns at
    once, so the next step is not delayed."""
    from kvtier.testing.worker_rig import wait_reported
    from kvtier.vllm.metadata import ChunkLoad, KVTierMetadata, LoadSpec, SaveSpec

    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=G.chunk_tokens, host_bytes=4 * G.chunk_bytes,
                      write_queue_bytes=4 * G.chunk_bytes, io_threads=2)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, G, "kv_last", "cpu")
        key = os.urandom(32)
        save_step(worker, caches, [SaveSpec("r", (key,), 0, G.chunk_tokens, list(range(PER_CHUNK)))])
        assert store.flush(30)
        gate = threading.Event()
        load_many = store.load_many

        def held(*args: object, **kwargs: object) -> object:  # the disk is slow: nothing arrives yet
            gate.wait(30)
            return load_many(*args, **kwargs)  # type: ignore[arg-type]

        store.load_many = held  # type: ignore[method-assign]
        waits: list[float] = []
        wait = worker._load_signal.wait
        worker._load_signal.wait = lambda timeout=None: (waits.append(timeout), wait(timeout))[1]  # type: ignore[method-assign]
        worker.start_loads(KVTierMetadata(loads=[LoadSpec("a", [ChunkLoad((key,), 0, G.chunk_tokens, 0,
                                                                           list(range(PER_CHUNK, 2 * PER_CHUNK)))])]))
        assert worker.busy_step_load_wait  # (the CPU)
        assert worker.get_finished(set(), idle=False) == (None, None)
        assert len(waits) == 1
        worker.busy_step_load_wait = False  # as on a GPU
        assert worker.get_finished(set(), idle=False) == (None, None)
        assert len(waits) == 1
        assert worker.get_finished(set(), idle=True) == (None, None)
        assert len(waits) == 2
        gate.set()
        wait_reported(worker, "a")
        assert not worker.take_load_errors()
        worker.close()


def test_a_load_reading_ahead_of_the_steps_waits_for_them(tmp_path: Path) -> None:
    """While the engine makes no step (a long forward pass), a load's reader hands over only
    as many chunks as may wait for their copies, then waits, instead of reading on into new
    memory; once the steps come, the load completes, bit-exact, all inside the pool."""
    g = Geometry(num_blocks=2 * 48 * PER_CHUNK)
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=12 * g.chunk_bytes,
                      write_queue_bytes=4 * g.chunk_bytes, io_threads=2)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, g, "kv_last", "cpu")
        got = long_load_from_disk(store, worker, caches, g, chunks=48, idle_s=0.5)
        assert got["idle_waiting"] == worker._arrived_max < 48 and not got["idle_done"]
        assert got["mismatches"] == [] and got["failed_blocks"] == []
        assert got["unpooled_loads"] == 0
        worker.close()


def test_several_loads_at_once_stay_in_the_pool_together(tmp_path: Path) -> None:
    """As many asynchronous loads at once as there are I/O threads, during a long forward
    pass (no step takes their chunks), with a pool as the defaults size it (32 chunks, 4 I/O
    threads): together they read ahead and hold no more buffers than one load would, so no
    chunk lands outside the pool (before, 12 of 48 did); bit-exact."""
    g = Geometry(num_blocks=2 * 48 * PER_CHUNK)
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=32 * g.chunk_bytes,
                      write_queue_bytes=4 * g.chunk_bytes, io_threads=4)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, g, "kv_last", "cpu")
        got = long_load_from_disk(store, worker, caches, g, chunks=48, idle_s=0.5, requests=4)
        assert got["mismatches"] == [] and got["failed_blocks"] == []
        assert got["unpooled_loads"] == 0
        assert store.counters.snapshot()["hits_disk"] == 48
        worker.close()


def test_the_gpu_benchmark_runs_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/gpu_bench.py in its smoke size: it runs, loads what it saved (it asserts
    that), and its pool stays within its cap. (Whether the warm pass allocates depends on how
    far the writer thread lags on a loaded machine; the steady-state test above checks a
    schedule where it cannot.)"""
    out = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_bench.py"), "--device", "cpu",
                          "--smoke", "--dir", str(tmp_path / "w"), "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["content"] for r in rows] == ["kv_last", "cpu"]
    for r in rows:
        assert r["pool_slots"] <= r["pool_cap_slots"] and r["dropped_saves"] == 0
        assert r["save_gbs"] > 0 and r["host_load_gbs"] > 0 and r["cold_load_gbs"] > 0
        assert r["cold_load_async_gbs"] > 0
        assert 0 < r["hook_after_share"] <= 1  # (the hooks come inside each layer, after its attention)
    report = json.loads(out.read_text())
    for c in ("kv_last", "cpu"):  # the smoke geometry is float32, rows of 16 bytes or more
        x = report["indexing"][c]
        assert x["index_kvtier_type"] == "complex128"
        assert set(x["gather_gbs"]) == set(x["scatter_gbs"]) == {"float32", "int64", "complex128"}
        assert min(x["gather_gbs"].values()) > 0 and min(x["scatter_gbs"].values()) > 0
        # each part of a save's side-stream work, beside a forward pass it did not break
        parts = report["interference"][c]
        assert set(parts) == {"gather_float32", "gather_int64", "gather_complex128", "copies", "save", "gather_inline",
                              "forward_ms"}
        assert parts.pop("forward_ms") > 0
        for part in parts.values():
            assert all(math.isfinite(v) for v in part.values()) and part["low"] <= part["overhead"] <= part["high"]
    assert "indexing ops on the device" in res.stdout and "side stream beside a forward pass" in res.stdout
    only = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_bench.py"), "--device", "cpu", "--smoke",
                           "--index-only", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert only.returncode == 0, only.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["indexing"]) == set(report["interference"]) == {"kv_last", "cpu"} and "rows" not in report


def test_the_gpu_benchmark_reads_a_saves_device_costs_from_a_trace(tmp_path: Path) -> None:
    """``gpu_bench.trace_costs`` (what ``--trace`` prints on a GPU; a CPU trace has no device
    timeline): per kind of step, the compute stream's idle time beyond the plain step's, and
    how long after its last kernel the side stream's last kernel (the gathers) and its last
    copy ended. A hand-made trace in PyTorch's Chrome format, times in µs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "benchmarks" / "gpu_bench.py")
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]

    def ev(cat: str, ts: float, dur: float, stream: int = 7, name: str = "k") -> dict[str, object]:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    events = [
        ev("user_annotation", 0, 500, name="step_plain"),
        ev("kernel", 10, 100), ev("kernel", 120, 100),  # 10 idle
        ev("user_annotation", 1000, 600, name="step_prefill"),
        ev("kernel", 1010, 100), ev("kernel", 1160, 100),  # 50 idle: 40 more than plain
        ev("kernel", 1260, 20, stream=13), ev("gpu_memcpy", 1280, 200, stream=13),
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = bench.trace_costs(trace)
    assert got == pytest.approx({"trace_gap_ms_prefill": 0.04, "trace_gathers_ms_prefill": 0.02,
                                 "trace_tail_ms_prefill": 0.22})


def test_the_hook_host_benchmark_runs_side_by_side(tmp_path: Path) -> None:
    """benchmarks/hook_host_bench.py, small: this checkout against itself (``--against``),
    each run in its own process, every time measured."""
    out = tmp_path / "hooks.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "hook_host_bench.py"), "--chunks", "2",
                          "--steps", "3", "--rounds", "1", "--against", str(REPO), "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["code"] for r in rows] == ["this checkout", "--against"]
    assert all(r["wait_for_save_ms"] > 0 and r["step_ms"] >= r["save_layer_ms"] for r in rows)
    # (the third plans; the first two enqueue nothing)
    assert all(0 < r["first_hook_ms"] < r["third_hook_ms"] and r["second_hook_ms"] < r["third_hook_ms"] for r in rows)
    assert all(r["first_hook_ops"] == r["second_hook_ops"] == 0 < r["third_hook_ops"] for r in rows)


def test_the_writer_interference_benchmark_runs(tmp_path: Path) -> None:
    """benchmarks/hook_host_bench.py --writer, small: the model thread's loop timed with the
    store idle and for as long as it writes, each round in a fresh process, two checkouts
    (here the same one twice) in turn, with the time the loop's thread slept for the GIL."""
    out = tmp_path / "writer.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "hook_host_bench.py"), "--writer", "--chunks", "2",
                          "--rounds", "1", "--against", str(REPO), "--backend", "lmdb", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(r["round"], r["code"], r["store"]) for r in rows] == [
        (1, "this checkout", "idle"), (1, "this checkout", "writing"), (1, "--against", "idle"), (1, "--against", "writing")]
    assert all(0 < r["op_p50_us"] <= r["op_p99_us"] <= r["op_p999_us"] <= r["op_max_us"] < r["loop_ms"] * 1e3 for r in rows)
    assert all(r["ops"] >= 100 and r["pinned"] == (len(os.sched_getaffinity(0)) > 1) for r in rows)
    # (the idle loop's length is fixed; the writing one's is the write's)
    assert all(r["ops"] == 20_000 for r in rows if r["store"] == "idle")
    for r in rows:  # slept for the GIL: counted on Linux, and never more time than the loop took
        assert r["gil_waits"] >= 0 and 0 <= r["gil_wait_ms"] <= r["loop_ms"]
        assert (r["gil_wait_ms"] > 0) == (r["gil_waits"] > 0)
    assert all(r["gil_wait_us_per_chunk"] == pytest.approx(r["gil_wait_ms"] * 1e3 / 2) for r in rows if r["store"] == "writing")
    assert "| 1 | --against | writing" in res.stdout and "(lmdb)" in res.stdout


@pytest.mark.skipif(not hasattr(__import__("resource"), "RUSAGE_THREAD"), reason="Linux counts sleeps per thread")
def test_the_writer_benchmark_counts_the_model_threads_waits_for_the_gil() -> None:
    """What ``hook_host_bench --writer`` reports rests on this: the loop's thread's sleeps
    for the GIL are counted. With another thread running Python all the while, the two
    take turns at the GIL: each asks it of the other after the switch interval (5 ms), so
    over 100 ms the loop waits, for a good part of that time."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import hook_host_bench
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=busy)
    spinner.start()
    try:
        end = time.perf_counter() + 0.1
        m = hook_host_bench.op_loop(lambda ops: time.perf_counter() > end)
    finally:
        stop.set()
        spinner.join()
    assert m["ops"] >= hook_host_bench.OPS_PER_CHECK and m["loop_ms"] >= 80  # (its own set-up after `end`)
    assert m["gil_waits"] > 0 and m["gil_wait_ms"] > 0.2 * m["loop_ms"], m


def test_a_step_reads_no_index_and_skips_what_is_stored_or_queued(tmp_path: Path) -> None:
    """The model's thread never reads the index (a cold page waits for the disk): a chunk is
    skipped because the scheduler's lookup found it stored, or because this process has it
    queued; anything else is copied."""
    from kvtier.vllm.metadata import SaveSpec

    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=G.chunk_tokens, io_threads=2)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, G, "kv_last", "cpu")

        def no_index_read(*args: object, **kwargs: object) -> None:
            raise AssertionError("the model's thread read the index")

        for name in ("present_each", "count_present_prefix", "count_present_chain", "get"):
            setattr(store.backend, name, no_index_read)
        held = threading.Event()
        real_put_many = store.backend.put_many
        store.backend.put_many = lambda items: held.wait(30) and real_put_many(items)  # the disk is slow

        def spec(key: bytes, first_block: int, *, stored: bool = False, held_by: tuple[bytes, ...] = ()) -> SaveSpec:
            return SaveSpec("r", (key,), 0, G.chunk_tokens, list(range(first_block, first_block + PER_CHUNK)),
                            stored=stored, held_by=held_by)

        touched: list[bytes] = []
        real_touch = store.touch
        store.touch = lambda keys: (touched.extend(keys), real_touch(keys))  # (the LRU's uses)
        known, fresh, own_tail, longer_tail = (os.urandom(32) for _ in range(4))
        save_step(worker, caches, [spec(known, 0, stored=True), spec(fresh, PER_CHUNK),
                                   spec(own_tail, 2 * PER_CHUNK, stored=True, held_by=(longer_tail,))])
        stats = worker.take_stats()
        assert stats.get("save_skipped_chunks") == 2 and stats.get("save_chunks") == 1
        # a tail held by a longer stored one is skipped, and the use goes to the one that exists
        assert touched == [known, longer_tail]
        assert store.queued_each([known, fresh, own_tail]) == [False, True, False]
        save_step(worker, caches, [spec(fresh, PER_CHUNK)])  # still queued: not copied again
        stats = worker.take_stats()
        assert stats.get("save_skipped_chunks") == 1 and not stats.get("save_chunks")
        held.set()
        assert store.flush(30)
        store.backend.present_each = type(store.backend).present_each.__get__(store.backend)
        assert store.backend.present_each([known, fresh]) == [False, True]
        worker.close()


def test_a_synchronous_load_that_failed_on_another_rank_discards_this_ranks_saves(tmp_path: Path) -> None:
    """Tensor parallelism: a rank whose own synchronous load succeeded still discards the
    saves of that step and the next when another rank's failed (the ranks' layer outputs are
    summed, so every rank's KV was computed over the failed rank's unfilled blocks); the
    step after those saves again."""
    from kvtier.vllm.metadata import ChunkLoad, KVTierMetadata, LoadSpec, SaveSpec

    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=G.chunk_tokens, io_threads=2)
    with ChunkStore(cfg) as store:
        asked: list[bool] = []
        worker, caches = make_worker(store, G, "kv_last", "cpu")
        worker._any_rank = lambda failed: asked.append(failed) or True  # another rank's load failed
        stored = os.urandom(32)
        save_step(worker, caches, [SaveSpec("r", (stored,), 0, G.chunk_tokens, list(range(PER_CHUNK)))])
        assert store.flush(30)
        load = LoadSpec("l", [ChunkLoad((stored,), 0, G.chunk_tokens, 0, list(range(PER_CHUNK, 2 * PER_CHUNK)))],
                        sync=True)
        worker.start_loads(KVTierMetadata(loads=[load]))
        assert asked == [False] and not worker.take_load_errors()  # this rank's load was fine
        keys = [os.urandom(32) for _ in range(3)]
        for key in keys:  # the failed step, the next, and one after
            save_step(worker, caches, [SaveSpec("s", (key,), 0, G.chunk_tokens,
                                                list(range(2 * PER_CHUNK, 3 * PER_CHUNK)))])
        assert store.flush(30)
        assert store.backend.present_each(keys) == [False, False, True]
        assert worker.take_stats()["save_unsafe_chunks"] == 2
        worker.close()


def test_a_synchronous_load_that_raises_fails_its_blocks_instead_of_the_step(tmp_path: Path) -> None:
    """A fault kvtier did not foresee while reading a synchronous load (here the store's
    reader raises) must not leave start_load_kv, which would stop vLLM's engine: the load's
    blocks are reported failed (vLLM recomputes them) and the step's saves are discarded."""
    from kvtier.vllm.metadata import ChunkLoad, KVTierMetadata, LoadSpec, SaveSpec

    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=G.chunk_tokens, io_threads=2)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, G, "kv_last", "cpu")

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("an unforeseen fault")

        store.load_many = broken  # type: ignore[method-assign]
        dest = list(range(PER_CHUNK, 2 * PER_CHUNK))
        worker.start_loads(KVTierMetadata(loads=[LoadSpec("l", [ChunkLoad((os.urandom(32),), 0, G.chunk_tokens, 0,
                                                                           dest)], sync=True)]))
        assert worker.take_load_errors() == set(dest)
        key = os.urandom(32)
        save_step(worker, caches, [SaveSpec("s", (key,), 0, G.chunk_tokens, list(range(PER_CHUNK)))])
        assert store.flush(30)
        assert store.backend.present_each([key]) == [False]
        worker.close()


class _LateEvent:
    """A device event whose copies land ``delay`` s after the step (a GPU under vLLM's
    asynchronous scheduling: the next step is planned before the last one's copies are
    done); the CPU has no events, so this stands in for the GPU's on the same code path."""

    def __init__(self, delay: float) -> None:
        self.at = time.monotonic() + delay

    def query(self) -> bool:
        return time.monotonic() >= self.at

    def synchronize(self) -> None:
        time.sleep(max(0.0, self.at - time.monotonic()))


@pytest.mark.parametrize("copies_land_late", [False, True])
def test_an_offline_producer_waits_for_buffers_across_back_to_back_steps(tmp_path: Path,
                                                                         copies_land_late: bool) -> None:
    """``save_wait_s`` (warm-up): steps that each save most of the pool wait for the writer
    instead of dropping saves. The buffers of the steps before go back before this step asks
    for its own, once their copies are done (waited for, here: an offline producer may):
    they were held until the step's end, so every second step found the pool empty."""
    from kvtier.vllm.metadata import SaveSpec

    g = Geometry(num_blocks=256)
    per = g.chunk_tokens // g.block_size
    host, per_step = (1, 4) if copies_land_late else (4, 6)  # a pool of 5 or 8 chunks
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=host * g.chunk_bytes,
                      write_queue_bytes=4 * g.chunk_bytes, io_threads=1)
    with ChunkStore(cfg) as store:
        commit = store._commit

        def slow_commit(batch: object, items: object) -> None:  # a disk slower than the steps
            time.sleep(0.1)
            commit(batch, items)  # type: ignore[arg-type]

        store._commit = slow_commit  # type: ignore[method-assign]
        worker, caches = make_worker(store, g, "kv_last", "cpu")
        worker.save_wait_s = 30.0
        if copies_land_late:
            worker.copies.record = lambda: _LateEvent(0.3)  # type: ignore[method-assign]
            worker.copies.compute_waits_for = lambda event: None  # type: ignore[method-assign]
        saved = []
        for step in range(3):
            specs = [SaveSpec(f"r{step}", (os.urandom(32),), 0, g.chunk_tokens,
                              list(range(j * per, (j + 1) * per))) for j in range(per_step)]
            save_step(worker, caches, specs, layer_hooks=True)
            saved.append(worker.take_stats().get("save_chunks", 0))
        assert store.flush(60)
        worker.close()
        assert saved == [per_step] * 3 and store.counters.snapshot()["dropped_saves"] == 0


@pytest.mark.parametrize(("per_copy", "save_per_copy"), [(1, 1), (2, 1), (2, 2)])
def test_a_step_enqueues_one_gather_per_layer_and_one_copy_per_chunk_and_group_of_layers(
        tmp_path: Path, per_copy: int, save_per_copy: int) -> None:
    """What a GPU pays per operation: each one waits on the side stream behind the forward
    pass, and once about a thousand are pending CUDA blocks the model's thread (measured on
    an H100 with the chunk-by-chunk path: 3 per chunk and layer, a 16-chunk save step held
    the host 140 ms); and each copy to or from host memory has a fixed cost (1 MiB copies ran
    at 0.70x of the link, 4 MiB ones at 0.80x). A batch of chunks costs one gather (or
    scatter) per layer and one copy per chunk and group of layers, for saves and loads alike;
    with layers grouped, a second indexing op per layer moves it between its slot of the
    stage and the scratch, and a synchronous load's first group is its first layer alone
    (counted with torch's profiler, here on the CPU path, which is the code a GPU runs: one
    layer per copy is the CPU's default, two the GPU's for chunks this size). Saves go one
    layer per copy unless told otherwise (``save_copy_bytes``), also where loads group."""
    from torch.profiler import ProfilerActivity, profile

    from kvtier.testing.worker_rig import load_sync
    from kvtier.vllm.metadata import ChunkLoad, LoadSpec, SaveSpec

    g = Geometry(layers=4, num_blocks=64)
    per, chunks = g.chunk_tokens // g.block_size, 4
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=2 * chunks * g.chunk_bytes,
                      write_queue_bytes=2 * chunks * g.chunk_bytes)

    def ops(fn) -> dict[str, int]:  # noqa: ANN001
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        counts = {e.key: e.count for e in prof.key_averages()}
        return {op: counts.get(f"aten::{op}", 0) for op in ("index_select", "index_copy_", "index", "copy_")}

    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, g, "kv_last", "cpu",
                                     copy_bytes=None if per_copy == 1 else per_copy * g.chunk_bytes // g.layers,
                                     save_copy_bytes=0 if save_per_copy == 1 else save_per_copy * g.chunk_bytes // g.layers)
        keys = [(os.urandom(32),) for _ in range(chunks)]
        src = [list(range(j * per, (j + 1) * per)) for j in range(chunks)]
        saved = ops(lambda: save_step(worker, caches, [SaveSpec("r", k, 0, g.chunk_tokens, ids)
                                                       for k, ids in zip(keys, src, strict=True)]))
        assert (worker.per_copy, worker.save_per_copy) == (per_copy, save_per_copy)
        assert "save_layers_after_forward" not in worker.stats  # (every group copied by a hook)
        assert saved == {"index_select": g.layers, "index_copy_": g.layers * (save_per_copy > 1), "index": 0,
                         "copy_": g.layers // save_per_copy * chunks}
        grouped = per_copy > 1
        assert store.flush(30)
        dest = [[b + chunks * per for b in ids] for ids in src]
        loaded = ops(lambda: load_sync(worker, [LoadSpec("l", [ChunkLoad(k, 0, g.chunk_tokens, 0, ids)
                                                                for k, ids in zip(keys, dest, strict=True)],
                                                         sync=True)]))
        # groups: one layer each, or [0], [1, 2], [3]
        assert loaded == {"index_select": g.layers * grouped, "index_copy_": g.layers, "index": 0,
                          "copy_": (3 if grouped else g.layers) * chunks}
        assert not worker.take_load_errors()
        for c in caches.values():
            assert torch.equal(c[[b for ids in dest for b in ids]], c[[b for ids in src for b in ids]])
        worker.close()
