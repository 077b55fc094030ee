"""The worker's data path on a CUDA device (skipped where there is none; run on a GPU
machine with ``python -m pytest tests/gpu``): the same round trip and steady-state checks as
the CPU tests, with KV caches in GPU memory, pinned pool buffers and side-stream copies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier import CacheConfig
from kvtier.store import ChunkStore
from kvtier.testing.worker_rig import Geometry, make_worker, save_and_reload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("content", ["kv_last", "cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_round_trip_is_bit_exact_and_allocates_nothing_when_warm(tmp_path: Path, content: str,
                                                                      dtype: torch.dtype) -> None:
    g = Geometry(layers=8, kv_heads=8, head_dim=128, block_size=16, chunk_tokens=256, num_blocks=128, dtype=dtype)
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
        worker.close()
