"""What the worker does while its device copies are still in flight.

On a GPU the worker never waits for a copy on the model's thread: it records an event and
(1) has the compute stream wait for it where vLLM needs the data, (2) lets the writer thread
wait for it before reading a saved chunk, (3) reports an asynchronous load once it is done,
(4) keeps the host buffers the copies use until then. On the CPU every copy is done at once
and these paths are never pending, so here the copy stream records events that stay pending
until the test completes them: the only stand-in, for CUDA events (no GPU here). Everything
else is the real ``WorkerSide``, ``ChunkStore`` and files; the copies themselves are real.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier import CacheConfig
from kvtier.store import ChunkStore
from kvtier.testing.worker_rig import Geometry, make_worker, save_step
from kvtier.vllm.device import CopyStream
from kvtier.vllm.worker_side import WorkerSide

G = Geometry()
PER_CHUNK = G.chunk_tokens // G.block_size


class PendingEvent:
    """A CUDA event's interface: pending until ``complete()``."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        assert self._done.wait(60), "waited for an event that never completed"

    def complete(self) -> None:
        self._done.set()


class GatedCopies(CopyStream):
    """The CPU copy stream, with events that stay pending, and a log of compute-stream waits."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.events: list[PendingEvent] = []
        self.compute_waits: list[PendingEvent] = []

    def record(self) -> PendingEvent:  # type: ignore[override]
        self.events.append(PendingEvent())
        return self.events[-1]

    def compute_waits_for(self, event: PendingEvent | None) -> None:  # type: ignore[override]
        if event is not None:
            self.compute_waits.append(event)

    def complete_all(self) -> None:
        for e in self.events:
            e.complete()


@contextlib.contextmanager
def _rig(tmp_path: Path, pool_chunks: int = 4, g: Geometry = G,
         **worker_args: object) -> Iterator[tuple[ChunkStore, WorkerSide, dict[str, torch.Tensor], GatedCopies]]:
    """A store and a worker whose copy stream is :class:`GatedCopies`, over random KV; on
    the way out every event completes (nothing waits on one forever) and both close."""
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=pool_chunks * g.chunk_bytes,
                      write_queue_bytes=pool_chunks * g.chunk_bytes, io_threads=2)
    store = ChunkStore(cfg)
    worker, caches = make_worker(store, g, "kv_last", "cpu", **worker_args)
    worker.copies = copies = GatedCopies()
    gen = torch.Generator().manual_seed(1)
    for c in caches.values():
        c.copy_(torch.randn(c.shape, generator=gen))
    try:
        yield store, worker, caches, copies
    finally:
        copies.complete_all()
        worker.close()
        store.close()


def _blocks(caches: dict[str, torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [c[torch.tensor(ids)].clone() for c in caches.values()]


def _assert_stored(store: ChunkStore, key: bytes, caches: dict[str, torch.Tensor], ids: list[int]) -> None:
    """The stored chunk ``key`` holds blocks ``ids`` of every layer, in canonical layout."""
    got = store.load(key).tensor
    assert got is not None
    for li, want in enumerate(_blocks(caches, ids)):  # [blocks, H, block, 2D] vs [2, tokens, H, D]
        k, v = want[..., : G.head_dim], want[..., G.head_dim :]
        assert torch.equal(got[li][0], k.transpose(1, 2).reshape(-1, G.kv_heads, G.head_dim))
        assert torch.equal(got[li][1], v.transpose(1, 2).reshape(-1, G.kv_heads, G.head_dim))


def _log_copies(monkeypatch: pytest.MonkeyPatch, copies: GatedCopies) -> list[str]:
    """The order in which the worker enqueues gathers, copies to host memory and events."""
    from kvtier.vllm.block_rows import BlockRows

    order: list[str] = []
    gather, to_chunk, record = BlockRows.gather, BlockRows.to_chunk, copies.record

    def logged(name: str, fn):  # noqa: ANN001, ANN202
        def call(*args: object) -> object:
            order.append(name)
            return fn(*args)
        return call

    monkeypatch.setattr(BlockRows, "gather", staticmethod(logged("gather", gather)))
    monkeypatch.setattr(BlockRows, "to_chunk", logged("host copy", to_chunk))
    monkeypatch.setattr(copies, "record", logged("event", record))
    return order


@pytest.mark.parametrize(("chunks", "hooks"), [(2, 4), (6, 4), (2, 1), (2, 2)])
def test_the_hooks_before_the_planning_one_enqueue_nothing_and_it_copies_their_layers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunks: int, hooks: int) -> None:
    """The step's first layer hooks run while the device has little queued (the first: only
    that layer's attention): they plan nothing, take no pool buffer and enqueue nothing.
    The third hook (``PLAN_HOOK``) plans the step (one batch, or several where the chunks
    do not fit the stage: ``chunks`` 6), takes the buffers and copies the first two layers,
    then its own: per layer and batch a gather, then one copy per chunk. Where the step has
    fewer hooks (``hooks`` 1 or 2), ``wait_for_save`` copies every layer. Every chunk is
    stored whole."""
    from kvtier.vllm.metadata import KVTierMetadata, SaveSpec
    from kvtier.vllm.worker_side import PLAN_HOOK

    assert PLAN_HOOK == 3 < G.layers
    # a stage of four chunks' layers: two chunks fit one batch, six do not
    with _rig(tmp_path, pool_chunks=8, stage_bytes=4 * G.chunk_bytes // G.layers) as (store, worker, caches, copies):
        order = _log_copies(monkeypatch, copies)
        keys = [os.urandom(32) for _ in range(chunks)]
        ids = [list(range(j * PER_CHUNK, (j + 1) * PER_CHUNK)) for j in range(chunks)]
        meta = KVTierMetadata(saves=[SaveSpec("r", (k,), 0, G.chunk_tokens, b) for k, b in zip(keys, ids, strict=True)])
        free = store.pool.free_slots
        names = list(caches)
        for name in names[: min(hooks, PLAN_HOOK - 1)]:
            worker.save_layer(meta, name)
        assert order == [] and store.pool.free_slots == free and not copies.events
        if hooks < PLAN_HOOK:
            worker.finish_saves(meta)
            assert order.count("host copy") == chunks * G.layers
            assert worker.stats["save_layers_after_forward"] == G.layers
        else:
            worker.save_layer(meta, names[PLAN_HOOK - 1])
            batches = worker._save_batches
            assert (len(batches) > 1) == (chunks == 6)
            per_layer: list[str] = []
            for b in batches:
                per_layer += ["gather"] + ["event"] * (b is batches[-1]) + ["host copy"] * len(b.chunks)
            assert order == per_layer * PLAN_HOOK
            assert store.pool.free_slots == free - chunks
            for name in names[PLAN_HOOK:]:
                worker.save_layer(meta, name)
            assert order == per_layer * G.layers
            worker.finish_saves(meta)
            assert "save_layers_after_forward" not in worker.stats
        copies.complete_all()
        assert store.flush(30)
        for k, b in zip(keys, ids, strict=True):
            _assert_stored(store, k, caches, b)


def test_a_model_with_fewer_layers_than_the_planning_hook_plans_at_its_last(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A two-layer model (the suite's tiny vLLM models) plans in its second and last hook
    and copies both layers there: nothing is left for after the forward pass."""
    from kvtier.vllm.metadata import KVTierMetadata, SaveSpec

    g = Geometry(layers=2)
    with _rig(tmp_path, g=g) as (store, worker, caches, copies):
        order = _log_copies(monkeypatch, copies)
        key, ids = os.urandom(32), list(range(PER_CHUNK))
        meta = KVTierMetadata(saves=[SaveSpec("r", (key,), 0, g.chunk_tokens, ids)])
        first, last = caches
        worker.save_layer(meta, first)
        assert order == []
        worker.save_layer(meta, last)
        assert order == ["gather", "event", "host copy"] * 2
        worker.finish_saves(meta)
        assert worker.stats["save_chunks"] == 1 and "save_layers_after_forward" not in worker.stats
        copies.complete_all()
        assert store.flush(30)
        _assert_stored(store, key, caches, ids)


