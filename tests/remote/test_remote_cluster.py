"""The remote tier on a real three-node Redis Cluster: routing, and a node killed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from remotehelpers import CHUNK, chunk_keys, kv_for, open_cache, tokens, wait_for

from kvtier.testing.redis_server import LocalRedisCluster

SEQS = [tokens(100 + i, CHUNK) for i in range(24)]  # one chunk each: spread over the slots


def _save_all(path: Path, url: str) -> None:
    with open_cache(path, url) as a:
        for s in SEQS:
            a.save(s, kv_for(s))
        assert a.flush(30)
        assert a.stats()["remote_saves"] == len(SEQS)


@pytest.mark.parametrize("form", ["seeds", "detected"])
def test_chunks_spread_over_the_nodes_and_load_back(tmp_path: Path, redis_cluster: LocalRedisCluster, form: str) -> None:
    url = redis_cluster.url if form == "seeds" else f"redis://127.0.0.1:{redis_cluster.nodes[1].port}"
    _save_all(tmp_path / "a", url)
    per_node = [len(chunk_keys(n.client())) for n in redis_cluster.nodes]
    assert sum(per_node) == len(SEQS) and sum(1 for n in per_node if n) >= 2
    with open_cache(tmp_path / "b", url) as b:
        for s in SEQS:
            assert b.lookup(s) == CHUNK
            assert torch.equal(b.load(s), kv_for(s))
        assert b.stats()["remote_hits"] == len(SEQS)


def test_a_killed_node_loses_its_chunks_and_the_rest_keeps_serving(tmp_path: Path, redis_cluster: LocalRedisCluster) -> None:
    _save_all(tmp_path / "a", redis_cluster.url)
    victim = redis_cluster.nodes[0]
    on_victim = {bytes(m) for m in chunk_keys(victim.client())}
    assert on_victim
    victim.kill()
    time.sleep(1.5)  # past cluster-node-timeout: the others mark it failed
    with open_cache(tmp_path / "b", redis_cluster.url) as b:
        t0 = time.monotonic()
        hits = sum(b.load(s).shape[2] == CHUNK for s in SEQS)
        elapsed = time.monotonic() - t0
        stats = b.stats()
    assert hits == len(SEQS) - len(on_victim)  # every chunk on a live node, none on the dead one
    assert stats["corrupt_records"] == 0 and stats["remote_errors"] >= 1
    assert elapsed < 10


def test_lookups_on_a_cluster_run_the_script_on_each_node(tmp_path: Path, redis_cluster: LocalRedisCluster) -> None:
    """A long prompt's chunks lie in many slots of each node. Declared as a script's KEYS,
    the cluster refused them (CROSSSLOT) and every lookup fell back to one EXISTS per
    chunk; passed as arguments, each node answers a whole prompt in one script call."""
    seqs = [tokens(300 + i, 8 * CHUNK) for i in range(3)]
    with open_cache(tmp_path / "a", redis_cluster.url) as a:
        for s in seqs:
            a.save(s, kv_for(s))
        assert a.flush(30)
    for n in redis_cluster.nodes:
        n.client().config_resetstat()
    with open_cache(tmp_path / "b", redis_cluster.url) as b:
        assert [b.lookup(s) for s in seqs] == [8 * CHUNK] * 3
        assert [b.lookup(s) for s in seqs] == [8 * CHUNK] * 3  # answered by the script again
    stats = [n.client().info("commandstats") for n in redis_cluster.nodes]
    errors = [n.client().info("errorstats") for n in redis_cluster.nodes]
    assert not any("errorstat_CROSSSLOT" in e for e in errors), errors
    answered = sum(s.get(c, {}).get("calls", 0) - s.get(c, {}).get("failed_calls", 0)
                   for s in stats for c in ("cmdstat_evalsha", "cmdstat_eval"))
    assert answered >= 6, stats  # each of the 6 lookups by script on every node it asked


def test_a_resharded_slot_is_a_miss_and_lookups_keep_their_script(tmp_path: Path, redis_cluster: LocalRedisCluster,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """After slots move, a node asked with a stale slot map answers the script with "non
    local key": that lookup misses and the map is re-read. It used to switch the process to
    one EXISTS per chunk for good (3x slower lookups)."""
    import logging
    import subprocess

    caplog.set_level(logging.INFO, logger="kvtier")
    seqs = [tokens(400 + i, 4 * CHUNK) for i in range(6)]
    with open_cache(tmp_path / "a", redis_cluster.url) as a:
        for s in seqs:
            a.save(s, kv_for(s))
        assert a.flush(30)
    with open_cache(tmp_path / "b", redis_cluster.url) as b:
        assert [b.lookup(s) for s in seqs] == [4 * CHUNK] * len(seqs)  # its slot map is read now
        ids = [n.client().execute_command("CLUSTER MYID").decode() for n in redis_cluster.nodes]
        subprocess.run(["redis-cli", "--cluster", "reshard", f"127.0.0.1:{redis_cluster.nodes[0].port}",
                        "--cluster-from", ids[0], "--cluster-to", ids[1], "--cluster-slots", "5461",
                        "--cluster-yes"], check=True, capture_output=True, timeout=120)
        assert wait_for(lambda: [b.lookup(s) for s in seqs] == [4 * CHUNK] * len(seqs), timeout=20)
        assert all(torch.equal(b.load(s), kv_for(s)) for s in seqs)
    assert "refused the lookup script" not in caplog.text
