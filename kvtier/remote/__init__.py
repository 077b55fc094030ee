"""The remote tier: a Redis (or Valkey) server or Redis Cluster shared by many servers."""

from __future__ import annotations

from kvtier.config import CacheConfig
from kvtier.metrics import Counters
from kvtier.remote.address import RemoteAddress, parse_remote
from kvtier.remote.tier import RemoteRecord, RemoteTier

__all__ = ["RemoteAddress", "RemoteRecord", "RemoteTier", "open_remote", "parse_remote"]


def open_remote(config: CacheConfig, counters: Counters, *, writer: bool) -> RemoteTier | None:
    """The store's remote tier, if ``config.remote`` names one (else None). Connecting is
    lazy: a server that is down now is a miss now and is used once it is back."""
    if not config.remote:
        return None
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        from kvtier.errors import ConfigError

        raise ConfigError("remote: the remote tier needs the redis client; "
                          "pip install 'kvtier[remote]'") from exc
    return RemoteTier(url=config.remote, password=config.remote_password, tls_ca=config.remote_tls_ca,
                      timeout_s=float(config.remote_timeout_s), part_bytes=int(config.remote_part_bytes),
                      queue_bytes=int(config.remote_queue_bytes), counters=counters,
                      connections=4 * config.io_threads + 8, writer=writer)
