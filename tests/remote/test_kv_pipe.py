"""A KV pipe between two real processes, through Redis (server and cluster) and a directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvtier.errors import ConfigError, RecordError
from kvtier.pipe import KVPipe, _message_key
from kvtier.remote.tier import chunk_name
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
    keys = list(redis_server.client().scan_iter(match="kvt2:*"))
    assert keys == []  # every message deleted once received


def test_a_server_address_in_any_case_is_a_server_and_a_mistyped_one_an_error(
        redis_server: LocalRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``REDIS://`` (accepted as the cache's ``remote``) made a directory of that name in the
    working directory, where the other side never looked; so did ``redis:/`` (one slash)."""
    monkeypatch.chdir(tmp_path)
    scheme, rest = redis_server.url.split("://", 1)
    with KVPipe(f"{scheme.upper()}://{rest}", "p") as sender, KVPipe(redis_server.url, "p") as receiver:
        sender.send_tensor(torch.arange(4.0))
        assert receiver.recv_tensor(timeout=10).tolist() == [0.0, 1.0, 2.0, 3.0]
    for mistyped, message in ((f"{scheme}:/{rest}", "not a server address"), (f"http://{rest}", "unknown scheme"),
                              ("Redis://127.0.0.1", "is not HOST:PORT")):
        with pytest.raises(ConfigError, match=f"remote: .*{message}"):
            KVPipe(mistyped, "p")
    assert list(tmp_path.iterdir()) == []  # no directory made of an address


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
    # arguments of the wrong type say what to give (they failed deep inside: "argument of
    # type 'int' is not iterable", "'list' object has no attribute 'detach'")
    for kwargs, message in (({"timeout_s": None}, r"KVPipe\(timeout_s\): must be a number of seconds, got None"),
                            ({"timeout_s": 0}, r"KVPipe\(timeout_s\): must be above 0 seconds"),
                            ({"skip_after_s": "5"}, r"KVPipe\(skip_after_s\): must be a number of seconds"),
                            ({"max_tensor_bytes": 0}, r"KVPipe\(max_tensor_bytes\): must be a positive integer")):
        with pytest.raises(ConfigError, match=message):  # (None blocked a Redis socket for good)
            KVPipe(tmp_path / "pipes", "p", **kwargs)  # type: ignore[arg-type]
    for name in (".", ".."):  # (".." put the pipe's files beside its directory)
        with pytest.raises(ConfigError, match="not '.' or '..'"):
            KVPipe(tmp_path / "pipes", name)
    with pytest.raises(ConfigError, match="pipe name 5: must be non-empty"):
        KVPipe(tmp_path, 5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="where must be a redis:// address or a directory path, got int"):
        KVPipe(5, "p")  # type: ignore[arg-type]
    with KVPipe(tmp_path, "p") as p:
        with pytest.raises(TypeError, match="send_tensor takes a torch.Tensor or None, got list"):
            p.send_tensor([1, 2])  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"recv_tensor\(timeout\): must be a number of seconds, got '1'"):
            p.recv_tensor(timeout="1")  # type: ignore[arg-type]
        p.send_tensor(torch.ones(2))  # nothing above took a place in the order
        assert p.recv_tensor(timeout=2).tolist() == [1.0, 1.0]


def test_producers_side_by_side_on_a_directory_lose_no_message(tmp_path: Path) -> None:
    """Two producers (threads here; processes alike) sending at once: each message takes
    its own place and arrives (a counter read and rewritten without a lock gave two of them
    one place, and a temp file named by the process alone mixed two threads' messages)."""
    import threading

    per = 150

    def produce(base: int) -> None:
        with KVPipe(tmp_path, "many") as p:
            for i in range(per):
                p.send_tensor(torch.tensor([float(base + i)]))

    threads = [threading.Thread(target=produce, args=(b,)) for b in (0, 1000)]
    for t in threads:
        t.start()
    with KVPipe(tmp_path, "many", skip_after_s=1.0) as c:
        got = [c.recv_tensor(timeout=20).item() for _ in range(2 * per)]
    for t in threads:
        t.join(30)
    assert sorted(got) == [float(i) for i in range(per)] + [float(1000 + i) for i in range(per)]


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
        assert p.stats() == {"received": 1, "skipped": 1, "damaged": 0, "too_large": 0}


