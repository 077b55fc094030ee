"""The remote tier on a real redis-server: sharing, faults, damage, budgets, configuration."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from remotehelpers import CHUNK, chunk_keys, keys_of, kv_for, open_cache, tokens, wait_for

from kvtier import CacheConfig, ConfigError
from kvtier.metrics import Counters
from kvtier.remote.address import parse_remote
from kvtier.remote.nodes import RedisNodes
from kvtier.remote.tier import RemoteTier, chunk_name
from kvtier.testing.redis_server import LocalRedis

SEQ = tokens(1, 4 * CHUNK + 8)  # four chunks and a tail


def _tier(url: str, counters: Counters | None = None, timeout_s: float = 1.0) -> RemoteTier:
    """A remote tier without its uploader thread, in 64 KiB pieces."""
    return RemoteTier(url=url, password=None, timeout_s=timeout_s, part_bytes=1 << 16, queue_bytes=1,
                      counters=counters or Counters(), writer=False)


@contextlib.contextmanager
def _between_round_trips(tier: RemoteTier, action: Callable[[], None]) -> Iterator[None]:
    """Run ``action`` between the two round trips of ``tier``'s next load (a new tier's first
    call asks the node's largest value)."""
    real, calls = tier.nodes.run, []

    def run(node, client, build):  # noqa: ANN001, ANN202
        out = real(node, client, build)
        calls.append(1)
        if len(calls) == 2:
            action()
        return out

    tier.nodes.run = run
    try:
        yield
    finally:
        tier.nodes.run = real


def test_a_second_server_hits_what_the_first_stored_and_promotes_it(tmp_path: Path, redis_server: LocalRedis) -> None:
    kv = kv_for(SEQ)
    with open_cache(tmp_path / "a", redis_server.url) as a:
        a.save(SEQ, kv)
        assert a.flush(30)
        assert a.stats()["remote_saves"] == 5
    assert len(chunk_keys(redis_server.client())) == 5
    with open_cache(tmp_path / "b", redis_server.url) as b:  # its own, empty local store
        assert b.stats()["disk_records"] == 0
        assert b.lookup(SEQ) == len(SEQ)
        got = b.load(SEQ)
        assert got is not None and torch.equal(got, kv)
        b.flush(30)
        stats = b.stats()
        assert stats["remote_hits"] == 5 and stats["corrupt_records"] == 0
        assert stats["disk_records"] == 5  # promoted to the local disk
        assert stats["remote_saves"] == 0  # and not uploaded back
    redis_server.kill()
    with open_cache(tmp_path / "b", redis_server.url) as b:  # server gone: the local copy serves
        assert torch.equal(b.load(SEQ), kv)


def test_a_dead_server_is_misses_and_counters_and_hits_resume_when_it_is_back(tmp_path: Path, redis_server: LocalRedis) -> None:
    kv = kv_for(SEQ)
    with open_cache(tmp_path / "a", redis_server.url) as a:
        a.save(SEQ, kv)
        a.flush(30)
    redis_server.kill()
    with open_cache(tmp_path / "b", redis_server.url) as b:
        t0 = time.monotonic()
        for _ in range(50):  # the scheduler asks every step: each answer must be quick
            assert b.lookup(SEQ) == 0
        assert b.load(SEQ).shape[2] == 0
        got = b.store.load(keys_of(SEQ)[0])  # the store's own answer says why
        assert got.outcome.value == "miss" and "the remote tier is unavailable" in got.why, got
        other = tokens(2, 2 * CHUNK)
        b.save(other, kv_for(other))  # uploads are dropped and counted, the local save stays
        b.flush(10)
        assert time.monotonic() - t0 < 5
        stats = b.stats()
        assert stats["remote_errors"] >= 1 and stats["remote_dropped"] >= 2
        assert b.lookup(other) == len(other)  # the local tier is unaffected
        redis_server.start()
        redis_server.client().flushall()
        # the KV was lost with the server; store it again from another server...
        with open_cache(tmp_path / "a2", redis_server.url) as a:
            a.save(SEQ, kv)
            a.flush(30)
        # ... and the first one reconnects by itself once its back-off ends
        assert wait_for(lambda: b.lookup(SEQ) == len(SEQ), timeout=20)
        assert torch.equal(b.load(SEQ), kv)


