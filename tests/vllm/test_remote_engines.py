"""Real vLLM engines with separate local stores share one real redis-server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from enginehelpers import tokens

from kvtier.testing.engine import Engine, kv_transfer_config
from kvtier.testing.redis_server import LocalRedis

P = tokens(600, seed=40)
Q = tokens(500, seed=41)
R = tokens(450, seed=43)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LocalRedis]:
    s = LocalRedis(tmp_path / "redis", persist=True)
    yield s
    s.stop()


def _backing_off(tier) -> bool:  # noqa: ANN001 - a RemoteTier
    return any(b.open_now() for b in tier.nodes._breakers.values())


def test_a_second_server_hits_what_the_first_computed_and_survives_the_remote_dying(
        tiny_model: Path, tmp_path: Path, server: LocalRedis) -> None:
    with Engine(tiny_model) as e:
        base = e.generate([P, Q, R], max_tokens=8)
    remote = {"remote": server.url}
    with Engine(tiny_model, kv_transfer_config(tmp_path / "a", **remote)) as a:  # server A
        first = a.generate([P, Q, R], max_tokens=8)
        a.worker_connector._store.flush(60)
        assert a.worker_connector._store.counters.snapshot()["remote_saves"] >= 6
    assert [r.num_cached_tokens for r in first] == [0, 0, 0]
    with Engine(tiny_model, kv_transfer_config(tmp_path / "b", **remote)) as b:  # its own empty disk
        store = b.worker_connector._store
        got = b.generate([P], max_tokens=8)[0]
        assert got.num_cached_tokens == (len(P) - 1) // 32 * 32  # all of it, from the remote tier
        assert got.tokens == base[0].tokens
        assert store.counters.snapshot()["remote_hits"] >= 2

        server.kill()  # mid-run: serving goes on, Q is computed
        t0 = time.monotonic()
        got = b.generate([Q], max_tokens=8)[0]
        assert time.monotonic() - t0 < 30
        assert got.num_cached_tokens == 0 and got.tokens == base[1].tokens
        assert store.counters.snapshot()["remote_errors"] + b.scheduler_connector._view.counters.remote_errors >= 1

        server.start()  # back, with its data: hits resume once the back-off ends
        tiers = (store.remote, b.scheduler_connector._view.remote)
        deadline = time.monotonic() + 30
        while any(_backing_off(t) for t in tiers) and time.monotonic() < deadline:
            time.sleep(0.1)
        hits_before = store.counters.snapshot()["remote_hits"]
        got = b.generate([R], max_tokens=8)[0]  # only the remote tier has R (A computed it)
        assert got.num_cached_tokens == (len(R) - 1) // 32 * 32
        assert got.tokens == base[2].tokens
        assert store.counters.snapshot()["remote_hits"] > hits_before
        assert store.counters.snapshot()["corrupt_records"] == 0


def test_a_producer_and_a_consumer_with_separate_disks_pass_kv_through_the_remote_tier(
        tiny_model: Path, tmp_path: Path, server: LocalRedis) -> None:
    """The disaggregated split: a kv_producer (prefill) and a kv_consumer (decode), each with
    its own local store, as on two machines; the consumer never saves, the producer never loads."""
    prompt = tokens(700, seed=44)
    with Engine(tiny_model) as e:
        base = e.generate([prompt], max_tokens=8)[0]
    remote = {"remote": server.url}
    with Engine(tiny_model, kv_transfer_config(tmp_path / "prefill", "kv_producer", **remote)) as p:
        p.generate([prompt], max_tokens=1)
        p.worker_connector._store.flush(60)
        saved = p.worker_connector._store.counters.snapshot()["remote_saves"]
    assert saved >= 2
    with Engine(tiny_model, kv_transfer_config(tmp_path / "decode", "kv_consumer", **remote)) as d:
        got = d.generate([prompt], max_tokens=8)[0]
        stats = d.worker_connector._store.counters.snapshot()
    assert got.num_cached_tokens == (len(prompt) - 1) // 32 * 32
    assert got.tokens == base.tokens
    assert stats["remote_hits"] >= 2 and stats["remote_saves"] == 0


def test_a_producer_saves_to_its_own_disk_what_only_the_remote_tier_holds(
        tiny_model: Path, tmp_path: Path, server: LocalRedis) -> None:
    """A chunk found only in the remote tier is not "stored" for this server: an engine that
    computes it (here a producer, which never loads) still writes it to its own disk."""
    remote = {"remote": server.url}
    with Engine(tiny_model, kv_transfer_config(tmp_path / "a", **remote)) as a:
        a.generate([P], max_tokens=1)
        assert a.worker_connector._store.flush(60)
    with Engine(tiny_model, kv_transfer_config(tmp_path / "b", role="kv_producer", **remote)) as b:
        b.generate([P], max_tokens=1)
        store = b.worker_connector._store
        assert store.flush(60)
        assert store.counters.snapshot()["saves_committed"] >= 3  # 2 full chunks and the tail
        assert len(list(store.backend.entries())) >= 3