@pytest.mark.parametrize("left", ["one hook", "three hooks"])
def test_a_step_that_never_finished_lends_nothing_to_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, left: str) -> None:
    """A step's first hooks are acted on at its planning hook (the third), and its plan used
    by every hook after. If a step ended without ``wait_for_save`` (vLLM calls it in a
    ``finally``; a caller might not), neither is taken for the next step's, whose hooks
    would otherwise copy a layer it has not computed yet, or its layers into the other
    step's chunks. The next step's first hook enqueues nothing (with ``three hooks`` left,
    it only ends the other step's plan: an event; that step's chunk is not saved, and that
    is logged and counted), and its own chunk is stored whole."""
    from kvtier.vllm.metadata import KVTierMetadata, SaveSpec

    with _rig(tmp_path) as (store, worker, caches, copies):
        order = _log_copies(monkeypatch, copies)
        names = list(caches)
        old_key = os.urandom(32)
        old = KVTierMetadata(saves=[SaveSpec("r", (old_key,), 0, G.chunk_tokens, list(range(PER_CHUNK)))])
        for name in names[: 1 if left == "one hook" else 3]:  # (and no more of that step)
            worker.save_layer(old, name)
        del order[:]
        key, ids = os.urandom(32), list(range(PER_CHUNK, 2 * PER_CHUNK))
        meta = KVTierMetadata(saves=[SaveSpec("r", (key,), 0, G.chunk_tokens, ids)])
        with caplog.at_level("WARNING", logger="kvtier"):
            worker.save_layer(meta, names[1])
        assert order == ([] if left == "one hook" else ["event"])
        assert ("never handed over" in caplog.text) == (left == "three hooks")
        assert worker.stats.get("save_dropped_chunks", 0) == (left == "three hooks")
        worker.save_layer(meta, names[2])
        assert order == ([] if left == "one hook" else ["event"])  # (the new step's second hook)
        worker.save_layer(meta, names[3])
        assert order[-9:] == ["gather", "event", "host copy"] * 3
        worker.save_layer(meta, names[0])
        worker.finish_saves(meta)
        assert "save_layers_after_forward" not in worker.stats
        copies.complete_all()
        assert store.flush(30)
        _assert_stored(store, key, caches, ids)
        assert store.backend.present_each([old_key]) == [False]


