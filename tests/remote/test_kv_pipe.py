"""A KV pipe between two real processes, through Redis (server and cluster) and a directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.errors import ConfigError, RecordError
from kvtier.pipe import KVPipe
from kvtier.testing.redis_server import LocalRedis, LocalRedisCluster

PEER = Path(__file__).with_name("_pipe_peer.py")


def _run_pair(where: str, name: str) -> None:
    # the consumer starts first and waits: the FIFO order, not the start order, matters
    recv = subprocess.Popen([sys.executable, str(PEER), "recv", where, name],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    send = subprocess.run([sys.executable, str(PEER), "send", where, name],
                          capture_output=True, text=True, timeout=120)
    assert send.returncode == 0, send.stderr
    out, err = recv.communicate(timeout=120)
    assert recv.returncode == 0, err
    assert out.strip() == "received 9"


def test_producer_and_consumer_processes_through_a_redis_server(redis_server: LocalRedis) -> None:
    _run_pair(redis_server.url, "prefill-to-decode")
    keys = list(redis_server.client().scan_iter(match="kvt:*"))
    assert keys == []  # every message deleted once received


def test_producer_and_consumer_processes_through_a_redis_cluster(redis_cluster: LocalRedisCluster) -> None:
    _run_pair(redis_cluster.url, "p")


def test_producer_and_consumer_processes_through_a_directory(tmp_path: Path) -> None:
    _run_pair(str(tmp_path / "pipes"), "p")
    assert not list((tmp_path / "pipes" / "p").glob("*.msg"))


def test_fifo_resumes_after_either_side_restarts(tmp_path: Path) -> None:
    where = str(tmp_path)
    with KVPipe(where, "r") as p:
        for i in range(3):
            p.send_tensor(torch.full((2,), float(i)))
    with KVPipe(where, "r") as c:
        assert c.recv_tensor(timeout=1).tolist() == [0.0, 0.0]
    with KVPipe(where, "r") as c, KVPipe(where, "r") as p:
        p.send_tensor(torch.full((2,), 3.0))
        assert [c.recv_tensor(timeout=1)[0].item() for _ in range(3)] == [1.0, 2.0, 3.0]
        with pytest.raises(TimeoutError, match="nothing to receive"):
            c.recv_tensor(timeout=0.1)


def test_a_damaged_message_is_an_error_not_a_wrong_tensor(tmp_path: Path) -> None:
    with KVPipe(tmp_path, "d") as p:
        p.send_tensor(torch.randn(64))
        (msg,) = (tmp_path / "d").glob("*.msg")
        data = bytearray(msg.read_bytes())
        data[-5] ^= 0xFF
        msg.write_bytes(bytes(data))
        with pytest.raises(RecordError, match="checksum"):
            p.recv_tensor(timeout=1)


def test_bad_pipe_names_and_places(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pipe name"):
        KVPipe(tmp_path, "a/b")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        KVPipe(tmp_path / "f", "p")


def test_a_failed_send_does_not_stall_the_fifo(tmp_path: Path) -> None:
    """A message that could not be stored (here: the first write fails, as on a full disk or
    a refusing server) leaves its place marked skipped; the consumer moves on."""
    with KVPipe(tmp_path, "f") as p:
        real_put, calls = p._store.put, []

        def failing_once(key: bytes, header: bytes, payload: memoryview) -> None:
            calls.append(header)
            if len(calls) == 1:
                raise OSError("injected: no space left on device")
            real_put(key, header, payload)

        p._store.put = failing_once
        with pytest.raises(OSError, match="injected"):
            p.send_tensor(torch.zeros(8))
        p.send_tensor(torch.ones(4))
        assert p.recv_tensor(timeout=2).tolist() == [1.0] * 4  # the failed one is skipped
        assert len(calls) == 3  # the failed message, its skip marker, the next message


def test_unsupported_tensors_are_refused_before_taking_a_place(tmp_path: Path) -> None:
    with KVPipe(tmp_path, "u") as p:
        with pytest.raises(ValueError, match="cannot send"):
            p.send_tensor(torch.zeros(2, dtype=torch.complex64))
        p.send_tensor(torch.ones(1))
        assert p.recv_tensor(timeout=1).tolist() == [1.0]
