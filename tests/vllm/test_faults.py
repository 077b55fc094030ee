"""Storage faults never change the output: corrupt chunks are recomputed, full disks only cost hits."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from enginehelpers import tokens

from kvtier.testing.engine import Engine, kv_transfer_config

P = [tokens(700, seed=50), tokens(520, seed=51)]


@pytest.fixture(scope="module")
def baseline(tiny_model: Path) -> list[list[int]]:
    with Engine(tiny_model) as e:
        return [r.tokens for r in e.generate(P, max_tokens=10)]


@pytest.mark.both_schedulings
def test_corrupt_chunk_is_detected_and_recomputed(tiny_model: Path, store_dir: Path,
                                                  baseline: list[list[int]]) -> None:
    cfg = kv_transfer_config(store_dir, backend="files")
    with Engine(tiny_model, cfg) as e:
        e.generate(P, max_tokens=10)
    records = sorted(store_dir.joinpath("files").rglob("*.kvt"))
    assert len(records) >= 4
    for rec in records:  # flip one payload byte in every record
        data = bytearray(rec.read_bytes())
        data[-100] ^= 0x40
        rec.write_bytes(bytes(data))
    with Engine(tiny_model, cfg) as e:
        got = e.generate(P, max_tokens=10)
        stats = e.worker_connector._store.counters.snapshot()
    assert [r.tokens for r in got] == baseline
    assert stats["corrupt_records"] >= 2  # the first chunk of each prompt, at least
    # Corrupt records were removed and the recomputed KV saved again: the next run hits.
    with Engine(tiny_model, cfg) as e:
        again = e.generate(P, max_tokens=10)
    assert [r.tokens for r in again] == baseline
    assert [r.num_cached_tokens for r in again] == [(len(p) - 1) // 32 * 32 for p in P]


def test_a_store_whose_reads_hang_costs_a_timeout_and_changes_no_output(tiny_model: Path, store_dir: Path,
                                                                         baseline: list[list[int]]) -> None:
    """The store's file system stops answering (a hung network mount): every read hangs. The
    engine serves the same output, each load given up after ``read_timeout_s`` and its
    blocks recomputed, with asynchronous loads and with loads before the forward pass; the
    records are kept, and hit again once the file system answers."""
    import time

    from diskhelpers import hang_reads

    with Engine(tiny_model, kv_transfer_config(store_dir, backend="files")) as e:
        e.generate(P, max_tokens=10)
    for load_async in (True, False):
        cfg = kv_transfer_config(store_dir, backend="files", read_timeout_s=0.5, load_async=load_async)
        with Engine(tiny_model, cfg) as e:
            store = e.worker_connector._store
            release = hang_reads(store)
            t = time.monotonic()
            got = e.generate(P, max_tokens=10)
            took = time.monotonic() - t
            stats = store.counters.snapshot()  # (before the hung reads return and count their hits)
            release.set()
        assert [r.tokens for r in got] == baseline, load_async
        assert stats["read_timeouts"] >= 1 and stats["hits_disk"] == 0 and stats["corrupt_records"] == 0
        assert took < 60, took  # (without the timeout: never, had the hang not ended at 120 s)
    with Engine(tiny_model, kv_transfer_config(store_dir, backend="files")) as e:
        again = e.generate(P, max_tokens=10)
    assert [r.tokens for r in again] == baseline
    assert [r.num_cached_tokens for r in again] == [(len(p) - 1) // 32 * 32 for p in P]


def test_tiny_disk_budget_keeps_serving_correctly(tiny_model: Path, store_dir: Path,
                                                  baseline: list[list[int]]) -> None:
    cfg = kv_transfer_config(store_dir, disk_bytes="300K", host_bytes=0, write_queue_bytes="300K")
    for _ in range(2):
        with Engine(tiny_model, cfg) as e:
            got = e.generate(P, max_tokens=10)
            store = e.worker_connector._store
            store.flush()
            _, used = store.backend.usage()
        assert [r.tokens for r in got] == baseline
        assert used <= 300 * 1024


def test_full_disk_keeps_serving_correctly(tiny_model: Path, tmp_path: Path,
                                           baseline: list[list[int]]) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        cfg = kv_transfer_config(mnt / "store", backend="files")
        dropped = 0
        for _ in range(2):
            with Engine(tiny_model, cfg) as e:
                got = e.generate(P, max_tokens=10)
                store = e.worker_connector._store
                store.flush()
                dropped += store.counters.snapshot()["dropped_saves"]
            assert [r.tokens for r in got] == baseline
        assert dropped > 0  # the disk really filled up
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_store_on_a_full_disk_at_start_up_turns_the_connector_off(tiny_model: Path, tmp_path: Path,
                                                                    baseline: list[list[int]]) -> None:
    """A store that cannot even be opened because its disk is full is a cache problem, not
    the server's: the connector says so in one line and the engine serves without it."""
    from diskhelpers import fill_disk, small_tmpfs

    with small_tmpfs(tmp_path, "1m") as mnt:
        fill_disk(mnt)
        with Engine(tiny_model, kv_transfer_config(mnt / "store")) as e:
            got = e.generate(P, max_tokens=10)
            reason = e.worker_connector.disabled_reason or e.scheduler_connector.disabled_reason
    assert [r.tokens for r in got] == baseline
    assert reason and "no space left" in reason and "damaged" not in reason