def test_unsupported_tensors_are_refused_before_taking_a_place(tmp_path: Path) -> None:
    with KVPipe(tmp_path, "u") as p:
        with pytest.raises(ValueError, match="cannot send"):
            p.send_tensor(torch.zeros(2, dtype=torch.complex64))
        p.send_tensor(torch.ones(1))
        assert p.recv_tensor(timeout=1).tolist() == [1.0]
    with KVPipe(tmp_path, "big", max_tensor_bytes=1000) as p:  # the receiver would refuse it
        with pytest.raises(ValueError, match="over this pipe's largest message, 1000 bytes"):
            p.send_tensor(torch.zeros(1001, dtype=torch.bool))
        p.send_tensor(torch.ones(2))
        assert p.recv_tensor(timeout=1).tolist() == [1.0, 1.0]  # no place was taken by the refusal


def test_a_server_over_its_memory_limit_still_lets_the_consumer_take_its_messages(redis_server: LocalRedis) -> None:
    """The docs ask for a server that does not evict. Over its maxmemory such a server refused
    the tail advance that comes before a receive deletes its message, so the consumer, the
    one side that frees memory, was stuck for good."""
    c = redis_server.client()
    msgs = [torch.full((1 << 18,), float(i)) for i in range(4)]  # 1 MiB each
    with KVPipe(redis_server.url, "full") as prod, KVPipe(redis_server.url, "full") as cons:
        for m in msgs:
            prod.send_tensor(m)
        old = c.config_get("maxmemory*")
        try:
            c.config_set("maxmemory-policy", "noeviction")
            c.config_set("maxmemory", int(c.info("memory")["used_memory"]) - (1 << 20))
            with pytest.raises(Exception, match="maxmemory"):
                c.set("kvtier-test-probe", b"x" * 1024)  # (the server is full)
            for m in msgs:
                assert torch.equal(cons.recv_tensor(timeout=10), m)
        finally:
            c.config_set("maxmemory", old["maxmemory"])
            c.config_set("maxmemory-policy", old["maxmemory-policy"])