@pytest.mark.parametrize("failing", ["row plan", "second buffer"])
def test_a_plan_that_failed_is_made_again_by_the_next_hook_of_the_same_step(tmp_path: Path, failing: str) -> None:
    """The step's planning hook (the third) plans its saves; where that fails (the
    connector logs it and the forward pass goes on), the next hook plans again and copies
    every layer hooked so far, the failed hook's included: nothing is left for after the
    forward pass. Where only taking the pool buffers failed (``second buffer``: the first
    chunk got one), the next hook copies the chunks that got one; the other is not saved,
    and counted as dropped. Every chunk saved is stored whole."""
    from kvtier.vllm.metadata import KVTierMetadata, SaveSpec

    with _rig(tmp_path) as (store, worker, caches, copies):
        if failing == "row plan":
            real = worker._plan_rows

            def fails_once(*args: object) -> object:
                worker._plan_rows = real
                raise RuntimeError("an unforeseen fault")

            worker._plan_rows = fails_once
        else:
            real_buffer, calls = store.buffer, []

            def second_fails(*args: object, **kwargs: object) -> object:
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("an unforeseen fault")
                return real_buffer(*args, **kwargs)

            store.buffer = second_fails  # type: ignore[method-assign]
        keys = [os.urandom(32) for _ in range(2)]
        ids = [list(range(j * PER_CHUNK, (j + 1) * PER_CHUNK)) for j in range(2)]
        meta = KVTierMetadata(saves=[SaveSpec("r", (k,), 0, G.chunk_tokens, b) for k, b in zip(keys, ids, strict=True)])
        names = list(caches)
        worker.save_layer(meta, names[0])
        worker.save_layer(meta, names[1])
        with pytest.raises(RuntimeError, match="unforeseen"):
            worker.save_layer(meta, names[2])
        assert not any(worker._copied)
        worker.save_layer(meta, names[3])
        assert worker._copied == [True] * G.layers
        worker.finish_saves(meta)
        assert "save_layers_after_forward" not in worker.stats
        saved = 2 if failing == "row plan" else 1
        assert worker.stats.get("save_dropped_chunks", 0) == 2 - saved
        copies.complete_all()
        assert store.flush(30)
        for k, b in zip(keys[:saved], ids[:saved], strict=True):
            _assert_stored(store, k, caches, b)
        assert store.backend.present_each(keys[saved:]) == [False] * (2 - saved)