@pytest.mark.parametrize("load_async", [True, False])
def test_unknown_attention_backend_turns_worker_off_and_serves(
        tiny_model: Path, store_dir: Path, baseline: list[list[int]],
        monkeypatch: pytest.MonkeyPatch, load_async: bool) -> None:
    """If the worker cannot handle the KV layout, promised loads fail cleanly (recompute),
    synchronous ones too (a running request is never reported finished receiving: vLLM
    asserts on that)."""
    cfg = kv_transfer_config(store_dir, load_async=load_async)
    with Engine(tiny_model, cfg) as e:
        e.generate(P, max_tokens=10)
    import kvtier.vllm.connector as connector

    monkeypatch.setattr(connector, "BACKEND_CONTENT", {})  # as if vLLM picked a backend we don't know
    with Engine(tiny_model, cfg) as e:
        got = e.generate(P, max_tokens=10)
        assert e.worker_connector.disabled_reason and "CPU_ATTN" in e.worker_connector.disabled_reason
    assert [r.tokens for r in got] == baseline


def test_sliding_window_model_disables_connector(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        max_position_embeddings=4096, sliding_window=128, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = tmp_path / "swa"
    MistralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(model)
    with Engine(model) as e:
        base = e.generate(P, max_tokens=6)
    with Engine(model, kv_transfer_config(tmp_path / "store")) as e:
        got = e.generate(P, max_tokens=6)
        reason = e.scheduler_connector.disabled_reason
    assert reason and "sliding" in reason.lower()
    assert [r.tokens for r in got] == [r.tokens for r in base]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sync_load_mode_hits_and_survives_corruption(tiny_model: Path, store_dir: Path,
                                                     baseline: list[list[int]], async_scheduling: bool,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """``load_async: false`` loads before the forward pass; a bad chunk is still recomputed.
    Where vLLM schedules asynchronously (a GPU server's default), it recomputes a failed
    synchronous load with garbage token ids (vLLM issue 49250; the engine here fails with an
    IndexError): the connector says so and loads asynchronously instead."""
    import logging

    kvtier_log = logging.getLogger("kvtier")  # (its lines go through vLLM's handlers, not the root's)
    kvtier_log.addHandler(caplog.handler)
    cfg = kv_transfer_config(store_dir, backend="files", load_async=False)
    try:
        with Engine(tiny_model, cfg, async_scheduling=async_scheduling) as e:
            assert e.async_scheduling is async_scheduling
            assert e.scheduler_connector._sched.load_async is async_scheduling
            e.generate(P, max_tokens=10)
    finally:
        kvtier_log.removeHandler(caplog.handler)
    assert ("load_async: false is not used" in caplog.text) is async_scheduling, caplog.text
    with Engine(tiny_model, cfg, async_scheduling=async_scheduling) as e:
        got = e.generate(P, max_tokens=10)
    assert [r.tokens for r in got] == baseline
    assert [r.num_cached_tokens for r in got] == [(len(p) - 1) // 32 * 32 for p in P]
    for rec in sorted(store_dir.joinpath("files").rglob("*.kvt")):
        data = bytearray(rec.read_bytes())
        data[-7] ^= 0x01
        rec.write_bytes(bytes(data))
    with Engine(tiny_model, cfg, async_scheduling=async_scheduling) as e:
        got = e.generate(P, max_tokens=10)
        corrupt = e.worker_connector._store.counters.snapshot()["corrupt_records"]
    assert [r.tokens for r in got] == baseline
    assert corrupt >= 2
    # That step's forward pass ran over the blocks the failed load left unfilled, before vLLM
    # rolled the requests back: what it computed must not have been saved. A save of it would
    # pass every checksum and change the output of every later run. What the next step
    # recomputed was saved (vLLM schedules synchronously on the CPU): the store healed.
    with Engine(tiny_model, cfg) as e:
        got = e.generate(P, max_tokens=10)
    assert [r.tokens for r in got] == baseline
    assert [r.num_cached_tokens for r in got] == [(len(p) - 1) // 32 * 32 for p in P]
