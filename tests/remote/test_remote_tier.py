"""The remote tier on a real redis-server: sharing, faults, damage, budgets, configuration."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch
from remotehelpers import CHUNK, kv_for, manifests, open_cache, tokens, wait_for

from kvtier import CacheConfig, ConfigError
from kvtier.metrics import Counters
from kvtier.remote.address import parse_remote
from kvtier.remote.nodes import RedisNodes
from kvtier.remote.tier import RemoteTier, manifest_name
from kvtier.testing.redis_server import LocalRedis

SEQ = tokens(1, 4 * CHUNK + 8)  # four chunks and a tail


def test_a_second_server_hits_what_the_first_stored_and_promotes_it(tmp_path: Path, redis_server: LocalRedis) -> None:
    kv = kv_for(SEQ)
    with open_cache(tmp_path / "a", redis_server.url) as a:
        a.save(SEQ, kv)
        assert a.flush(30)
        assert a.stats()["remote_saves"] == 5
    assert len(manifests(redis_server.client())) == 5
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


@pytest.mark.parametrize("damage", ["flip_payload", "truncate_part", "flip_manifest", "drop_part"])
def test_damaged_values_in_the_server_are_misses(tmp_path: Path, redis_server: LocalRedis, damage: str) -> None:
    seq = tokens(3, CHUNK)  # one chunk: 32 KiB of float32 KV (one 64 KiB part)
    kv = kv_for(seq)
    with open_cache(tmp_path / "a", redis_server.url) as a:
        a.save(seq, kv)
        a.flush(30)
    c = redis_server.client()
    (manifest,) = manifests(c)
    (part,) = [k for k in c.scan_iter(match="kvt:*") if k != manifest]
    if damage == "flip_payload":
        v = bytearray(c.get(part))
        v[1000] ^= 0x10
        c.set(part, bytes(v))
    elif damage == "truncate_part":
        c.set(part, c.get(part)[:-100])
    elif damage == "flip_manifest":
        v = bytearray(c.get(manifest))
        v[20] ^= 0x01
        c.set(manifest, bytes(v))
    else:
        c.delete(part)  # the server evicted a part
    with open_cache(tmp_path / "b", redis_server.url) as b:
        assert b.load(seq).shape[2] == 0  # a miss: never wrong KV, never an exception
        stats = b.stats()
        if damage in ("flip_payload", "truncate_part", "flip_manifest"):
            assert stats["remote_corrupt"] == 1
        else:
            assert stats["remote_incomplete"] == 1
        assert stats["remote_hits"] == 0
    assert c.get(manifest) is None  # hidden from every server from now on


def test_a_server_that_refuses_writes_costs_counted_drops_not_errors(tmp_path: Path, redis_server: LocalRedis,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier")
    c = redis_server.client()
    c.config_set("maxmemory-policy", "noeviction")
    c.config_set("maxmemory", str(c.info("memory")["used_memory"] + 10_000))
    try:
        with open_cache(tmp_path / "a", redis_server.url) as a:
            a.save(SEQ, kv_for(SEQ))
            assert a.flush(30)
            stats = a.stats()
            assert stats["remote_dropped"] == 5 and stats["remote_saves"] == 0
            assert stats["saves_committed"] == 5  # the local tier has them all
            assert "set maxmemory-policy to allkeys-lru" in caplog.text  # out of memory: the advice
    finally:
        c.config_set("maxmemory", "512mb")
        c.config_set("maxmemory-policy", "allkeys-lru")


def test_the_upload_queue_has_a_byte_budget(tmp_path: Path, redis_server: LocalRedis) -> None:
    seqs = [tokens(10 + i, 2 * CHUNK) for i in range(20)]
    redis_server.client().client_pause(3000)  # the server stalls: uploads pile up
    with open_cache(tmp_path / "a", redis_server.url, remote_queue_bytes="100K", remote_timeout_s=5) as a:
        for s in seqs:
            a.save(s, kv_for(s))
        a.flush(30)
        stats = a.stats()
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
])
def test_bad_addresses_are_refused_with_the_accepted_forms(tmp_path: Path, url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CacheConfig(path=tmp_path, remote=url)


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


def test_a_record_of_another_remote_format_version_is_a_miss_and_kept(tmp_path: Path, redis_server: LocalRedis) -> None:
    import xxhash

    seq = tokens(9, CHUNK)
    with open_cache(tmp_path / "a", redis_server.url) as a:
        a.save(seq, kv_for(seq))
        a.flush(30)
    c = redis_server.client()
    (manifest,) = manifests(c)
    body = bytearray(c.get(manifest)[:-8])
    body[4] = 99  # the manifest format version
    c.set(manifest, bytes(body) + xxhash.xxh3_64_intdigest(bytes(body)).to_bytes(8, "little"))
    with open_cache(tmp_path / "b", redis_server.url) as b:
        assert b.load(seq).shape[2] == 0
        assert b.stats()["remote_corrupt"] == 0
    assert c.get(manifest) is not None  # another kvtier's record: not deleted


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
    assert len(manifests(redis_server.client())) == 5


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
    others dropped one each; a refusal that is not out-of-memory gives no maxmemory advice.
    A manifest stored over a refused part is removed (it would be an incomplete chunk)."""
    caplog.set_level(logging.WARNING, logger="kvtier")
    ok, denied, half = os.urandom(32), os.urandom(32), os.urandom(32)
    c = redis_server.client()
    c.acl_setuser("part", enabled=True, passwords=["+pw"], commands=["+@all"],
                  keys=[manifest_name(ok) + "*", manifest_name(half)])  # half: its manifest, no parts
    try:
        counters = Counters()
        tier = RemoteTier(url=redis_server.url.replace("redis://", "redis://part:pw@"), password=None,
                          timeout_s=1.0, part_bytes=1 << 16, queue_bytes=1, counters=counters, writer=False)
        payload = memoryview(os.urandom(100_000))  # two parts each
        try:
            assert tier.store_many([(k, b"header", payload) for k in (ok, denied, half)]) == 1
        finally:
            tier.close(0)
        stats = counters.snapshot()
        assert (stats["remote_saves"], stats["remote_dropped"]) == (1, 2)
        assert c.exists(manifest_name(ok)) and not c.exists(manifest_name(denied))
        assert not c.exists(manifest_name(half))
        assert "refused writes" in caplog.text and "maxmemory-policy" not in caplog.text
    finally:
        c.acl_deluser("part")
