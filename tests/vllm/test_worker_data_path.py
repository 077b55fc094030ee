"""The worker's data path on a synthetic paged KV cache: bit-exact round trips through the
real WorkerSide and ChunkStore, and no buffer allocated per step once warm."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvtier import CacheConfig
from kvtier.store import ChunkStore
from kvtier.testing.worker_rig import Geometry, load_sync, make_worker, save_step

G = Geometry()
PER_CHUNK = G.chunk_tokens // G.block_size


def _blocks(cache: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return cache[torch.tensor(ids)].clone()


@pytest.mark.parametrize("content", ["kv_last", "cpu"])
def test_steady_state_saves_and_loads_allocate_nothing_and_round_trip(tmp_path: Path, content: str) -> None:
    from kvtier.vllm.metadata import ChunkLoad, LoadSpec, SaveSpec

    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=G.chunk_tokens, host_bytes=4 * G.chunk_bytes,
                      write_queue_bytes=4 * G.chunk_bytes, io_threads=2)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, G, content, "cpu")
        gen = torch.Generator().manual_seed(0)
        for c in caches.values():
            c.copy_(torch.randn(c.shape, generator=gen))
        saved: list[tuple[bytes, list[int], list[torch.Tensor]]] = []
        marks = []
        for step in range(16):  # two chunks per step, each from 4 of the 64 blocks
            perm = torch.randperm(G.num_blocks, generator=gen).tolist()
            specs = []
            for j in range(2):
                ids = perm[j * PER_CHUNK:(j + 1) * PER_CHUNK]
                key = os.urandom(32)
                specs.append(SaveSpec(f"r{step}", (key,), 0, G.chunk_tokens, ids))
                saved.append((key, ids, [_blocks(c, ids) for c in caches.values()]))
            save_step(worker, caches, specs)
            assert store.flush(30)
            marks.append((store.pool.created, worker._save_index.allocations))
        assert marks[-1] == marks[3], f"buffers allocated after warm-up: {marks}"
        assert store.counters.snapshot()["dropped_saves"] == 0

        for c in caches.values():
            c.zero_()
        load_marks = []
        for key, _ids, want in saved[-16:]:  # each into other blocks than it came from
            dest = torch.randperm(G.num_blocks, generator=gen)[:PER_CHUNK].tolist()
            load_sync(worker, [LoadSpec("l", [ChunkLoad((key,), 0, G.chunk_tokens, 0, dest)], sync=True)])
            assert worker.take_load_errors() == set()
            for c, w in zip(caches.values(), want, strict=True):
                assert torch.equal(_blocks(c, dest), w)  # bit-exact, block for block
            load_marks.append((store.pool.created, worker._load_index.allocations))
        # host-tier loads take pool buffers until the pool's cap (host + queue budgets), then reuse
        assert load_marks[-1] == load_marks[7], f"buffers allocated while loading: {load_marks}"
        assert store.pool.allocated_bytes <= store.pool.cap_bytes
        worker.close()


def test_a_step_checks_presence_once_and_skips_stored_chunks(tmp_path: Path) -> None:
    from kvtier.vllm.metadata import SaveSpec

    cfg = CacheConfig(path=tmp_path / "s", chunk_tokens=G.chunk_tokens, io_threads=2)
    with ChunkStore(cfg) as store:
        worker, caches = make_worker(store, G, "kv_last", "cpu")
        key = os.urandom(32)
        spec = SaveSpec("r", (key,), 0, G.chunk_tokens, list(range(PER_CHUNK)))
        save_step(worker, caches, [spec])
        store.flush(30)
        calls = []
        real = store.backend.present_each
        store.backend.present_each = lambda keys: calls.append(list(keys)) or real(keys)
        other = SaveSpec("r", (os.urandom(32),), 0, G.chunk_tokens, list(range(PER_CHUNK, 2 * PER_CHUNK)))
        save_step(worker, caches, [spec, other])
        store.flush(30)
        assert len(calls) == 1 and len(calls[0]) == 2  # one index read for the step
        stats = worker.take_stats()
        assert stats.get("save_skipped_chunks") == 1 and stats.get("save_chunks") == 2
        worker.close()