@pytest.mark.parametrize("damage", ["flip_first_piece", "flip_last_piece", "truncate", "extend",
                                    "flip_manifest", "manifest_only", "other_version", "not_a_string",
                                    "swapped"])
def test_damaged_values_in_the_server_are_misses(tmp_path: Path, redis_server: LocalRedis, damage: str) -> None:
    seq = tokens(3, CHUNK)  # one chunk: 64 KiB of float32 KV, read in two 64 KiB pieces
    other = tokens(4, CHUNK)
    kv = kv_for(seq)
    with open_cache(tmp_path / "a", redis_server.url) as a:
        a.save(seq, kv)
        a.save(other, kv_for(other))
        a.flush(30)
    c = redis_server.client()
    mine, theirs = chunk_name(keys_of(seq)[0]), chunk_name(keys_of(other)[0])
    assert set(chunk_keys(c)) == {mine.encode(), theirs.encode()}
    value = c.get(mine)
    assert 64 << 10 < len(value) < 65 << 10  # the manifest and the payload, in one value

    def flip(at: int) -> None:
        c.setrange(mine, at, bytes([value[at] ^ 0x10]))

    if damage == "flip_first_piece":
        flip(1000)
    elif damage == "flip_last_piece":
        flip(len(value) - 10)
    elif damage == "truncate":
        c.set(mine, value[:-100])
    elif damage == "extend":
        c.append(mine, b"more")
    elif damage == "flip_manifest":
        flip(30)
    elif damage == "manifest_only":
        c.set(mine, value[:300])
    elif damage == "other_version":  # under this format's key, another format's value
        flip(4)
    elif damage == "not_a_string":  # another program's value under the key
        c.delete(mine)
        c.rpush(mine, b"x")
    else:  # the other prompt's whole chunk under this one's key
        c.copy(theirs, mine, replace=True)
    with open_cache(tmp_path / "b", redis_server.url) as b:
        assert b.load(seq).shape[2] == 0  # a miss: never wrong KV, never an exception
        stats = b.stats()
        assert stats["remote_corrupt"] == 1 and stats["remote_hits"] == 0
        # said as what it is, however the damage was found (a value cut short read as "not
        # stored" before, a flipped byte as corrupt)
        assert stats["corrupt_records"] == 1, stats
        assert b.lookup(seq) == 0  # deleted: no lookup promises it again
        assert torch.equal(b.load(other), kv_for(other))  # the other chunk is untouched
    assert not c.exists(mine)  # hidden from every server from now on


def test_under_lru_eviction_a_chunk_is_evicted_whole(redis_server: LocalRedis) -> None:
    """A full server under allkeys-lru evicts chunks, never some parts of one: every chunk
    left is whole, so a lookup promises only what a load delivers. (With a key per part,
    3 of 58 chunks kept all their parts in a burst like this one.)"""
    c = redis_server.client()
    payloads = {os.urandom(32): os.urandom(200_000) for _ in range(160)}  # 4 pieces of 64 KiB each
    c.config_set("maxmemory-policy", "allkeys-lru")
    c.config_set("maxmemory", str(c.info("memory")["used_memory"] + (8 << 20)))  # room for ~40
    counters = Counters()
    tier = _tier(redis_server.url, counters=counters, timeout_s=2.0)
    try:
        items = [(k, b"header", memoryview(v)) for k, v in payloads.items()]
        for i in range(0, len(items), 8):
            tier.store_many(items[i : i + 8])
        c.config_set("maxmemory", "512mb")  # (over maxmemory, reads evict too: none while we look)
        left = chunk_keys(c)
        assert 0 < len(left) < len(payloads) // 2  # the server evicted most of them
        for k in left:
            assert c.strlen(k) > 200_000  # whole
        for k, v in payloads.items():
            rec = tier.fetch(k)
            assert bool(rec) == (tier.count_present_prefix([k]) == 1)
            assert not rec or b"".join(bytes(p) for p in rec.pieces) == v
        assert counters.snapshot()["remote_corrupt"] == 0
    finally:
        tier.close(0)
        c.config_set("maxmemory", "512mb")
        c.config_set("maxmemory-policy", "allkeys-lru")


