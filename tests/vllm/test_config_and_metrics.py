"""Bad connector options stop start-up with a clear message; metrics reach vLLM."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from enginehelpers import tokens

from kvtier.testing.engine import Engine, kv_transfer_config
from kvtier.vllm.stats import KVTierStats
from kvtier.vllm.worker_side import WorkerSide


def _messages(exc: BaseException | None) -> list[str]:
    """The messages of ``exc`` and of what it chains (vLLM may wrap our ConfigError)."""
    chain: list[str] = []
    while exc is not None:
        chain.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    return chain


@pytest.mark.parametrize(("extra", "needle"), [
    ({"disk_byte": "1G"}, "did you mean 'disk_bytes'"),
    ({"chunk_tokens": 100}, "chunk_tokens: 100 must be a multiple of vLLM's block_size (32)"),
    ({"backend": "redis"}, "backend: must be one of"),
    ({"prefetch_bytes": "2G", "host_bytes": "1G"}, "prefetch_bytes: 2147483648 bytes is more than host_bytes"),
    ({"save_wait_s": -1}, "save_wait_s: must be seconds from 0 to 1200"),
    ({"save_decode_chunks": "yes"}, "save_decode_chunks: must be true or false, got 'yes'"),
    ({"save_wait_s": 5}, "save_wait_s: only for an offline producer"),  # (this engine serves: kv_both)
    ({"device_stage_bytes": "lots"}, "device_stage_bytes: cannot read 'lots' as a size"),
    ({"device_copy_bytes": -1}, "device_copy_bytes: must not be negative"),
])
def test_bad_option_stops_startup_with_clear_message(tiny_model: Path, store_dir: Path,
                                                     extra: dict[str, object], needle: str) -> None:
    with pytest.raises(Exception) as info:
        Engine(tiny_model, kv_transfer_config(store_dir, **extra))
    chain = _messages(info.value)
    assert any(needle in m for m in chain), chain


def test_buffers_beyond_the_hosts_memory_stop_startup_and_a_retry_in_the_same_process_serves(
        tiny_model: Path, store_dir: Path, beyond_this_machine: int,
        forbid_pool_allocations: Callable[[], AbstractContextManager[None]]) -> None:
    """host_bytes beyond the machine: the worker, which reserves every chunk buffer when it
    starts, stops start-up saying what to lower, before touching any (the kernel would kill
    it part-way; here an allocation fails the test instead). vLLM keeps a connector it built
    for the whole process, and does not let go of it when start-up fails: the refused one
    lets go itself, or an engine started again in the same process (a notebook, a script
    that retries) would get it back, settings and all. Here the retry, with the budgets
    lowered, serves and saves."""
    with forbid_pool_allocations(), pytest.raises(Exception) as info:
        Engine(tiny_model, kv_transfer_config(store_dir, host_bytes=beyond_this_machine))
    chain = _messages(info.value)
    assert any("cannot reserve its chunk buffers" in m and "Lower host_bytes" in m for m in chain), chain
    with Engine(tiny_model, kv_transfer_config(store_dir)) as e:
        e.generate([tokens(600, seed=201)], max_tokens=2)
        store = e.worker_connector._store
        assert store.pool.cap_bytes == 256 << 20  # (this engine's budgets: 128 MiB + 128 MiB)
        store.flush()
        assert store.counters.snapshot()["saves_committed"] >= 2


def test_stats_reach_vllm(tiny_model: Path, store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reported: list[dict[str, float]] = []
    take = WorkerSide.take_stats

    def recording(self: WorkerSide) -> dict[str, float]:  # observe what vLLM receives
        out = take(self)
        reported.append(out)
        return out

    monkeypatch.setattr(WorkerSide, "take_stats", recording)
    p = tokens(600, seed=200)
    for _ in range(2):
        with Engine(tiny_model, kv_transfer_config(store_dir)) as e:
            e.generate([p], max_tokens=3)
    total = KVTierStats(data={})
    for r in reported:
        total.aggregate(KVTierStats(data=r))
    summary = total.reduce()
    assert summary["save_chunks"] >= 3  # two full chunks and the tail, in the first run
    assert summary["load_tokens"] == 576  # the second run loaded the prefix
    assert summary["store_hits_disk"] >= 3
    assert summary["load_requests"] == 1
    assert "save_layers_after_forward" not in summary  # no CUDA graphs here: every hook ran


def test_piecewise_cuda_graphs_are_asked_for_only_with_sync_loads() -> None:
    """Synchronous loads wait per layer in the attention hooks, which a full CUDA graph
    replays without running: vLLM must fall back to piecewise graphs for them. Saves copy
    what the hooks missed in wait_for_save, so the default keeps full graphs."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for extra, want in (({"load_async": False}, True), ({}, False), ({"load_async": True}, False)):
        ktc = kv_transfer_config("unused", **extra)
        cls = KVConnectorFactory.get_connector_class(ktc)  # as vLLM's config check resolves it
        assert cls.requires_piecewise_for_cudagraph(ktc.kv_connector_extra_config) is want