def test_metadata_used_again_after_wait_for_save_starts_a_new_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of one hook (a model of one layer, as far as the hooks go): ``wait_for_save``
    plans and copies it, also when it is not given the metadata. If the next step's
    metadata is the same object, its first hook is still a first hook (it enqueues
    nothing), and both steps' chunks are stored whole."""
    from kvtier.vllm.metadata import KVTierMetadata, SaveSpec

    with _rig(tmp_path) as (store, worker, caches, copies):
        order = _log_copies(monkeypatch, copies)
        names = list(caches)
        key, ids = os.urandom(32), list(range(PER_CHUNK))
        meta = KVTierMetadata(saves=[SaveSpec("r", (key,), 0, G.chunk_tokens, ids)])
        worker.save_layer(meta, names[0])
        assert order == []
        worker.finish_saves(None)
        assert order.count("host copy") == G.layers
        copies.complete_all()
        assert store.flush(30)
        _assert_stored(store, key, caches, ids)
        key2, ids2 = os.urandom(32), list(range(PER_CHUNK, 2 * PER_CHUNK))
        meta.saves[:] = [SaveSpec("r", (key2,), 0, G.chunk_tokens, ids2)]
        del order[:]
        worker.save_layer(meta, names[0])
        assert order == []
        for name in names[1:]:
            worker.save_layer(meta, name)
        worker.finish_saves(meta)
        copies.complete_all()
        assert store.flush(30)
        _assert_stored(store, key2, caches, ids2)


@pytest.mark.parametrize("whole", [False, True])
def test_a_save_is_written_only_after_its_copies_and_the_compute_stream_waits_for_the_gathers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, whole: bool) -> None:
    """Every layer hook ran. The compute stream waits for the event after the step's last
    gathers (the blocks are read: the next step may reuse them), not for the copies to host
    memory after it (with ``whole``, every layer of a chunk in one copy, ``save_copy_bytes``:
    the last group's copies are a group of layers of every chunk); the writer thread waits
    for those."""
    from kvtier.vllm.metadata import SaveSpec

    with _rig(tmp_path, save_copy_bytes=G.chunk_bytes if whole else 0) as (store, worker, caches, copies):
        order = _log_copies(monkeypatch, copies)
        key, ids = os.urandom(32), list(range(PER_CHUNK))
        save_step(worker, caches, [SaveSpec("r", (key,), 0, G.chunk_tokens, ids)])
        per_group = ["gather"] * G.layers + ["event", "host copy"] if whole else ["gather", "event", "host copy"] * G.layers
        assert order == per_group + ["event"]
        *_, blocks_read, copied = copies.events
        # right after the forward pass (vLLM's model runner V2 zeroes and copies blocks for
        # the next step before any connector hook of that step runs)
        assert copies.compute_waits == [blocks_read]
        assert worker._in_flight  # its buffer is held while the copies may write into it
        # the writer thread waits for the copies, not the model's thread: nothing is written yet
        blocks_read.complete()
        assert not store.flush(0.5)
        assert store.backend.present_each([key]) == [False]
        copied.complete()
        assert store.flush(30)
        assert store.backend.present_each([key]) == [True]
        copies.complete_all()
        worker.get_finished(set())
        assert not worker._in_flight
        store.host.clear()
        _assert_stored(store, key, caches, ids)


@pytest.mark.parametrize("whole", [False, True])
def test_under_a_replayed_cuda_graph_the_next_step_waits_only_for_the_gathers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, whole: bool) -> None:
    """No layer hook ran (a full CUDA graph replayed the forward pass), so wait_for_save
    copies every layer after it. All the gathers go first, then the copies to host memory:
    the compute stream waits for the event between the two (the blocks are read, the next
    step may reuse them), the writer thread for the one after the copies; the chunks are
    saved whole (``whole``: each chunk's layers all go to host memory in one copy,
    ``save_copy_bytes``; else one copy per layer, the default)."""
    from kvtier.vllm.metadata import SaveSpec

    with _rig(tmp_path, save_copy_bytes=G.chunk_bytes if whole else 0) as (store, worker, caches, copies):
        order = _log_copies(monkeypatch, copies)
        keys = [os.urandom(32), os.urandom(32)]
        ids = [list(range(PER_CHUNK)), list(range(PER_CHUNK, 2 * PER_CHUNK))]
        save_step(worker, caches, [SaveSpec("r", (k,), 0, G.chunk_tokens, b) for k, b in zip(keys, ids, strict=True)],
                  layer_hooks=False)
        assert worker.save_per_copy == (G.layers if whole else 1)
        assert order == ["gather"] * G.layers + ["event"] + ["host copy"] * (2 if whole else 2 * G.layers) + ["event"]
        blocks_read, copied = copies.events
        assert copies.compute_waits == [blocks_read]
        blocks_read.complete()
        assert not store.flush(0.5)  # the writer waits for the copies to host memory
        copied.complete()
        assert store.flush(30)
        store.host.clear()
        for key, b in zip(keys, ids, strict=True):
            _assert_stored(store, key, caches, b)


