"""The DALI reader for prefetch (the ``dali`` extra, DALI's CPU file reader here): the host
tier gets exactly what kvtier's own reader gives, every record verified."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvhelpers import CHUNK, config, make_kv, namespace, open_cache, same_bits, tokens

from kvtier import ConfigError
from kvtier.store import ChunkStore
from kvtier.vllm.settings import ConnectorSettings

SEQS = [tokens(70 + i, 3 * CHUNK) for i in range(4)]


def _fill(path: Path, backend: str = "files") -> None:
    with open_cache(path, backend) as cache:
        for s in SEQS:
            cache.save(s, make_kv(s))
        assert cache.flush(30)


@pytest.mark.parametrize("reader", ["default", "dali"])
def test_prefetch_fills_the_host_tier_with_verified_chunks(tmp_path: Path, reader: str) -> None:
    _fill(tmp_path / "s")
    with open_cache(tmp_path / "s", "files") as cache:
        chunks = [(c, s) for s in SEQS for c in cache.chunks(s)]
    ns = namespace()
    with ChunkStore(config(tmp_path / "s", "files", host_bytes="64M")) as store:
        assert len(store.host) == 0
        assert store.prefetch_recent(ns.id, 1 << 30, reader).result(60) == len(chunks) == 12
        for c, s in chunks:
            got = store.host.get(c.key)
            assert got is not None and same_bits(got, make_kv(s[c.start:c.end], start=c.start))
        assert store.counters.snapshot()["corrupt_records"] == 0


def test_a_corrupt_record_read_by_dali_is_counted_and_removed(tmp_path: Path) -> None:
    _fill(tmp_path / "s")
    victim = next((tmp_path / "s" / "files").rglob("*.kvt"))
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x3C
    victim.write_bytes(bytes(data))
    with ChunkStore(config(tmp_path / "s", "files", host_bytes="64M")) as store:
        assert store.prefetch_recent(namespace().id, 1 << 30, "dali").result(60) == 11
        assert store.counters.snapshot()["corrupt_records"] == 1
        assert store.backend.usage()[0] == 11  # only proven corruption is deleted: that one
    assert not victim.exists()


def test_a_corrupt_version_read_by_dali_never_removes_a_newer_one(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """DALI reads the records listed before it started; if another server saves a chunk
    again meanwhile (a new version, elsewhere: one that could not load the old one replaces
    it), a corrupt old version removes itself only."""
    import kvtier.dali_reader as dali_reader

    _fill(tmp_path / "s")
    ns = namespace()
    with open_cache(tmp_path / "s", "files") as cache:
        c, seq = next((c, s) for s in SEQS for c in cache.chunks(s))
    with ChunkStore(config(tmp_path / "s", "files", host_bytes="64M")) as store:
        old = store.backend.lookup(c.key)
        victim = store.backend.payloads.path_of(c.key, old.location)
        data = bytearray(victim.read_bytes())
        data[-100] ^= 0x3C
        victim.write_bytes(bytes(data))
        real = dali_reader.read_files

        def read_then_resave(paths: list[str], threads: int):  # noqa: ANN202 - a generator
            for i, got in real(paths, threads=threads):
                if paths[i] == str(victim):  # read; now the chunk is saved again
                    store.host.clear()
                    store.put(c.key, make_kv(seq[c.start:c.end], start=c.start), namespace_id=ns.id,
                              token_start=c.start, num_tokens=c.end - c.start, replace=True)
                    assert store.flush(30)
                    assert store.backend.lookup(c.key).location != old.location
                yield i, got

        monkeypatch.setattr(dali_reader, "read_files", read_then_resave)
        assert store.prefetch_recent(ns.id, 1 << 30, "dali").result(60) == 11
        assert store.counters.snapshot()["corrupt_records"] == 1
        store.host.clear()
        got = store.load(c.key).tensor  # the new version is still there, intact
        assert got is not None and same_bits(got, make_kv(seq[c.start:c.end], start=c.start))


def test_dali_prefetch_needs_the_files_backend_and_says_so(tmp_path: Path) -> None:
    _fill(tmp_path / "s", "lmdb")
    with ChunkStore(config(tmp_path / "s", "lmdb")) as store, pytest.raises(ConfigError, match="backend 'files'"):
        store.prefetch_recent(namespace().id, 1 << 20, "dali")
    with pytest.raises(ConfigError, match="needs \"backend\": \"files\""):
        ConnectorSettings.from_extra_config({"path": str(tmp_path / "x"), "backend": "lmdb",
                                             "prefetch_reader": "dali", "prefetch_bytes": "1M"})
    with pytest.raises(ConfigError, match="needs \"backend\": \"files\""):  # an lmdb store, followed
        ConnectorSettings.from_extra_config({"path": str(tmp_path / "s"), "prefetch_reader": "dali",
                                             "prefetch_bytes": "1M"})
    with pytest.raises(ConfigError, match="prefetch_reader: must be"):
        ConnectorSettings.from_extra_config({"path": str(tmp_path / "x"), "prefetch_reader": "fast"})
    ok = ConnectorSettings.from_extra_config({"path": str(tmp_path / "x"),  # a new store: files
                                              "prefetch_reader": "dali", "prefetch_bytes": "1M"})
    assert ok.prefetch_reader == "dali"