def test_a_server_that_refuses_the_scripts_flags_gets_the_script_without_them(
        redis_server: LocalRedis, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before Redis 7 a script's first line cannot carry flags: the advance falls back to the
    plain script (here a flag this server does not know stands in for an older server)."""
    from kvtier import pipe

    monkeypatch.setattr(pipe, "_ADVANCE_LUA", "#!lua flags=no-such-flag" + pipe._ADVANCE_BODY)
    with KVPipe(redis_server.url, "old") as prod, KVPipe(redis_server.url, "old") as cons:
        for i in range(2):
            prod.send_tensor(torch.full((3,), float(i)))
        assert [cons.recv_tensor(timeout=10).tolist() for _ in range(2)] == [[0.0] * 3, [1.0] * 3]


@pytest.mark.parametrize("damage", ["manifest", "cut_short", "not_a_string"])
def test_a_damaged_redis_message_raises_once_and_the_next_one_follows(redis_server: LocalRedis, damage: str) -> None:
    """A damaged manifest, a value cut short or another program's value under the message's key
    is consumed and raises RecordError once; it used to read as "not sent yet", and every
    later message waited behind it for ever."""
    c = redis_server.client()
    with KVPipe(redis_server.url, "dm") as prod, KVPipe(redis_server.url, "dm") as cons:
        prod.send_tensor(torch.randn(5 << 18))  # 5 MiB: two 4 MiB parts
        prod.send_tensor(torch.ones(3))
        m1 = chunk_name(_message_key("dm", "seq:1"))
        value = c.get(m1)
        assert len(value) > 5 << 20  # read in two 4 MiB pieces
        if damage == "manifest":
            c.setrange(m1, 30, bytes([value[30] ^ 0xFF]))
        elif damage == "cut_short":
            c.set(m1, value[: 4 << 20])
        else:
            c.delete(m1)
            c.rpush(m1, b"not a message")
        with pytest.raises(RecordError, match="damaged message"):
            cons.recv_tensor(timeout=2)
        assert cons.recv_tensor(timeout=2).tolist() == [1.0, 1.0, 1.0]
        assert cons.stats() == {"received": 1, "skipped": 0, "damaged": 1, "too_large": 0}
        assert list(c.scan_iter(match="kvt2:*")) == []  # the damaged one too
        with pytest.raises(TimeoutError):
            cons.recv_tensor(timeout=0.05)


def test_a_truncated_file_message_raises_once_and_the_next_one_follows(tmp_path: Path) -> None:
    with KVPipe(tmp_path, "t") as p:
        p.send_tensor(torch.randn(64))
        p.send_tensor(torch.ones(2))
        msg = tmp_path / "t" / f"{_message_key('t', 'seq:1').hex()}.msg"
        msg.write_bytes(b"\xff\xff")
        with pytest.raises(RecordError, match="truncated"):
            p.recv_tensor(timeout=1)
        assert not msg.exists()
        assert p.recv_tensor(timeout=1).tolist() == [1.0, 1.0]


def test_a_lost_head_increment_reply_is_skipped_after_the_grace_period(redis_server: LocalRedis) -> None:
    """The INCR of the head ran on the server but its reply was lost: the send raised before
    it could leave a skip marker. The consumer waits while nothing later was sent, then gives
    the empty place up ``skip_after_s`` after a later one was taken."""
    with KVPipe(redis_server.url, "h", skip_after_s=0.5) as prod, \
            KVPipe(redis_server.url, "h", skip_after_s=0.5) as cons:
        real = prod._store.next_seq

        def reply_lost(counter: str) -> int:
            real(counter)
            raise OSError("injected: the reply timed out")

        prod._store.next_seq = reply_lost
        with pytest.raises(OSError, match="injected"):
            prod.send_tensor(torch.zeros(8))
        prod._store.next_seq = real
        with pytest.raises(TimeoutError):  # place 1 taken, nothing later: maybe still coming
            cons.recv_tensor(timeout=0.2)
        prod.send_tensor(torch.ones(4))
        t0 = time.monotonic()
        assert cons.recv_tensor(timeout=5).tolist() == [1.0] * 4
        assert time.monotonic() - t0 >= 0.45  # the grace period was waited out
        assert cons.stats()["skipped"] == 1


def test_a_send_stalled_after_taking_its_place_is_skipped(redis_server: LocalRedis) -> None:
    """The server stalls right after the head INCR: the message put times out, the circuit
    breaker opens, and the skip marker fails at once on it. The next send is received."""
    c = redis_server.client()
    pid = redis_server.proc.pid
    with KVPipe(redis_server.url, "s", timeout_s=0.3, skip_after_s=0.2) as prod, \
            KVPipe(redis_server.url, "s", timeout_s=0.3, skip_after_s=0.2) as cons:
        real = prod._store.next_seq

        def then_stall(counter: str) -> int:
            n = real(counter)
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(0.6, os.kill, (pid, signal.SIGCONT)).start()
            return n

        prod._store.next_seq = then_stall
        try:
            with pytest.raises(OSError):
                prod.send_tensor(torch.zeros(8))
        finally:
            prod._store.next_seq = real
        time.sleep(0.9)  # the server is back and the breaker's first back-off (0.5 s) over
        assert not c.exists(chunk_name(_message_key("s", "seq:1")))  # neither message nor marker
        prod.send_tensor(torch.ones(4))
        assert cons.recv_tensor(timeout=5).tolist() == [1.0] * 4
        assert cons.stats()["skipped"] == 1


def test_a_lost_tail_advance_reply_loses_no_message(redis_server: LocalRedis) -> None:
    """The tail advance ran but its reply was lost: that receive raises OSError, the next one
    returns the same message, and the retried advance does not step over the next message."""
    with KVPipe(redis_server.url, "ta") as prod, KVPipe(redis_server.url, "ta") as cons:
        prod.send_tensor(torch.zeros(2))
        prod.send_tensor(torch.ones(2))
        real, calls = cons._store.advance, []

        def reply_lost_once(counter: str, to: int) -> None:
            real(counter, to)
            calls.append(to)
            if len(calls) == 1:
                raise OSError("injected: the reply timed out")

        cons._store.advance = reply_lost_once
        with pytest.raises(OSError, match="injected"):
            cons.recv_tensor(timeout=2)
        assert cons.recv_tensor(timeout=2).tolist() == [0.0, 0.0]
        assert cons.recv_tensor(timeout=2).tolist() == [1.0, 1.0]
        assert calls == [1, 1, 2]
        assert redis_server.client().get("kvpipe:{ta}:tail") == b"2"


def test_a_message_over_the_consumers_limit_raises_once_and_the_next_one_follows(tmp_path: Path) -> None:
    """It used to raise RecordTooLarge on every receive: never consumed, the FIFO wedged."""
    from kvtier.errors import RecordTooLarge

    with KVPipe(tmp_path, "lim") as prod, KVPipe(tmp_path, "lim", max_tensor_bytes=1000) as cons:
        prod.send_tensor(torch.zeros(4000, dtype=torch.bool))
        prod.send_tensor(torch.ones(2))
        with pytest.raises(RecordTooLarge):
            cons.recv_tensor(timeout=2)
        assert cons.recv_tensor(timeout=2).tolist() == [1.0, 1.0]
        assert cons.stats()["too_large"] == 1


def test_a_receive_waits_while_the_server_is_down(tmp_path: Path) -> None:
    """recv_tensor on a server that is down at the start is a wait (TimeoutError at its
    timeout, naming the error), not an OSError at once."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    with KVPipe(f"redis://127.0.0.1:{port}", "down", timeout_s=0.2) as p:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="last error"):
            p.recv_tensor(timeout=1.0)
        assert time.monotonic() - t0 >= 0.9


def test_a_consumer_polling_ahead_of_its_producer_loses_nothing(redis_server: LocalRedis) -> None:
    """The consumer asks for each message just before it is sent: 22 of 400 were once lost
    as "damaged" (a key written between a load's two round trips)."""
    import random
    import threading

    n = 150
    with KVPipe(redis_server.url, "race") as prod, KVPipe(redis_server.url, "race") as cons:
        def produce() -> None:
            rng = random.Random(5)
            for i in range(n):
                time.sleep(rng.uniform(0, 0.003))
                prod.send_tensor(torch.full((4,), float(i)))

        t = threading.Thread(target=produce)
        t.start()
        got = [cons.recv_tensor(timeout=10)[0].item() for _ in range(n)]
        t.join()
        assert got == [float(i) for i in range(n)]
        assert cons.stats()["damaged"] == 0


def test_a_receive_from_a_server_that_refuses_the_credentials_raises_at_once(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Waiting (the default: no timeout) would never end, silently."""
    from kvtier.remote.tier import RemoteRefused

    server = LocalRedis(tmp_path_factory.mktemp("redis-auth"), password="right")
    try:
        bare = server.url.replace(":right@", "")
        with KVPipe(bare, "auth", password="wrong", timeout_s=1.0) as p:
            t0 = time.monotonic()
            with pytest.raises(RemoteRefused, match="credentials"):
                p.recv_tensor()  # no timeout
            assert time.monotonic() - t0 < 5
    finally:
        server.stop()
