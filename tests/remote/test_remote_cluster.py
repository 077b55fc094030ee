"""The remote tier on a real three-node Redis Cluster: routing, and a node killed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from remotehelpers import CHUNK, kv_for, manifests, open_cache, tokens

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
    per_node = [len(manifests(n.client())) for n in redis_cluster.nodes]
    assert sum(per_node) == len(SEQS) and sum(1 for n in per_node if n) >= 2
    with open_cache(tmp_path / "b", url) as b:
        for s in SEQS:
            assert b.lookup(s) == CHUNK
            assert torch.equal(b.load(s), kv_for(s))
        assert b.stats()["remote_hits"] == len(SEQS)


def test_a_killed_node_loses_its_chunks_and_the_rest_keeps_serving(tmp_path: Path, redis_cluster: LocalRedisCluster) -> None:
    _save_all(tmp_path / "a", redis_cluster.url)
    victim = redis_cluster.nodes[0]
    on_victim = {bytes(m) for m in manifests(victim.client())}
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
