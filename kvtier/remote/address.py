"""The ``remote`` setting: which Redis (or Valkey) server or cluster holds the shared tier.

Accepted forms::

    redis://[[USER]:PASSWORD@]HOST:PORT[/DB]     one server (a cluster node is detected)
    rediss://...                                  the same over TLS
    redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]
    rediss+cluster://...                          seed nodes of a Redis Cluster (over TLS)

A password may also come from the ``remote_password`` setting, which keeps it out of URLs
that end up in logs and process listings.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

from kvtier.errors import ConfigError

_SCHEMES = {"redis": (False, False), "rediss": (True, False),
            "redis+cluster": (False, True), "rediss+cluster": (True, True)}


@dataclass(frozen=True)
class RemoteAddress:
    nodes: tuple[tuple[str, int], ...]
    tls: bool
    cluster: bool  # True: named a cluster; False: one server (detected as a cluster node later)
    db: int = 0
    username: str | None = None
    password: str | None = None

    def describe(self) -> str:
        """The address without its password, for logs and error messages."""
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{hosts}" + (f"/{self.db}" if self.db else "")


_MAX_DB = 2**31 - 1  # Redis's `databases` setting is an int


def redact(url: object) -> object:
    """``url`` with the credentials before its last ``@`` hidden (the user name kept), for
    messages and logs; well-formed or not, so a mistyped URL's password is not printed."""
    if not isinstance(url, str) or "@" not in url:
        return url
    at = url.rfind("@")
    start = url.find("://")
    start = start + 3 if 0 <= start < at else 0
    user, sep, _ = url[start:at].partition(":")
    return url[:start] + (f"{user}:***" if sep else "***") + url[at:]


def parse_remote(url: object, password: str | None = None) -> RemoteAddress:
    """Parse the ``remote`` setting; a :class:`ConfigError` says what is wrong and the form."""
    form = ("expected redis://HOST:PORT[/DB], rediss://..., redis+cluster://HOST:PORT[,HOST:PORT...] "
            "or rediss+cluster://...")
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"remote: {redact(url)!r} is not a server address; {form}")
    scheme, rest = url.split("://", 1)
    if scheme.lower() not in _SCHEMES:
        raise ConfigError(f"remote: unknown scheme {scheme!r}; {form}")
    tls, cluster = _SCHEMES[scheme.lower()]
    username = None
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        user, sep, pw = cred.partition(":")
        username = unquote(user) or None
        if sep:
            if password is not None and unquote(pw) != password:
                raise ConfigError("remote: a password is given both in the URL and in remote_password; "
                                  "give it once")
            password = unquote(pw)
    hosts, _, db_part = rest.partition("/")
    db = 0
    if db_part:
        if not (db_part.isascii() and db_part.isdigit()):  # (not "²": isdigit, yet int() refuses it)
            raise ConfigError(f"remote: database {db_part!r} must be a number; {form}")
        db = int(db_part)
        if db > _MAX_DB:
            raise ConfigError(f"remote: database {db_part} is out of range (0 to {_MAX_DB})")
        if cluster and db:
            raise ConfigError("remote: Redis Cluster has only database 0; drop the /DB part")
    nodes = []
    for hp in hosts.split(","):
        host, sep, port = hp.strip().rpartition(":")
        host = host.strip("[]")  # IPv6 literals: [::1]:6379
        if not sep or not host or any(c.isspace() or c in "/@" for c in host) or not (port.isascii() and port.isdigit()) \
                or not 0 < int(port) < 65536:
            raise ConfigError(f"remote: {hp!r} is not HOST:PORT (a port from 1 to 65535); {form}")
        nodes.append((host, int(port)))
    if len(nodes) > 1 and not cluster:
        raise ConfigError("remote: several hosts are given for one server; use redis+cluster:// "
                          "to list a cluster's seed nodes")
    return RemoteAddress(tuple(nodes), tls, cluster, db, username, password)