@pytest.mark.parametrize("whole", [False, True])
def test_every_device_copy_is_enqueued_on_the_side_stream_after_the_compute(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, whole: bool) -> None:
    """On a GPU a copy enqueued outside ``CopyStream.after_compute`` would run on the compute
    stream, or on the side stream without waiting for the layers it reads: on the CPU both
    are the same synchronous copy, so this checks where each is enqueued. Saves with and
    without layer hooks, synchronous loads, and an asynchronous load copied chunk by chunk
    from disk (``whole``: every layer of a chunk in one copy, saves and loads alike)."""
    from kvtier.testing.worker_rig import long_load_from_disk, save_and_reload
    from kvtier.vllm.block_rows import BlockRows
    from kvtier.vllm.device import StepIndex

    g = Geometry(num_blocks=4 * 16 * PER_CHUNK)
    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=g.chunk_tokens, host_bytes=8 * g.chunk_bytes,
                      write_queue_bytes=4 * g.chunk_bytes, io_threads=2)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, g, "kv_last", "cpu", copy_bytes=g.chunk_bytes if whole else None,
                                     save_copy_bytes=g.chunk_bytes if whole else 0)
        inside = 0
        outside: list[str] = []
        after_compute = CopyStream.after_compute

        @contextlib.contextmanager
        def counted(self: CopyStream):  # noqa: ANN202
            nonlocal inside
            inside += 1
            try:
                with after_compute(self):
                    yield
            finally:
                inside -= 1

        def guarded(name: str, fn, static: bool):  # noqa: ANN001, ANN202
            def call(*args: object, **kwargs: object) -> object:
                if not inside:
                    outside.append(name)
                return fn(*args, **kwargs)
            return staticmethod(call) if static else call

        monkeypatch.setattr(CopyStream, "after_compute", counted)
        for name in ("gather", "scatter"):
            monkeypatch.setattr(BlockRows, name, guarded(name, getattr(BlockRows, name), True))
        for name in ("to_chunk", "from_chunk"):
            monkeypatch.setattr(BlockRows, name, guarded(name, getattr(BlockRows, name), False))
        monkeypatch.setattr(StepIndex, "upload", guarded("upload", StepIndex.upload, False))
        for hooks in (True, False):
            assert save_and_reload(store, worker, caches, g, steps=3, loads=3, layer_hooks=hooks)["mismatches"] == []
        got = long_load_from_disk(store, worker, caches, g, chunks=12)
        assert got["mismatches"] == [] and got["failed_blocks"] == []
        assert outside == []
        worker.close()


def test_an_async_load_is_reported_only_once_its_copies_are_done(tmp_path: Path) -> None:
    from kvtier.vllm.metadata import ChunkLoad, KVTierMetadata, LoadSpec, SaveSpec

    with _rig(tmp_path) as (store, worker, caches, copies):
        key, ids = os.urandom(32), list(range(PER_CHUNK))
        save_step(worker, caches, [SaveSpec("r", (key,), 0, G.chunk_tokens, ids)])
        copies.complete_all()
        assert store.flush(30)
        want = _blocks(caches, ids)
        dest = list(range(PER_CHUNK, 2 * PER_CHUNK))
        missing = list(range(2 * PER_CHUNK, 3 * PER_CHUNK))  # a chunk never saved: a miss
        spec = LoadSpec("a", [ChunkLoad((key,), 0, G.chunk_tokens, 0, dest),
                              ChunkLoad((os.urandom(32),), G.chunk_tokens, G.chunk_tokens, 0, missing)])
        worker.start_loads(KVTierMetadata(loads=[spec]))
        worker._loads["a"].future.result(30)
        copies.events.clear()
        assert worker.get_finished(set()) == (None, None)  # scatter enqueued, not done
        (event,) = copies.events
        assert worker.take_load_errors() == set()  # reported with the request, not before
        assert worker.get_finished(set()) == (None, None)
        event.complete()
        assert worker.get_finished(set()) == (None, {"a"})
        assert worker.take_load_errors() == set(missing)
        assert all(torch.equal(a, b) for a, b in zip(_blocks(caches, dest), want, strict=True))
        assert not worker._in_flight and not worker._reporting  # its host buffers are let go


