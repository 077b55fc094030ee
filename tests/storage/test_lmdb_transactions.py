"""LMDB writes a batch in transactions of at most 16 MiB of records each (at least one
record): an open transaction keeps its new pages in allocated memory until it commits, so one
transaction for a whole batch (up to ``commit_bytes``, 256 MiB by default) would hold a second
copy of all of it. A transaction that fails loses only its own records and the batch's later
ones; with ``durability="power"`` a failed final sync publishes nothing. Real LMDB; the
writer is held on its first batch so the rest queue up into one batch."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import lmdb
import pytest
from kvhelpers import CHUNK, make_kv, namespace, open_cache, same_bits, tokens

from kvtier.backends.lmdb import LmdbPayloads
from kvtier.backends.lmdb_env import EnvHandle

MIB = 1 << 20
SHAPE = (8, 2, 16, 64)  # 1 MiB per 32-token bf16 chunk
CHUNKS = 40


def _save_a_backlog(path: Path, monkeypatch: pytest.MonkeyPatch, fail_txn: int | None = None,
                    **cfg: Any) -> tuple[list[int], Any]:
    """Save CHUNKS chunks while the writer is held inside its first transaction, so the other
    39 go out as one batch. Returns the record bytes of every transaction and the store's
    final counters. ``fail_txn``: that transaction (counting from 0) fails as a full disk
    would."""
    real = LmdbPayloads._put_txn
    txns: list[int] = []
    release = threading.Event()

    def spy(self: LmdbPayloads, items: list[Any], locations: list[int]) -> None:
        txns.append(sum(it.size for it in items))
        if len(txns) == 1:
            assert release.wait(30), "the test never released the writer"
        if len(txns) - 1 == fail_txn:
            raise lmdb.DiskError("MDB_DISK: No space left on device (injected)")
        real(self, items, locations)

    monkeypatch.setattr(LmdbPayloads, "_put_txn", spy)
    toks = tokens(3, CHUNKS * CHUNK)
    kv = make_kv(toks, kv_shape=SHAPE)
    with open_cache(path, "lmdb", ns=namespace(kv_shape=SHAPE), write_queue_bytes="128M",
                    host_bytes="8M", disk_bytes="1G", **cfg) as cache:
        head = cache.save(toks[:CHUNK], kv[:, :, :CHUNK])  # the writer takes it and is held
        while not txns:
            threading.Event().wait(0.01)
        assert head + cache.save(toks, kv) == CHUNKS * CHUNK
        release.set()
        assert cache.flush(60)
        stats = cache.stats()
    monkeypatch.setattr(LmdbPayloads, "_put_txn", real)
    return txns, stats


def _stored(path: Path) -> tuple[int, Any]:
    """Tokens found by a new process's lookup (from disk: the host tier is gone), and
    whether what it loads is the saved KV bit for bit."""
    toks = tokens(3, CHUNKS * CHUNK)
    with open_cache(path, "lmdb", ns=namespace(kv_shape=SHAPE), disk_bytes="1G") as cache:
        n = cache.lookup(toks)
        return n, same_bits(cache.load(toks[:n]), make_kv(toks[:n], kv_shape=SHAPE)) if n else True


@pytest.mark.parametrize("durability", ["process", "power"])
def test_a_batch_is_written_in_bounded_transactions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    durability: str) -> None:
    path = tmp_path / "s"
    txns, stats = _save_a_backlog(path, monkeypatch, durability=durability)
    backlog = txns[1:]  # 39 MiB in one batch (commit_bytes 256M): three transactions
    assert sum(backlog) >= (CHUNKS - 1) * MIB and len(backlog) == 3
    assert max(backlog) <= 16 * MIB
    assert stats["saves_committed"] == CHUNKS and stats["dropped_saves"] == 0
    assert _stored(path) == (CHUNKS * CHUNK, True)


def test_a_record_over_the_limit_gets_a_transaction_of_its_own(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LmdbPayloads, "txn_bytes", MIB // 2)
    txns, stats = _save_a_backlog(tmp_path / "s", monkeypatch, compression="zstd")
    assert len(txns) == CHUNKS and stats["saves_committed"] == CHUNKS
    assert _stored(tmp_path / "s") == (CHUNKS * CHUNK, True)


def test_the_map_grows_between_transactions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_init = EnvHandle.__init__

    def small_map(self: EnvHandle, path: Path, **kw: Any) -> None:
        if path.name == "lmdb":  # the payloads' map: 8 MiB, for 40 MiB of records
            kw["map_size"] = 8 * MIB
        real_init(self, path, **kw)

    monkeypatch.setattr(EnvHandle, "__init__", small_map)
    txns, stats = _save_a_backlog(tmp_path / "s", monkeypatch)
    assert len(txns) >= 4 and stats["saves_committed"] == CHUNKS and stats["io_errors"] == 0
    assert _stored(tmp_path / "s") == (CHUNKS * CHUNK, True)


@pytest.mark.parametrize("durability", ["process", "power"])
def test_a_failed_transaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durability: str) -> None:
    path = tmp_path / "s"
    txns, stats = _save_a_backlog(path, monkeypatch, fail_txn=2, durability=durability)
    assert len(txns) == 3 and txns[1] <= 16 * MIB  # the batch's second transaction failed
    # "process": the batch's first transaction (15 records: 16 would pass 16 MiB with their
    # headers) is stored beside the first chunk, and the other 24 are dropped, and counted;
    # "power": a batch is stored whole or not at all (the error may stand for the earlier
    # commit's pages), so only the first chunk, from its own batch, is stored
    stored = 16 if durability == "process" else 1
    assert stats["saves_committed"] == stored and stats["dropped_saves"] == CHUNKS - stored
    assert stats["dropped_disk_full"] == stats["dropped_saves"] and stats["io_errors"] == 0  # (injected: a full disk)
    assert _stored(path) == (stored * CHUNK, True)
    assert _payload_records(path) == stored  # none left behind unpublished


def test_power_payload_commits_skip_only_the_meta_sync(tmp_path: Path) -> None:
    """The payloads' environment syncs every commit but its meta page (write_many and every
    removal sync that once more); the index syncs both."""
    with open_cache(tmp_path / "s", "lmdb", durability="power") as cache:
        envs = {h.path.name: h.env_now().flags() for h in cache.store.backend.lmdb_envs()}
    assert envs["lmdb"]["sync"] and not envs["lmdb"]["metasync"]
    assert envs["index"]["sync"] and envs["index"]["metasync"]


def test_power_a_failed_sync_publishes_nothing_and_keeps_no_payload(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s"
    real = EnvHandle.sync
    calls = []

    def failing(self: EnvHandle) -> None:
        calls.append(self.path)
        if len(calls) == 2:  # the batch's sync (the first was the held first chunk's)
            raise lmdb.Error("fdatasync: Input/output error (injected)")
        real(self)

    monkeypatch.setattr(EnvHandle, "sync", failing)
    _, stats = _save_a_backlog(path, monkeypatch, durability="power")
    assert stats["saves_committed"] == 1 and stats["dropped_saves"] == CHUNKS - 1
    assert _stored(path) == (CHUNK, True)
    assert _payload_records(path) == 1  # the 39 committed before the failed sync were taken out


def _payload_records(path: Path) -> int:
    payloads = LmdbPayloads(path, "process", 1 << 30, 1 << 30, readonly=True)
    try:
        return len(list(payloads.found()))
    finally:
        payloads.close()


@pytest.mark.parametrize("durability", ["process", "power"])
def test_a_removal_is_synced_under_power(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         durability: str) -> None:
    """A removal's meta page is not synced by its own commit (no metasync on payloads); a
    removal that a power loss undid would leave an orphan no sweep looks for, so under
    "power" each removal syncs once more."""
    toks = tokens(5, 2 * CHUNK)
    with open_cache(tmp_path / "s", "lmdb", ns=namespace(kv_shape=SHAPE), durability=durability) as cache:
        cache.save(toks, make_kv(toks, kv_shape=SHAPE))
        assert cache.flush(30)
        syncs: list[Path] = []
        real = EnvHandle.sync
        monkeypatch.setattr(EnvHandle, "sync", lambda self: (syncs.append(self.path), real(self))[1])
        cache.store.backend.delete([e.key for e in cache.store.backend.index.entries()])
        assert _payload_records(tmp_path / "s") == 0
    assert syncs == ([tmp_path / "s" / "lmdb"] if durability == "power" else [])
