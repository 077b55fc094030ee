"""Real ``redis-server`` processes on loopback ports, for tests and benchmarks.

Each server runs in its own directory with persistence off, a memory limit and an LRU
policy (the remote tier's budget), and can be killed and started again on the same port.
A :class:`LocalRedisCluster` is several such servers joined into a Redis Cluster.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

INSTALL_HINT = ("redis-server is not installed; `bash scripts/dev-env.sh` installs it "
                "(Debian/Ubuntu: apt-get install redis-server)")


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError(INSTALL_HINT)
    return found


def free_port() -> int:
    """A free loopback port below 55536 whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = random.randint(20000, 55000)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free loopback port for redis-server")


class LocalRedis:
    """One ``redis-server`` on 127.0.0.1 (with ``persist``, its data survives a kill)."""

    def __init__(self, workdir: Path, *, maxmemory: str = "512mb", port: int | None = None,
                 password: str | None = None, cluster: bool = False, persist: bool = False,
                 tls: tuple[Path, Path, Path] | None = None) -> None:
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.password = password
        self.args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                     "--save", "", "--dir", str(self.dir),
                     # persist: every write logged and fsynced, so a killed server restarts with its data
                     "--appendonly", "yes" if persist else "no", "--appendfsync", "always",
                     "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru",
                     "--logfile", str(self.dir / "redis.log")]
        if password:
            self.args += ["--requirepass", password]
        self.tls = tls  # (certificate, key, CA): TLS only, on self.port
        if tls:
            cert, key, ca = tls
            self.args[1:3] = ["--port", "0"]
            self.args += ["--tls-port", str(self.port), "--tls-cert-file", str(cert),
                          "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca),
                          "--tls-auth-clients", "no"]
        if cluster:
            self.args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf",
                          "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no",
                          "--cluster-allow-reads-when-down", "yes"]
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}"

    def client(self):  # noqa: ANN201 - a redis.Redis
        import redis

        tls = dict(ssl=True, ssl_ca_certs=str(self.tls[2])) if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **tls)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return
            except Exception:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not start; see {self.dir / 'redis.log'}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        self.kill()


def make_test_certificates(workdir: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 (``openssl``): (cert, key, CA)."""
    d = Path(workdir)
    d.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, cwd=d, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
            "-days", "2", "-subj", "/CN=kvtier test CA")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=127.0.0.1")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "san.ext")
    return d / "server.pem", d / "server.key", d / "ca.pem"


class LocalRedisCluster:
    """A Redis Cluster of ``n`` primaries (no replicas) on loopback. Nodes keep serving their
    own slots when one dies (``cluster-require-full-coverage no``)."""

    def __init__(self, workdir: Path, n: int = 3, *, maxmemory: str = "256mb") -> None:
        self.nodes = [LocalRedis(Path(workdir) / f"node{i}", maxmemory=maxmemory, cluster=True)
                      for i in range(n)]
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError(INSTALL_HINT)
        subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{s.port}" for s in self.nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if all(s.client().cluster("info").get("cluster_state") == "ok" for s in self.nodes):
                return
            time.sleep(0.1)
        raise RuntimeError("the local Redis Cluster did not reach cluster_state:ok")

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.nodes)

    def stop(self) -> None:
        for s in self.nodes:
            s.kill()
