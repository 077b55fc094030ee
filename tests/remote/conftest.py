"""Real ``redis-server`` processes on loopback ports for the remote-tier tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.testing.redis_server import LocalRedis, LocalRedisCluster


@pytest.fixture(scope="module")
def _module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    server = LocalRedis(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_server(_module_redis: LocalRedis) -> Iterator[LocalRedis]:
    """A running server, empty at the start of each test (restarted if a test killed it)."""
    if _module_redis.proc is None or _module_redis.proc.poll() is not None:
        _module_redis.start()
    _module_redis.client().flushall()
    yield _module_redis


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[LocalRedisCluster]:
    cluster = LocalRedisCluster(tmp_path / "cluster", 3)
    yield cluster
    cluster.stop()