def _saved_chunks(store: ChunkStore, worker: WorkerSide, caches: dict[str, torch.Tensor],
                  copies: GatedCopies, n: int) -> tuple[list[bytes], list[list[int]]]:
    """Save ``n`` chunks from blocks ``0 .. n * PER_CHUNK`` under new keys, on disk when this
    returns (a step of at most 4: what the write queue holds); their keys and block ids."""
    from kvtier.vllm.metadata import SaveSpec

    keys = [os.urandom(32) for _ in range(n)]
    src = [list(range(i * PER_CHUNK, (i + 1) * PER_CHUNK)) for i in range(n)]
    for first in range(0, n, 4):
        save_step(worker, caches, [SaveSpec("r", (keys[i],), i * G.chunk_tokens, G.chunk_tokens, src[i])
                                   for i in range(first, min(n, first + 4))])
        copies.complete_all()
        assert store.flush(30)
    return keys, src


def _gate_loads(store: ChunkStore, n: int) -> list[threading.Event]:
    """Hold each chunk of the store's next ``load_many`` back until its gate opens: the
    reads themselves are the store's own; only when each is seen to arrive is controlled."""
    gates = [threading.Event() for _ in range(n)]
    real = store.load_many

    def gated(keys, ahead=None):  # noqa: ANN001, ANN202
        chunks = real(keys, ahead)
        for gate in gates[: len(keys)]:  # (holds no chunk while it waits)
            assert gate.wait(60), "a test never opened a gate"
            yield next(chunks)

    store.load_many = gated  # type: ignore[method-assign]
    return gates