def test_a_server_that_refuses_writes_costs_counted_drops_not_errors(tmp_path: Path, redis_server: LocalRedis,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier")
    c = redis_server.client()
    c.config_set("maxmemory-policy", "noeviction")
    c.config_set("maxmemory", str(c.info("memory")["used_memory"] // 2))  # full already
    try:
        with open_cache(tmp_path / "a", redis_server.url) as a:
            a.save(SEQ, kv_for(SEQ))
            assert a.flush(30)
            stats = a.stats()
            assert stats["remote_dropped"] == 5 and stats["remote_saves"] == 0
            assert stats["saves_committed"] == 5  # the local tier has them all
            assert "set maxmemory-policy to allkeys-lru" in caplog.text  # out of memory: the advice
        assert chunk_keys(c) == []  # a refused chunk leaves nothing behind (no orphan parts)
    finally:
        c.config_set("maxmemory", "512mb")
        c.config_set("maxmemory-policy", "allkeys-lru")


def test_the_upload_queue_has_a_byte_budget(tmp_path: Path, redis_server: LocalRedis) -> None:
    """Uploads that pile up beside a stalled server stay within their budget (the rest is
    dropped and counted), and stats() shows the queue's usage beside that budget."""
    seqs = [tokens(10 + i, 2 * CHUNK) for i in range(20)]
    redis_server.client().client_pause(3000)  # the server stalls: uploads pile up
    with open_cache(tmp_path / "a", redis_server.url, remote_queue_bytes="100K", remote_timeout_s=5) as a:
        for s in seqs:
            a.save(s, kv_for(s))
        most = 0
        deadline = time.monotonic() + 2.5  # (within the pause)
        while time.monotonic() < deadline and a.stats()["remote_dropped"] == 0:
            most = max(most, a.stats()["remote_queued_bytes"])
            time.sleep(0.01)
        paused = a.stats()
        assert paused["remote_queue_budget_bytes"] == 100 << 10
        assert 0 < max(most, paused["remote_queued_bytes"]) <= 100 << 10
        a.flush(30)
        stats = a.stats()
    assert stats["remote_queued_bytes"] == 0
    assert stats["remote_dropped"] > 0  # 40 chunks of 32 KiB do not fit in 100 KiB
    assert stats["remote_saves"] + stats["remote_dropped"] == 40
    assert stats["saves_committed"] == 40


def test_password_in_the_url_or_a_setting(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    server = LocalRedis(tmp_path_factory.mktemp("redis-auth"), password="s3cret")
    try:
        bare = server.url.replace(":s3cret@", "")
        kv = kv_for(SEQ)
        with open_cache(tmp_path / "a", bare, remote_password="s3cret") as a:
            a.save(SEQ, kv)
            a.flush(30)
            assert a.stats()["remote_saves"] == 5
        with open_cache(tmp_path / "b", server.url) as b:
            assert torch.equal(b.load(SEQ), kv)
        with open_cache(tmp_path / "c", bare, remote_password="wrong") as c:
            assert c.load(SEQ).shape[2] == 0 and c.stats()["remote_errors"] >= 1
    finally:
        server.stop()


@pytest.mark.parametrize(("url", "message"), [
    ("localhost:6379", "not a server address"),
    ("http://h:1", "unknown scheme"),
    ("redis://h", "is not HOST:PORT"),
    ("redis://h:99999", "is not HOST:PORT"),
    ("redis://h:1/x", "must be a number"),
    ("redis://a:1,b:2", "several hosts"),
    ("redis+cluster://a:1/2", "only database 0"),
    ("redis://h :1", "is not HOST:PORT"),
    ("redis://h:1/99999999999999999999", "out of range"),
    ("redis:/:hunter2@127.0.0.1:1", "not a server address"),
    ("redis//user:hunter2@h:1", "not a server address"),
    ("redis://h:6379\u00b2", "is not HOST:PORT"),  # (a superscript two: a digit to isdigit(), not to int())
    ("redis://h:1/\u00b2", "must be a number"),
])
def test_bad_addresses_are_refused_with_the_accepted_forms(tmp_path: Path, url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        CacheConfig(path=tmp_path, remote=url)
    assert "hunter2" not in str(err.value)  # a mistyped URL's password is not printed


def test_the_config_never_shows_a_password() -> None:
    cfg = CacheConfig(path=Path("/nonexistent-kvtier"), remote="redis://app:hunter2@h:1", remote_tls_ca=None)
    shown = repr(cfg)
    assert "hunter2" not in shown and "redis://app:***@h:1" in shown
    assert "hunter2" not in repr(CacheConfig(path=Path("/nonexistent-kvtier"), remote="redis://h:1",
                                             remote_password="hunter2"))


def test_a_database_the_server_lacks_is_an_unavailable_server(redis_server: LocalRedis,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """SELECT refused while connecting: misses and a warning that names the cause, never an
    exception; the node then backs off like a down one (one refusal per back-off)."""
    from kvtier.pipe import KVPipe

    caplog.set_level(logging.WARNING, logger="kvtier")
    counters = Counters()
    tier = _tier(redis_server.url + "/99", counters=counters)
    try:
        key = os.urandom(32)
        assert tier.store_many([(key, b"header", memoryview(b"x"))]) == 0
        assert [tier.count_present_prefix([key]) for _ in range(20)] == [0] * 20
        assert not tier.fetch(key)
        assert "DB index is out of range" in caplog.text and "check the address's database" in caplog.text
        assert counters.snapshot()["remote_dropped"] == 1
    finally:
        tier.close(0)
    with KVPipe(redis_server.url + "/99", "p", timeout_s=1.0) as pipe:  # the pipe says so as OSError
        with pytest.raises(OSError, match="DB index is out of range"):
            pipe.send_tensor(torch.ones(2))
        with pytest.raises((OSError, TimeoutError)):
            pipe.recv_tensor(timeout=0.5)


def test_address_forms() -> None:
    a = parse_remote("rediss://user:p%40ss@cache.internal:6380/2")
    assert (a.nodes, a.tls, a.cluster, a.db, a.username, a.password) == (
        (("cache.internal", 6380),), True, False, 2, "user", "p@ss")
    assert "p@ss" not in a.describe()
    c = parse_remote("redis+cluster://10.0.0.1:7000,10.0.0.2:7000")
    assert c.cluster and c.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7000))
    with pytest.raises(ConfigError, match="give it once"):
        parse_remote("redis://:a@h:1", password="b")
    with pytest.raises(ConfigError, match="remote_part_bytes"):
        CacheConfig(path=Path("/nonexistent-kvtier"), remote_part_bytes="1G")


def test_a_hung_server_costs_one_timeout_per_back_off_not_one_per_lookup(tmp_path: Path, redis_server: LocalRedis) -> None:
    import os
    import signal

    kv = kv_for(SEQ)
    with open_cache(tmp_path / "a", redis_server.url, remote_timeout_s=0.3) as a:
        a.save(SEQ, kv)
        a.flush(30)
        a.store.host.clear()
        assert a.store.backend.usage()[0] == 5
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # accepts connections, never answers
    try:
        with open_cache(tmp_path / "b", redis_server.url, remote_timeout_s=0.3) as b:
            t0 = time.monotonic()
            for _ in range(100):
                assert b.lookup(SEQ) == 0
            elapsed = time.monotonic() - t0
            assert elapsed < 2.0, f"100 lookups against a hung server took {elapsed:.1f} s"
            assert b.stats()["remote_errors"] >= 1
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)


def test_tls_with_a_verified_certificate(tmp_path: Path) -> None:
    from kvtier.testing.redis_server import make_test_certificates

    cert, key, ca = make_test_certificates(tmp_path / "certs")
    server = LocalRedis(tmp_path / "redis-tls", tls=(cert, key, ca))
    try:
        assert server.url.startswith("rediss://")
        kv = kv_for(SEQ)
        with open_cache(tmp_path / "a", server.url, remote_tls_ca=str(ca)) as a:
            a.save(SEQ, kv)
            a.flush(30)
            assert a.stats()["remote_saves"] == 5
        with open_cache(tmp_path / "b", server.url, remote_tls_ca=str(ca)) as b:
            assert torch.equal(b.load(SEQ), kv)
        # a certificate the client cannot verify (no CA given, not a system CA): refused, a miss
        with open_cache(tmp_path / "c", server.url) as c:
            assert c.load(SEQ).shape[2] == 0 and c.stats()["remote_errors"] >= 1
        with pytest.raises(ConfigError, match="remote_tls_ca"):
            CacheConfig(path=tmp_path / "d", remote=server.url, remote_tls_ca=str(tmp_path / "nope.pem"))
    finally:
        server.stop()


def test_without_the_redis_client_a_remote_setting_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from kvtier.store import ChunkStore

    cfg = CacheConfig(path=tmp_path / "s", remote="redis://127.0.0.1:1")
    monkeypatch.setitem(sys.modules, "redis", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'kvtier\[remote\]'"):
        ChunkStore(cfg)
    ChunkStore(CacheConfig(path=tmp_path / "s")).close()  # nothing left half-open


def test_records_of_the_previous_remote_format_are_neither_read_nor_deleted(tmp_path: Path,
                                                                          redis_server: LocalRedis) -> None:
    """Format 1 kept a manifest under kvt:{key} and parts beside it; format 2 has its own
    prefix, so a server of either version shares the Redis without touching the other's."""
    seq = tokens(9, CHUNK)
    key = keys_of(seq)[0]
    c = redis_server.client()
    c.set(f"kvt:{{{key.hex()}}}", b"KVTR\x01" + os.urandom(100))
    with open_cache(tmp_path / "b", redis_server.url) as b:
        assert b.lookup(seq) == 0 and b.load(seq).shape[2] == 0
        assert b.stats()["remote_corrupt"] == 0
        b.save(seq, kv_for(seq))
        b.flush(30)
    assert c.exists(f"kvt:{{{key.hex()}}}") and c.exists(chunk_name(key))


def test_a_chunk_the_server_already_has_is_not_uploaded_again(tmp_path: Path, redis_server: LocalRedis) -> None:
    """Replicas that compute the same prompt upload it once: the uploader asks first."""
    kv = kv_for(SEQ)
    saves = []
    for name in ("a", "b"):  # two servers, separate disks, the same prompt computed on each
        with open_cache(tmp_path / name, redis_server.url) as c:
            c.save(SEQ, kv)
            assert c.flush(30)
            saves.append(c.stats()["remote_saves"])
    assert saves == [5, 0]
    assert len(chunk_keys(redis_server.client())) == 5


@pytest.mark.parametrize("url", ["rediss://127.0.0.1:6390", "rediss+cluster://127.0.0.1:6390,127.0.0.1:6391"])
def test_tls_checks_the_host_name_whatever_the_redis_client_defaults_to(url: str) -> None:
    """redis-py 5.x defaults ssl_check_hostname to False: any certificate the CA signed, for
    any host, would do. kvtier asks for the check itself (no connection is made here)."""
    nodes = RedisNodes(parse_remote(url, None), 0.5, 2)
    try:
        kwargs = nodes._client("127.0.0.1", 6390).connection_pool.connection_kwargs
        assert kwargs["ssl_check_hostname"] is True and kwargs["ssl_cert_reqs"] == "required"
    finally:
        nodes.close()


def test_an_upload_after_close_is_counted_as_dropped(redis_server: LocalRedis) -> None:
    counters = Counters()
    tier = RemoteTier(url=redis_server.url, password=None, timeout_s=0.5, part_bytes=1 << 20,
                      queue_bytes=1 << 20, counters=counters)
    tier.close(5)
    assert not tier.enqueue(os.urandom(32), b"h", memoryview(b"x"))
    assert counters.snapshot()["remote_dropped"] == 1


def test_one_refused_write_drops_its_own_chunk_not_the_whole_pipeline(redis_server: LocalRedis,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """An ACL user may write only some keys: its chunk there is stored and counted, the
    others dropped one each, leaving nothing; a refusal that is not out-of-memory gives no
    maxmemory advice."""
    caplog.set_level(logging.WARNING, logger="kvtier")
    ok, denied = os.urandom(32), os.urandom(32)
    c = redis_server.client()
    c.acl_setuser("part", enabled=True, passwords=["+pw"], commands=["+@all"], keys=[chunk_name(ok)])
    try:
        counters = Counters()
        tier = RemoteTier(url=redis_server.url.replace("redis://", "redis://part:pw@"), password=None,
                          timeout_s=1.0, part_bytes=1 << 16, queue_bytes=1, counters=counters, writer=False)
        payload = memoryview(os.urandom(100_000))
        try:
            assert tier.store_many([(k, b"header", payload) for k in (ok, denied)]) == 1
        finally:
            tier.close(0)
        stats = counters.snapshot()
        assert (stats["remote_saves"], stats["remote_dropped"]) == (1, 1)
        assert chunk_keys(c) == [chunk_name(ok).encode()]
        assert "refused writes" in caplog.text and "maxmemory-policy" not in caplog.text
    finally:
        c.acl_deluser("part")


def test_a_server_busy_with_a_long_script_is_a_miss_not_the_end_of_lookup_scripts(redis_server: LocalRedis) -> None:
    """BUSY (another client's script running past busy-reply-threshold) passes: that lookup
    misses, and later lookups still use the script (it used to switch them off for good)."""
    import threading

    c = redis_server.client()
    key = os.urandom(32)
    counters = Counters()
    tier = _tier(redis_server.url, counters=counters, timeout_s=2.0)
    c.config_set("busy-reply-threshold", 100)
    spin = "local t = redis.call('TIME'); local s = t[1] + 2\n" \
           "while tonumber(redis.call('TIME')[1]) < s do end\nreturn 1"
    try:
        assert tier.store_many([(key, b"header", memoryview(b"x" * 1000))]) == 1
        assert tier.count_present_prefix([key]) == 1
        busy = threading.Thread(target=lambda: redis_server.client().eval(spin, 0))
        busy.start()
        time.sleep(0.5)
        assert tier.count_present_prefix([key]) == 0  # BUSY: a miss now
        busy.join()
        c.config_resetstat()
        assert tier.count_present_prefix([key]) == 1
        assert c.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0) == 1  # by script
    finally:
        tier.close(0)
        c.config_set("busy-reply-threshold", 5000)


def test_a_record_over_the_servers_largest_value_is_dropped_not_sent(redis_server: LocalRedis,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A value over proto-max-bulk-len makes Redis drop the connection (and kvtier then took
    the node for down): such a record is counted and left local, the others of its batch go,
    and the node keeps serving."""
    caplog.set_level(logging.WARNING, logger="kvtier")
    c = redis_server.client()
    c.config_set("proto-max-bulk-len", 1 << 20)  # the smallest it takes: 1 MiB
    small, big = os.urandom(32), os.urandom(32)
    counters = Counters()
    tier = _tier(redis_server.url, counters=counters)
    try:
        assert tier.store_many([(small, b"h", memoryview(os.urandom(500_000))),
                                (big, b"h", memoryview(os.urandom(2_000_000)))]) == 1
        assert tier.count_present_prefix([small]) == 1 and tier.count_present_prefix([big]) == 0
        assert tier.fetch(small)
    finally:
        tier.close(0)
        c.config_set("proto-max-bulk-len", 512 << 20)
    stats = counters.snapshot()
    assert (stats["remote_saves"], stats["remote_dropped"], stats["remote_errors"]) == (1, 1, 0)
    assert "the server's largest value (proto-max-bulk-len)" in caplog.text


@pytest.mark.parametrize("case", ["rewritten", "evicted"])
def test_a_chunk_rewritten_or_gone_between_a_loads_two_round_trips_is_a_miss_not_damage(
        redis_server: LocalRedis, case: str) -> None:
    """A load reads a long value's first piece, then the rest: another server's upload of
    the same chunk in between (a new write id) or an eviction is a miss, not corruption,
    and the new copy stays."""
    c = redis_server.client()
    key = os.urandom(32)
    counters = Counters()
    tier = _tier(redis_server.url, counters=counters)
    writer = _tier(redis_server.url)
    payload = memoryview(os.urandom(300_000))  # five pieces
    def interfere() -> None:
        c.delete(chunk_name(key))
        if case == "rewritten":
            assert writer.store_many([(key, b"h2", memoryview(os.urandom(250_000)))]) == 1

    try:
        assert writer.store_many([(key, b"h", payload)]) == 1
        with _between_round_trips(tier, interfere):
            assert not tier.fetch(key)
        assert counters.snapshot()["remote_corrupt"] == 0
        assert c.exists(chunk_name(key)) == (case == "rewritten")  # the new copy is kept
        if case == "rewritten":
            assert tier.fetch(key)
    finally:
        tier.close(0)
        writer.close(0)


@pytest.mark.parametrize("value", ["empty", "absurd_length"])
def test_a_foreign_value_that_cannot_be_a_chunk_is_damage(redis_server: LocalRedis, value: str) -> None:
    """An empty string under a chunk's key read as absent while lookups promised it and
    uploads skipped it; a manifest (checksum intact) naming a terabyte made a load plan
    millions of reads. Both are damage: counted, deleted."""
    from kvtier.remote.tier import pack_manifest

    c = redis_server.client()
    key = os.urandom(32)
    if value == "empty":
        c.set(chunk_name(key), b"")
    else:
        c.set(chunk_name(key), pack_manifest(b"h", 1 << 40, os.urandom(8)) + os.urandom(1 << 16))
    counters = Counters()
    tier = _tier(redis_server.url, counters=counters)
    try:
        assert tier.count_present_prefix([key]) == 1  # (there, as far as a lookup can tell)
        assert not tier.fetch(key)
        assert counters.snapshot()["remote_corrupt"] == 1
        assert not c.exists(chunk_name(key))
        assert tier.count_present_prefix([key]) == 0
    finally:
        tier.close(0)


@pytest.mark.parametrize("reads", ["documented", "without_getrange"])
def test_a_read_only_acl_user(tmp_path: Path, redis_server: LocalRedis, reads: str,
                              caplog: pytest.LogCaptureFixture) -> None:
    """scale-out.md's read-only user loads and uploads nothing; a user whose reads the server
    refuses is warned about and counted (lookups would promise chunks every load misses)."""
    caplog.set_level(logging.WARNING, logger="kvtier")
    with open_cache(tmp_path / "a", redis_server.url) as a:
        a.save(SEQ, kv_for(SEQ))
        assert a.flush(30)
    c = redis_server.client()
    granted = ["+getrange", "+strlen", "+exists", "+evalsha", "+eval"]
    if reads == "without_getrange":
        granted.remove("+getrange")
    c.acl_setuser("reader", enabled=True, passwords=["+pw"], commands=granted, keys=["*"])
    try:
        url = redis_server.url.replace("redis://", "redis://reader:pw@")
        with open_cache(tmp_path / "b", url) as b:
            other = tokens(77, CHUNK)
            b.save(other, kv_for(other))
            assert b.flush(30)
            got = b.load(SEQ)
            stats = b.stats()
        assert stats["remote_dropped"] == 1 and not c.exists(chunk_name(keys_of(other)[0]))
        if reads == "documented":
            assert torch.equal(got, kv_for(SEQ)) and stats["remote_hits"] == 5
            assert "refused a read" not in caplog.text
        else:
            assert got.shape[2] == 0 and stats["remote_errors"] >= 1
            assert "refused a read" in caplog.text and "+getrange" in caplog.text
    finally:
        c.acl_deluser("reader")


def test_a_chunk_written_while_a_load_misses_it_is_kept(redis_server: LocalRedis) -> None:
    """GETRANGE reads a missing key as "": a load that missed, then found the key there in its
    second round trip, called the new chunk an empty value, deleted it and counted it corrupt
    (the KV pipe lost messages a consumer polled just before they were sent)."""
    c = redis_server.client()
    key = os.urandom(32)
    counters = Counters()
    tier = _tier(redis_server.url, counters=counters)
    writer = _tier(redis_server.url)
    def write() -> None:
        assert writer.store_many([(key, b"h", memoryview(os.urandom(300_000)))]) == 1

    try:
        with _between_round_trips(tier, write):
            assert not tier.fetch(key)  # a miss: it was not there when looked at
        assert counters.snapshot()["remote_corrupt"] == 0 and c.exists(chunk_name(key))
        assert tier.fetch(key)
    finally:
        tier.close(0)
        writer.close(0)


def test_a_lookup_asks_the_server_once_for_every_tail_length(tmp_path: Path, redis_server: LocalRedis) -> None:
    """A prompt's trailing partial chunk is looked up at several lengths: one round trip asks
    for all of them (it was one round trip each, on vLLM's scheduler thread); a tail only
    the server holds is found among them."""
    seq = tokens(7, 4 * CHUNK + 30)  # after the full chunks, tails of 24, 16 and 8 tokens are tried
    c = redis_server.client()

    def lookups() -> int:  # round trips: each runs the lookup script (whose EXISTS count apart)
        stats = c.info("commandstats")
        return sum(stats.get(f"cmdstat_{cmd}", {}).get("calls", 0) for cmd in ("evalsha", "eval"))

    with open_cache(tmp_path / "a", redis_server.url) as a:
        assert a.lookup(seq) == 0  # (the first lookup also sends the script)
        c.config_resetstat()
        assert a.lookup(seq) == 0
        assert lookups() == 2  # the full chunks, then every tail length at once
        head = seq[: 4 * CHUNK + 20]  # saved with a 16-token tail
        a.save(head, kv_for(head))
        assert a.flush(30)
    with open_cache(tmp_path / "b", redis_server.url) as b:  # an empty local store
        c.config_resetstat()
        assert b.lookup(seq) == 4 * CHUNK + 16
        assert lookups() == 2
        assert torch.equal(b.load(seq), kv_for(head)[:, :, : 4 * CHUNK + 16])


class _SlowLink:
    """A loopback TCP proxy to ``port`` that forwards what the client sends at about ``rate``
    bytes a second (replies at full speed): a link slower than loopback, as between hosts.
    Its sockets' receive buffers are small, so the client's sends wait on the link."""

    def __init__(self, port: int, rate: float) -> None:
        import socket
        import threading

        self.target, self.rate = port, rate
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # (the accepted ones inherit it)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pump, args=(client, server, self.rate), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, 0.0), daemon=True).start()

    @staticmethod
    def _pump(src: object, dst: object, rate: float) -> None:
        try:
            while data := src.recv(64 << 10):  # type: ignore[attr-defined]
                dst.sendall(data)  # type: ignore[attr-defined]
                if rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()  # type: ignore[attr-defined]

    def close(self) -> None:
        self.listener.close()


def test_a_large_chunk_over_a_slower_link_is_stored_not_timed_out(redis_server: LocalRedis) -> None:
    """``remote_timeout_s`` bounds a wait for progress (the docs): a 48 MiB chunk over a
    32 MiB/s link takes 1.5 s at 0.5 s. It went out in one send, which the socket's timeout
    bounded whole: the save timed out, the server counted as down (lookups missed too)."""
    link = _SlowLink(redis_server.port, 32 << 20)
    try:
        counters = Counters()
        tier = _tier(f"redis://127.0.0.1:{link.port}", counters, timeout_s=0.5)
        key, payload = os.urandom(32), memoryview(os.urandom(48 << 20))
        t0 = time.monotonic()
        assert tier.store_many([(key, b"header", payload)]) == 1, counters.snapshot()
        took = time.monotonic() - t0
        assert took > 0.5, took  # (the link was slower than the timeout allows for one send)
        assert tier.present_each([key]) == [True]
        c = counters.snapshot()
        assert c.get("remote_errors", 0) == 0 and c.get("remote_dropped", 0) == 0, c
        tier.close(5)
    finally:
        link.close()
