"""Connections to the remote tier's servers: one Redis server or a Redis Cluster's primaries.

Keys are routed to the node that owns them (the cluster's slot map, read with
``CLUSTER SLOTS`` from any node that answers), and each node's commands go out as one
pipeline: one round trip per node per batch. Failures stay local to a node: a node that
refuses a connection or times out is skipped for a while (a circuit breaker with exponential
back-off), so a dead server costs at most one timeout per back-off period, never one per
request. redis-py reconnects by itself when the node is tried again.
"""

from __future__ import annotations

import bisect
import contextlib
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


# The largest piece of a value one ``sendall`` sends. The socket's timeout bounds each call
# whole, so a 32 MiB value in one call had to go out within remote_timeout_s (above 64 MiB/s
# at 0.5 s): a slower link, or a busy one, looked like a dead server. In pieces, the timeout
# bounds a wait for progress, as documented.
SEND_PIECE_BYTES = 1 << 20


class Joined(tuple):  # type: ignore[type-arg]
    """One command argument given as several buffers (a record's manifest and its payload),
    sent one after the other as a single value: neither this process nor the server joins
    them into one buffer first."""


def zero_copy_connection_classes() -> tuple[type, type]:
    """Connections (plain, TLS) that send memoryviews without copying them: redis-py's hiredis
    packer turns every argument into bytes first, two extra copies of each 32 MiB value. They
    also send a :class:`Joined` argument as one value."""
    from redis._parsers import Encoder
    from redis.connection import Connection, PythonRespSerializer, SSLConnection

    class JoiningSerializer(PythonRespSerializer):
        def pack(self, *args: Any) -> list[Any]:
            if not any(isinstance(a, Joined) for a in args):
                return super().pack(*args)  # type: ignore[no-any-return]
            out: list[Any] = []
            head = b"*%d\r\n" % len(args)
            for arg in args:
                parts = [p if isinstance(p, bytes) else memoryview(p).cast("B") for p in arg] \
                    if isinstance(arg, Joined) else [self.encode(arg)]
                out.append(head + b"$%d\r\n" % sum(len(p) for p in parts))
                for p in parts:  # (redis-py sends each item with one sendall)
                    out.extend(p[i:i + SEND_PIECE_BYTES] for i in range(0, len(p), SEND_PIECE_BYTES))
                head = b"\r\n"
            out.append(head)
            return out

    def packer() -> PythonRespSerializer:
        return JoiningSerializer(6000, Encoder("utf-8", "strict", False).encode)

    class ZeroCopyConnection(Connection):
        def _construct_command_packer(self, packer_arg: Any) -> Any:
            return packer()

    class ZeroCopySSLConnection(SSLConnection):
        def _construct_command_packer(self, packer_arg: Any) -> Any:
            return packer()

    return ZeroCopyConnection, ZeroCopySSLConnection


def is_stale_route(reply: object) -> bool:
    """An error reply that says this client's slot map is out of date: a key moved (MOVED,
    ASK), or a script was sent keys a node no longer serves ("non local key")."""
    from redis.exceptions import AskError, MovedError, ResponseError

    return isinstance(reply, MovedError | AskError) or (
        isinstance(reply, ResponseError) and "non local key" in str(reply))