def _wait_for(cond, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_the_save_fence_is_not_left_to_the_next_steps_first_hook() -> None:
    """The compute stream waits for a step's save copies right after its forward pass
    (``wait_for_save``), as the test above checks; the connector leaves ``handle_preemptions``
    to vLLM's default, since model runner V2 zeroes and copies the next step's blocks before
    calling it (a wait enqueued there could let a gather read an overwritten block)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvtier.vllm.connector import KVTierConnector

    assert KVTierConnector.handle_preemptions is KVConnectorBase_V1.handle_preemptions


def test_an_async_load_copies_each_chunk_as_it_arrives(tmp_path: Path) -> None:
    """The copies of a load's first chunks are enqueued while its later chunks are still
    being read (on a GPU they overlap those reads); the request is reported only once every
    chunk has arrived and every copy is done. A chunk that turns out missing fails its
    blocks and every later chunk's, and the chunks copied before it stay."""
    from kvtier.vllm.metadata import ChunkLoad, KVTierMetadata, LoadSpec

    with _rig(tmp_path) as (store, worker, caches, copies):
        keys, src = _saved_chunks(store, worker, caches, copies, 3)
        want = [_blocks(caches, ids) for ids in src]
        dest = [list(range((3 + i) * PER_CHUNK, (4 + i) * PER_CHUNK)) for i in range(3)]
        for c in caches.values():
            c[torch.tensor([b for d in dest for b in d])] = 0
        for case, load_keys in (("all there", keys), ("second missing", [keys[0], os.urandom(32), keys[2]])):
            copies.events.clear()
            gates = _gate_loads(store, 3)
            spec = LoadSpec("a", [ChunkLoad((k,), i * G.chunk_tokens, G.chunk_tokens, 0, d)
                                  for i, (k, d) in enumerate(zip(load_keys, dest, strict=True))])
            worker.start_loads(KVTierMetadata(loads=[spec]))
            job = worker._loads["a"]
            gates[0].set()
            _wait_for(lambda: job.arrived.qsize() == 1, "the first chunk")  # noqa: B023
            assert worker.get_finished(set()) == (None, None), case
            assert all(torch.equal(a, b) for a, b in zip(_blocks(caches, dest[0]), want[0], strict=True)), \
                f"{case}: the first chunk was not copied while the others were read"
            assert len(copies.events) == 1 and not job.future.done(), case
            gates[1].set()
            gates[2].set()
            # the engine steps on; a reader ahead of them waits to hand its chunks over
            _wait_for(lambda: worker.get_finished(set()) == (None, None) and "a" not in worker._loads,
                      "the whole load")
            assert job.future.done(), case
            assert worker.get_finished(set()) == (None, None), case  # copies enqueued, not done
            copies.complete_all()
            assert worker.get_finished(set()) == (None, {"a"}), case
            errors = worker.take_load_errors()
            if case == "all there":
                assert errors == set(), case
                for d, w in zip(dest, want, strict=True):
                    assert all(torch.equal(a, b) for a, b in zip(_blocks(caches, d), w, strict=True)), case
            else:
                assert errors == set(dest[1]) | set(dest[2]), case
                assert all(torch.equal(a, b) for a, b in zip(_blocks(caches, dest[0]), want[0], strict=True))
            assert not worker._in_flight and not worker._reporting and not worker._loads, case
            del store.load_many  # the store's own again
            for c in caches.values():
                c[torch.tensor([b for d in dest for b in d])] = 0


def test_a_failed_copy_fails_its_chunks_and_every_later_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy into the cache that raises (a device error: injected, the CPU cannot fail one)
    fails that chunk's blocks; the load's later chunks are failed without being copied, the
    chunks copied before stay, and the request is still reported, so vLLM recomputes."""
    from kvtier.vllm import worker_side
    from kvtier.vllm.metadata import ChunkLoad, KVTierMetadata, LoadSpec

    with _rig(tmp_path) as (store, worker, caches, copies):
        keys, src = _saved_chunks(store, worker, caches, copies, 3)
        want = _blocks(caches, src[0])
        dest = [list(range((3 + i) * PER_CHUNK, (4 + i) * PER_CHUNK)) for i in range(3)]
        gates = _gate_loads(store, 3)
        worker.start_loads(KVTierMetadata(loads=[LoadSpec("a", [
            ChunkLoad((k,), i * G.chunk_tokens, G.chunk_tokens, 0, d)
            for i, (k, d) in enumerate(zip(keys, dest, strict=True))])]))
        job = worker._loads["a"]
        gates[0].set()
        _wait_for(lambda: job.arrived.qsize() == 1, "the first chunk")
        worker.get_finished(set())  # copied
        calls = []

        def failing(*args: object, **kwargs: object) -> None:
            calls.append(1)
            raise RuntimeError("injected device error")

        monkeypatch.setattr(worker_side.BlockRows, "scatter", staticmethod(failing))
        gates[1].set()
        _wait_for(lambda: job.arrived.qsize() == 1, "the second chunk")
        worker.get_finished(set())  # its copy fails
        assert calls == [1]
        gates[2].set()
        _wait_for(lambda: worker.get_finished(set()) == (None, None) and "a" not in worker._loads, "the load")
        assert calls == [1], "a chunk after a failed copy was copied"
        copies.complete_all()
        assert worker.get_finished(set()) == (None, {"a"})
        assert worker.take_load_errors() == set(dest[1]) | set(dest[2])
        assert all(torch.equal(a, b) for a, b in zip(_blocks(caches, dest[0]), want, strict=True))
        assert not worker._in_flight and not worker._reporting


def test_a_long_sync_load_copies_early_batches_and_its_last_layer_by_layer(tmp_path: Path) -> None:
    """A synchronous load that fits one hand-over batch is copied layer by layer, all of it
    (the forward pass overlaps every copy); a longer one copies full batches as they arrive
    and only its last chunks layer by layer. Either way each layer's wait covers all copies
    before it, and every block comes back."""
    from kvtier.vllm.metadata import ChunkLoad, KVTierMetadata, LoadSpec

    with _rig(tmp_path) as (store, worker, caches, copies):
        batch = worker._arrived_max
        n = 2 * batch + 1
        keys, src = _saved_chunks(store, worker, caches, copies, n)
        want = [_blocks(caches, ids) for ids in src]
        base = n * PER_CHUNK
        for count, early in ((batch, 0), (n, 2)):
            copies.events.clear()
            dest = [list(range(base + i * PER_CHUNK, base + (i + 1) * PER_CHUNK)) for i in range(count)]
            spec = LoadSpec("s", [ChunkLoad((keys[i],), i * G.chunk_tokens, G.chunk_tokens, 0, dest[i])
                                  for i in range(count)], sync=True)
            worker.start_loads(KVTierMetadata(loads=[spec]))
            # early batches (an event each), then one event per layer and one for the whole
            assert len(copies.events) == early + G.layers + 1, count
            assert worker.take_load_errors() == set()
            for d, w in zip(dest, want[:count], strict=True):
                assert all(torch.equal(a, b) for a, b in zip(_blocks(caches, d), w, strict=True))
            copies.complete_all()
            worker.get_finished(set())
            assert not worker._in_flight
            base += count * PER_CHUNK


@pytest.mark.parametrize("fault", ["missing", "raises"])
def test_a_long_sync_load_that_fails_after_its_early_copies_still_fences_them(
        tmp_path: Path, fault: str) -> None:
    """A long synchronous load copies its first chunks as they arrive (see above). If the next
    chunk is missing, nothing is left to copy layer by layer, so no layer has a wait of its
    own; if reading raises (a fault kvtier did not foresee), every block is recomputed.
    Either way the early copies are still in flight: the forward pass, which reads their
    blocks or recomputes them, must wait for them."""
    from kvtier.vllm.metadata import ChunkLoad, KVTierMetadata, LoadSpec

    with _rig(tmp_path) as (store, worker, caches, copies):
        batch = worker._arrived_max
        keys, src = _saved_chunks(store, worker, caches, copies, batch + (fault == "raises"))
        if fault == "missing":
            keys.append(os.urandom(32))  # chunk ``batch``: never saved
        else:
            real = store.load_many

            def failing(ks, ahead=None):  # noqa: ANN001, ANN202
                chunks = real(ks, ahead)
                for _ in range(batch):
                    yield next(chunks)
                raise RuntimeError("an unforeseen fault")

            store.load_many = failing  # type: ignore[method-assign]
        base = (batch + 1) * PER_CHUNK
        dest = [list(range(base + i * PER_CHUNK, base + (i + 1) * PER_CHUNK)) for i in range(batch + 1)]
        copies.events.clear()
        spec = LoadSpec("s", [ChunkLoad((k,), i * G.chunk_tokens, G.chunk_tokens, 0, d)
                              for i, (k, d) in enumerate(zip(keys, dest, strict=True))], sync=True)
        worker.start_loads(KVTierMetadata(loads=[spec]))
        early = copies.events[0]  # the first chunks' copies, still in flight
        assert not early.query()
        # a wait on it or on any later event (one stream) before the forward pass
        assert copies.compute_waits and copies.events.index(copies.compute_waits[-1]) >= 0
        for name in worker.layer_index:
            worker.wait_for_layer(name)
        errors = worker.take_load_errors()
        if fault == "missing":  # the early chunks are loaded, the missing one recomputed
            assert errors == set(dest[-1])
            want = [_blocks(caches, ids) for ids in src]
            for d, w in zip(dest[:batch], want, strict=True):
                assert all(torch.equal(a, b) for a, b in zip(_blocks(caches, d), w, strict=True))
        else:
            assert errors == {b for d in dest for b in d}


def test_a_sync_load_before_a_full_cuda_graph_is_waited_for_whole(tmp_path: Path) -> None:
    """A forward pass replayed as a full CUDA graph runs no attention hook, so no layer would
    wait for its own copies (``layer_waits=False``, which the connector derives from the
    forward context): the compute stream waits for the whole load before it, and the blocks
    come back."""
    from kvtier.vllm.metadata import ChunkLoad, KVTierMetadata, LoadSpec

    with _rig(tmp_path) as (store, worker, caches, copies):
        keys, src = _saved_chunks(store, worker, caches, copies, 2)
        want = [_blocks(caches, ids) for ids in src]
        dest = [list(range((2 + i) * PER_CHUNK, (3 + i) * PER_CHUNK)) for i in range(2)]
        copies.events.clear()
        copies.compute_waits.clear()
        spec = LoadSpec("s", [ChunkLoad((k,), i * G.chunk_tokens, G.chunk_tokens, 0, d)
                              for i, (k, d) in enumerate(zip(keys, dest, strict=True))], sync=True)
        worker.start_loads(KVTierMetadata(loads=[spec]), layer_waits=False)
        assert worker._layer_ready == {}
        assert copies.compute_waits == [copies.events[-1]]  # after every copy of the load
        assert worker.take_load_errors() == set()
        for d, w in zip(dest, want, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(_blocks(caches, d), w, strict=True))


def test_an_index_buffer_is_reused_only_after_its_copies(tmp_path: Path) -> None:
    from kvtier.vllm.metadata import SaveSpec

    with _rig(tmp_path) as (store, worker, caches, copies):
        for step in range(3):  # the first step's copies stay pending
            save_step(worker, caches, [SaveSpec("r", (os.urandom(32),), 0, G.chunk_tokens,
                                                list(range(step * PER_CHUNK, (step + 1) * PER_CHUNK)))])
            if step:
                copies.events[-1].complete()
        ring = worker._save_index
        assert len(ring._all) == 2  # step 1 could not take step 0's buffer; step 2 took step 1's
        copies.complete_all()
        assert store.flush(30)
