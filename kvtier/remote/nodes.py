"""Connections to the remote tier's servers: one Redis server or a Redis Cluster's primaries.

Keys are routed to the node that owns them, and each node's commands go out as one pipeline
(one round trip per node per batch). Failures stay local to a node: a node that refuses a
connection or times out is skipped for a while (a circuit breaker with exponential back-off),
so a dead server costs at most one timeout per back-off period, never one per request.
redis-py reconnects by itself when the node is tried again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.remote.address import RemoteAddress

log = logging.getLogger("kvtier")

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 15.0
REFRESH_EVERY_S = 2.0


def zero_copy_connection_classes() -> tuple[type, type]:
    """Connections that send memoryviews without copying them (redis-py's hiredis packer turns
    every argument into bytes first: two extra copies of each 32 MiB value)."""
    from redis._parsers import Encoder
    from redis.connection import Connection, PythonRespSerializer, SSLConnection

    def packer(conn: Any) -> PythonRespSerializer:
        return PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)

    class ZeroCopyConnection(Connection):
        def _construct_command_packer(self, packer_arg: Any) -> Any:  # noqa: D401
            return packer(self)

    class ZeroCopySSLConnection(SSLConnection):
        def _construct_command_packer(self, packer_arg: Any) -> Any:
            return packer(self)

    return ZeroCopyConnection, ZeroCopySSLConnection


class NodeUnavailable(Exception):
    """The node is down, timed out, or skipped while its back-off runs."""


class _Breaker:
    def __init__(self) -> None:
        self.down_until = 0.0
        self.backoff = BACKOFF_FIRST_S

    def open_now(self) -> bool:
        return time.monotonic() < self.down_until

    def failed(self) -> None:
        self.down_until = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, BACKOFF_MAX_S)

    def succeeded(self) -> None:
        self.down_until = 0.0
        self.backoff = BACKOFF_FIRST_S


class RedisNodes:
    """Route keys to nodes and run one pipeline per node, isolating each node's failures."""

    def __init__(self, address: RemoteAddress, timeout_s: float, max_connections: int) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.address = address
        plain, tls = zero_copy_connection_classes()
        self._kwargs: dict[str, Any] = dict(
            username=address.username, password=address.password,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # our breaker retries, not each call
            health_check_interval=0, max_connections=max_connections,
        )
        self._connection_class = tls if address.tls else plain
        self._redis = redis
        self._lock = threading.Lock()
        self._breakers: dict[str, _Breaker] = {}
        self._single: Any = None
        self._cluster: Any = None
        self._cluster_mode = address.cluster
        self._detected = address.cluster
        self._refreshing = False
        self._last_refresh = 0.0
        self._single_name = "{}:{}".format(*address.nodes[0])
        if not address.cluster:
            host, port = address.nodes[0]
            pool = redis.BlockingConnectionPool(
                connection_class=self._connection_class, host=host, port=port, db=address.db,
                timeout=timeout_s, **self._kwargs)
            self._single = redis.Redis(connection_pool=pool)

    # -- topology -------------------------------------------------------------------
    def _breaker(self, name: str) -> _Breaker:
        with self._lock:
            b = self._breakers.get(name)
            if b is None:
                b = self._breakers[name] = _Breaker()
            return b

    def _ensure_cluster(self) -> Any:
        if self._cluster is None:
            from redis.cluster import ClusterNode, RedisCluster

            kw = {k: v for k, v in self._kwargs.items() if k != "max_connections"}
            self._cluster = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in self.address.nodes],
                connection_class=self._connection_class, require_full_coverage=False,
                max_connections=self._kwargs["max_connections"], **kw)
        return self._cluster

    def _detect(self) -> None:
        """A ``redis://`` address may name a cluster node: then route as a cluster."""
        if self._detected:
            return
        info = self._single.info("cluster")
        self._detected = True
        if info.get("cluster_enabled"):
            self._cluster_mode = True
            log.info("kvtier: %s is a Redis Cluster node; routing keys by slot", self.address.describe())

    def _refresh_later(self) -> None:
        """Re-read the cluster's slot map in the background (a failover moves slots)."""
        if not self._cluster_mode or self._cluster is None:
            return
        with self._lock:
            if self._refreshing or time.monotonic() - self._last_refresh < REFRESH_EVERY_S:
                return
            self._refreshing = True
            self._last_refresh = time.monotonic()

        def run() -> None:
            try:
                self._cluster.nodes_manager.initialize()
            except Exception as exc:
                log.debug("kvtier: cluster slot refresh failed: %s", exc)
            finally:
                self._refreshing = False

        threading.Thread(target=run, name="kvtier-redis-refresh", daemon=True).start()

    def route(self, names: Sequence[str]) -> list[tuple[str, Any, list[int]]]:
        """Group ``names`` (indexes into it) by the node that owns them: ``(node, client, idx)``.
        Raises :class:`NodeUnavailable` when not even the topology can be read."""
        single_name = self._single_name
        if not self._detected:
            b = self._breaker(single_name)
            if b.open_now():
                raise NodeUnavailable(single_name)
            try:
                self._detect()
            except self._redis.RedisError as exc:
                b.failed()
                raise NodeUnavailable(f"{single_name}: {exc}") from exc
        if not self._cluster_mode:
            return [(single_name, self._single, list(range(len(names))))]
        try:
            rc = self._ensure_cluster()
        except self._redis.RedisError as exc:
            raise NodeUnavailable(f"cluster {self.address.describe()}: {exc}") from exc
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, name in enumerate(names):
            try:
                node = rc.nodes_manager.get_node_from_slot(rc.keyslot(name))
            except self._redis.RedisError:
                continue  # a slot no node serves: a miss
            g = groups.get(node.name)
            if g is None:
                g = groups[node.name] = (node.redis_connection or rc.get_redis_connection(node), [])
            g[1].append(i)
        return [(n, client, idx) for n, (client, idx) in groups.items()]

    def run(self, node: str, client: Any, build: Callable[[Any], None]) -> list[Any]:
        """Run the commands ``build`` adds to a pipeline on one node, in one round trip.

        Returns the replies, with a command's own error (e.g. out of memory) in its place;
        raises :class:`NodeUnavailable` if the node is down or slow."""
        breaker = self._breaker(node)
        if breaker.open_now():
            raise NodeUnavailable(node)
        try:
            with client.pipeline(transaction=False) as pipe:
                build(pipe)
                replies = pipe.execute(raise_on_error=False)
        except (self._redis.ConnectionError, self._redis.TimeoutError, OSError) as exc:
            breaker.failed()
            self._refresh_later()
            raise NodeUnavailable(f"{node}: {exc}") from exc
        breaker.succeeded()
        if any(isinstance(r, self._redis.exceptions.MovedError | self._redis.exceptions.AskError)
               for r in replies):
            self._refresh_later()
        return replies

    def each_node(self) -> list[tuple[str, Any]]:
        """Every node (the server, or the cluster's primaries), for maintenance commands."""
        self.route([])
        if not self._cluster_mode:
            return [(self._single_name, self._single)]
        rc = self._ensure_cluster()
        return [(n.name, n.redis_connection or rc.get_redis_connection(n)) for n in rc.get_primaries()]

    def close(self) -> None:
        for c in (self._single, self._cluster):
            try:
                if c is not None:
                    c.close()
            except Exception:  # closing sockets of a dead server: nothing to do
                pass