class NodeUnavailable(Exception):
    """The node is down, timed out, or skipped while its back-off runs. ``refused``: it
    answered but refused this client (credentials, a database it lacks): waiting for it
    will not help."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class _Breaker:
    def __init__(self) -> None:
        self.down_until = 0.0
        self.backoff = BACKOFF_FIRST_S
        self.refusal: str | None = None  # why the node last refused this client, if it did

    def open_now(self) -> bool:
        return time.monotonic() < self.down_until

    def failed(self, refusal: str | None = None) -> None:
        self.down_until = time.monotonic() + self.backoff
        self.backoff = min(self.backoff * 2, BACKOFF_MAX_S)
        self.refusal = refusal

    def succeeded(self) -> None:
        self.down_until = 0.0
        self.backoff = BACKOFF_FIRST_S
        self.refusal = None

    def skipped(self, node: str) -> NodeUnavailable:
        """What a call skipped while the back-off runs raises (a refusal stays one)."""
        if self.refusal is not None:
            return NodeUnavailable(f"{node}: {self.refusal}", refused=True)
        return NodeUnavailable(node)


_Slots = tuple[list[int], list[tuple[int, int, str, int]]]  # range starts; (lo, hi, host, port)


class RedisNodes:
    """Route keys to nodes and run one pipeline per node, isolating each node's failures."""

    def __init__(self, address: RemoteAddress, timeout_s: float, max_connections: int,
                 tls_ca: str | None = None) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.crc import key_slot
        from redis.retry import Retry

        self.address = address
        self._redis = redis
        self._key_slot = key_slot
        self._timeout = timeout_s
        plain, tls = zero_copy_connection_classes()
        self._connection_class = tls if address.tls else plain
        self._kwargs: dict[str, Any] = dict(
            username=address.username, password=address.password, db=address.db,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # the breaker decides when to try again, not each call
            health_check_interval=0, max_connections=max_connections,
        )
        if address.tls:  # certificates verified; against the given CA, else the system's
            # and for this host: redis-py 5.x defaults ssl_check_hostname to False, which would
            # accept any certificate the CA signed, for any host
            self._kwargs.update(ssl_cert_reqs="required", ssl_ca_certs=tls_ca, ssl_check_hostname=True)
        self._lock = threading.Lock()
        self._breakers: dict[str, _Breaker] = {}
        self._clients: dict[str, Any] = {}
        self._cluster_mode = address.cluster
        self._detected = address.cluster
        self._slots: _Slots = ([], [])
        self._known: list[tuple[str, int]] = []
        self._refreshing = False
        self._last_refresh = 0.0
        self._single_name = "{}:{}".format(*address.nodes[0])

    # -- nodes ------------------------------------------------------------------------
    def _breaker(self, name: str) -> _Breaker:
        with self._lock:
            b = self._breakers.get(name)
            if b is None:
                b = self._breakers[name] = _Breaker()
            return b

    def _client(self, host: str, port: int) -> Any:
        """One node's client, with its own bounded connection pool; made once per node."""
        name = f"{host}:{port}"
        with self._lock:
            c = self._clients.get(name)
            if c is None:
                pool = self._redis.BlockingConnectionPool(
                    connection_class=self._connection_class, host=host, port=port,
                    timeout=self._timeout, **self._kwargs)
                c = self._clients[name] = self._redis.Redis(connection_pool=pool)
            return c

    # -- topology -----------------------------------------------------------------------
    def _detect(self) -> None:
        """A ``redis://`` address may name a cluster node: then route as a cluster."""
        b = self._breaker(self._single_name)
        if b.open_now():
            raise b.skipped(self._single_name)
        try:
            info = self._client(*self.address.nodes[0]).info("cluster")
        except self._redis.AuthenticationError as exc:
            b.failed(refusal := f"the server refused the credentials ({exc})")
            raise NodeUnavailable(f"{self._single_name}: {refusal}", refused=True) from exc
        except self._redis.ResponseError:  # INFO disabled (some managed services): one server
            info = {}
        except self._redis.RedisError as exc:
            b.failed()
            raise NodeUnavailable(f"{self._single_name}: {exc}") from exc
        self._detected = True
        if info.get("cluster_enabled"):
            self._cluster_mode = True
            log.info("kvtier: %s is a Redis Cluster node; routing keys by slot", self.address.describe())

    def _load_slots(self) -> None:
        """Read the slot map from the first node that answers: the seeds, then every node
        known so far."""
        errors = []
        for host, port in dict.fromkeys([*self.address.nodes, *self._known]):
            name = f"{host}:{port}"
            if self._breaker(name).open_now():
                continue
            try:
                reply = self._client(host, port).execute_command("CLUSTER SLOTS")
            except self._redis.RedisError as exc:
                self._breaker(name).failed()
                errors.append(f"{name}: {exc}")
                continue
            ranges = []
            for lo, hi, (h, p, *_), *_replicas in reply:  # [lo, hi, [host, port, id], replicas...]
                ranges.append((int(lo), int(hi), (h.decode() if isinstance(h, bytes) else h) or host, int(p)))
            ranges.sort()
            self._slots = ([r[0] for r in ranges], ranges)
            self._known = [(h, p) for _, _, h, p in ranges]
            return
        raise NodeUnavailable("no cluster node answered (" + ("; ".join(errors) or "all backing off") + ")")

    def refresh_later(self) -> None:
        """Re-read the slot map in the background (a failover moves slots to a replica)."""
        if not self._cluster_mode:
            return
        with self._lock:
            if self._refreshing or time.monotonic() - self._last_refresh < REFRESH_EVERY_S:
                return
            self._refreshing = True
            self._last_refresh = time.monotonic()

        def run() -> None:
            try:
                self._load_slots()
            except NodeUnavailable as exc:
                log.debug("kvtier: cluster slot refresh failed: %s", exc)
            finally:
                self._refreshing = False

        threading.Thread(target=run, name="kvtier-redis-refresh", daemon=True).start()

    def _owner(self, name: str) -> tuple[str, int] | None:
        starts, ranges = self._slots
        slot = self._key_slot(name.encode())
        i = bisect.bisect_right(starts, slot) - 1
        if i >= 0 and ranges[i][0] <= slot <= ranges[i][1]:
            return ranges[i][2], ranges[i][3]
        return None  # a slot no node serves

    def route(self, names: Sequence[str]) -> list[tuple[str, Any, list[int]]]:
        """Group ``names`` (as indexes into it) by the node that owns them:
        ``(node, client, indexes)``. Keys of a slot no node serves are left out (misses).
        Raises :class:`NodeUnavailable` when not even the topology can be read."""
        if not self._detected:
            self._detect()
        if not self._cluster_mode:
            return [(self._single_name, self._client(*self.address.nodes[0]), list(range(len(names))))]
        if not self._slots[1]:
            self._load_slots()
        groups: dict[tuple[str, int], list[int]] = {}
        for i, name in enumerate(names):
            owner = self._owner(name)
            if owner is not None:
                groups.setdefault(owner, []).append(i)
        return [(f"{h}:{p}", self._client(h, p), idx) for (h, p), idx in groups.items()]

    def run(self, node: str, client: Any, build: Callable[[Any], None]) -> list[Any]:
        """Run the commands ``build`` adds to a pipeline on one node, in one round trip.

        Returns the replies, with a command's own error (e.g. out of memory) in its place;
        raises :class:`NodeUnavailable` if the node is down or slow."""
        breaker = self._breaker(node)
        if breaker.open_now():
            raise breaker.skipped(node)
        try:
            with client.pipeline(transaction=False) as pipe:
                build(pipe)
                replies = pipe.execute(raise_on_error=False)
        except self._redis.AuthenticationError as exc:  # (a ConnectionError: before it)
            breaker.failed(refusal := f"the server refused the credentials ({exc})")
            raise NodeUnavailable(f"{node}: {refusal}", refused=True) from exc
        except (self._redis.ConnectionError, self._redis.TimeoutError, OSError) as exc:
            if "No connection available" not in str(exc):  # our own pool busy: not the node's fault
                breaker.failed()
                self.refresh_later()
            raise NodeUnavailable(f"{node}: {exc}") from exc
        except self._redis.RedisError as exc:
            # raised, not returned (raise_on_error=False returns each command's own error):
            # the connection's set-up was refused, e.g. SELECT of a database the server does
            # not have, or a server that wants a password none was given for. It will be
            # refused again: back off like a down node.
            breaker.failed(refusal := f"the server refused the connection's set-up ({exc}); check the "
                                      "address's database and the credentials")
            raise NodeUnavailable(f"{node}: {refusal}", refused=True) from exc
        breaker.succeeded()
        if any(is_stale_route(r) for r in replies):
            self.refresh_later()  # this batch's keys there are misses; the next ones route right
        return replies

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            with contextlib.suppress(Exception):  # closing sockets of a dead server
                c.close()
                c.connection_pool.disconnect()  # a pool passed in is not closed by close()
