"""Damaged records on disk, through the store, for both backends: never served, counted,
removed, no exception, no large allocation. LMDB values are rewritten in a raw LMDB write
transaction on the ``records`` database; files-backend records by editing the .kvt file."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest
import xxhash
from kvhelpers import (
    CHUNK,
    craft,
    header_fields,
    make_kv,
    open_cache,
    peak_alloc,
    same_bits,
    tokens,
)

from kvtier import codec
from kvtier.backends.index import StoreIndex
from kvtier.keys import FORMAT_VERSION

TOKS = tokens(11, 3 * CHUNK)
BIG = 80 << 20  # a record far larger than max_record_bytes below
CFG = {"max_record_bytes": "16M"}


def _lmdb_env(store: Path) -> lmdb.Environment:
    return lmdb.open(str(store / "lmdb"), max_dbs=8, subdir=True, map_size=1 << 30)


def _location(store: Path, key: bytes) -> int:
    """Where the store's index says ``key``'s record is."""
    index = StoreIndex(store, readonly=True)
    try:
        entry = index.get(key)
    finally:
        index.close()
    assert entry is not None, "the record is not in the index"
    return entry.location


def _record_file(store: Path, key: bytes) -> Path:
    h = key.hex()
    return store / "files" / h[:2] / h[2:4] / f"{h}.{_location(store, key):016x}.kvt"


def _lmdb_key(store: Path, key: bytes) -> bytes:
    return _location(store, key).to_bytes(8, "big") + key


def read_raw(store: Path, backend: str, key: bytes) -> bytes:
    if backend == "files":
        return _record_file(store, key).read_bytes()
    env = _lmdb_env(store)
    try:
        with env.begin() as txn:
            val = txn.get(_lmdb_key(store, key), db=env.open_db(b"records", txn=txn))
            assert val is not None
            return bytes(val)
    finally:
        env.close()


def write_raw(store: Path, backend: str, key: bytes, data: bytes | None = None,
              sparse_size: int | None = None) -> None:
    """Replace the stored value of ``key`` (the store must be closed)."""
    if backend == "files":
        f = _record_file(store, key)
        if sparse_size is not None:
            f.write_bytes(b"")
            os.truncate(f, sparse_size)  # a huge file that costs no disk
        else:
            assert data is not None
            f.write_bytes(data)
        return
    dbkey = _lmdb_key(store, key)
    env = _lmdb_env(store)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(b"records", txn=txn)
            assert txn.get(dbkey, db=db) is not None
            txn.put(dbkey, data if data is not None else bytes(sparse_size or 0), db=db)
    finally:
        env.close()


def remove_raw(store: Path, backend: str, key: bytes) -> None:
    """Delete the payload of ``key`` behind the store's back (the store must be closed)."""
    if backend == "files":
        _record_file(store, key).unlink()
        return
    dbkey = _lmdb_key(store, key)
    env = _lmdb_env(store)
    try:
        with env.begin(write=True) as txn:
            assert txn.delete(dbkey, db=env.open_db(b"records", txn=txn))
    finally:
        env.close()


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_a_payload_removed_behind_the_stores_back_is_dropped_and_saved_again(tmp_path: Path,
                                                                             backend: str) -> None:
    """An index entry whose payload is gone can never load. Kept, it would also make every
    save of that chunk look done: the prefix could never be cached again."""
    store = tmp_path / "s"
    with open_cache(store, backend) as cache:
        cache.save(TOKS, make_kv(TOKS))
        assert cache.flush(30)
        second = cache.chunks(TOKS)[1].key
    remove_raw(store, backend, second)
    with open_cache(store, backend, host_bytes=0) as cache:
        assert cache.lookup(TOKS) == 3 * CHUNK  # the index still says so
        got = cache.load(TOKS)
        assert got.shape[2] == CHUNK and same_bits(got, make_kv(TOKS[:CHUNK]))
        st = cache.store.counters.snapshot()
        assert st["missing_payloads"] == 1 and st["corrupt_records"] == 0, st
        assert cache.lookup(TOKS) == CHUNK  # dropped from the index
        cache.save(TOKS, make_kv(TOKS))  # so saved again
        assert cache.flush(30)
    with open_cache(store, backend, host_bytes=0) as cache:
        assert same_bits(cache.load(TOKS), make_kv(TOKS))


def test_a_record_whose_shard_directories_went_with_it_is_a_missing_payload_not_an_io_error(
        tmp_path: Path) -> None:
    """Another process's eviction removes a record's file and then the shard directories it
    emptied, while this one still has the record's index entry: the load finds it gone (as
    if only the file had gone), never an I/O error (found by three processes evicting from
    one store; the check of the shard levels was outside the read's ``FileNotFoundError``)."""
    store = tmp_path / "s"
    with open_cache(store, "files") as cache:
        cache.save(TOKS, make_kv(TOKS))
        assert cache.flush(30)
        second = cache.chunks(TOKS)[1].key
    record = _record_file(store, second)
    shutil.rmtree(record.parent.parent)  # (both shard levels, and any record sharing them)
    with open_cache(store, "files", host_bytes=0) as cache:
        got = cache.load(TOKS)
        assert got.shape[2] <= CHUNK
        st = cache.store.counters.snapshot()
        assert st["missing_payloads"] >= 1 and st["io_errors"] == 0 and st["corrupt_records"] == 0, st


def _flip(rec: bytes, pos: int, bit: int = 0) -> bytes:
    b = bytearray(rec)
    b[pos] ^= 1 << bit
    return bytes(b)


def _hlen(rec: bytes) -> int:
    return int(header_fields(rec)["header_len"])


DAMAGE: dict[str, Callable[[bytes, bytes], bytes]] = {
    # name -> fn(record of the target chunk, record of chunk 0) -> damaged value
    "payload bit flip": lambda r, _: _flip(r, _hlen(r) + (len(r) - _hlen(r)) // 2, 3),
    "last payload bit": lambda r, _: _flip(r, len(r) - 1, 7),
    "header bit flip (shape)": lambda r, _: _flip(r, _hlen(r) - 8 - 24, 1),
    "header bit flip (magic)": lambda r, _: _flip(r, 0),
    "truncated payload": lambda r, _: r[:-1000],
    "truncated header": lambda r, _: r[:40],
    "empty value": lambda r, _: b"",
    "crafted huge shape": lambda r, _: craft(r, shape=(2**20, 2**20, 2**10), raw_len=2**51,
                                             payload_len=2**51),
    "crafted payload_len + 8": lambda r, _: craft(r, payload_len=header_fields(r)["payload_len"] + 8),
    "crafted payload_len - 8": lambda r, _: craft(r, payload_len=header_fields(r)["payload_len"] - 8),
    "crafted zero dim beside 2**63": lambda r, _: craft(
        r, shape=(0, 2**63), raw_len=0, payload_len=0, payload=b"", checksum=xxhash.xxh3_128_digest(b"")),
    "crafted shape of 2x the tokens": lambda r, _: craft(
        r, shape=(2, 2, 2 * CHUNK, 4, 32), raw_len=2 * header_fields(r)["raw_len"],
        payload_len=2 * header_fields(r)["raw_len"]),
    "valid record of another key": lambda _, r0: r0,
    "huge value": lambda r, _: b"",  # handled specially: BIG bytes, over max_record_bytes
}


@pytest.fixture(params=["lmdb", "files"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def _fill(store: Path, backend: str) -> list[bytes]:
    with open_cache(store, backend, **CFG) as cache:
        cache.save(TOKS, make_kv(TOKS))
        return [c.key for c in cache.chunks(TOKS)]


@pytest.mark.parametrize("via", ["get", "load"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_record_is_a_counted_miss(tmp_path: Path, backend: str, damage: str, via: str) -> None:
    store = tmp_path / "s"
    keys = _fill(store, backend)
    target = keys[1]
    if damage == "huge value":
        write_raw(store, backend, target, sparse_size=BIG)
    else:
        write_raw(store, backend, target,
                  DAMAGE[damage](read_raw(store, backend, target), read_raw(store, backend, keys[0])))

    with open_cache(store, backend, **CFG) as cache:
        assert cache.lookup(TOKS) == 3 * CHUNK  # lookups do not read records...
        with peak_alloc() as grew:
            if via == "get":
                assert cache.store.get(target) is None  # ...loads verify them
            else:
                got = cache.load(TOKS)
                assert same_bits(got, make_kv(TOKS[:CHUNK])), "load must stop before the bad chunk"
        assert grew[0] < 16 << 20, f"reading a damaged record allocated {grew[0] >> 20} MiB (Python heap)"
        st = cache.stats()
        assert st["corrupt_records"] == 1, st
        assert st["incompatible_records"] == 0 and st["io_errors"] == 0, st
        # the damaged record was removed: lookups stop claiming it, a new save heals it
        assert cache.lookup(TOKS) == CHUNK
        assert cache.store.get(target) is None
        assert cache.stats()["corrupt_records"] == 1
        assert cache.save(TOKS, make_kv(TOKS)) == CHUNK  # only the removed chunk is saved again
    with open_cache(store, backend, **CFG) as cache:
        assert same_bits(cache.load(TOKS), make_kv(TOKS))
        assert cache.stats()["corrupt_records"] == 0


def test_record_of_another_format_version_is_never_served(tmp_path: Path, backend: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "s"
    keys = _fill(store, backend)
    rec = read_raw(store, backend, keys[1])
    newer = craft(rec, format_version=FORMAT_VERSION + 1)
    assert header_fields(newer)["format_version"] == FORMAT_VERSION + 1
    write_raw(store, backend, keys[1], newer)
    with open_cache(store, backend, **CFG) as cache:
        for n in (1, 2):
            assert cache.store.get(keys[1]) is None
            st = cache.stats()
            assert (st["incompatible_records"], st["corrupt_records"], st["hits_disk"]) == (n, 0, 0)
        got = cache.load(TOKS)
        assert same_bits(got, make_kv(TOKS[:CHUNK]))
        assert cache.stats()["incompatible_records"] == 3
    # another version's record is left for the kvtier that can read it
    assert read_raw(store, backend, keys[1]) == newer
    # `kvtier verify` says so: no corruption (status 0), but not that every record verified
    from kvtier.cli.main import main

    capsys.readouterr()
    assert main(["verify", str(store)]) == 0
    out = capsys.readouterr().out
    assert "1 incompatible" in out and "all records verify" not in out, out
    assert "no corrupt records; 1 incompatible record(s) kept" in out, out
    assert main(["inspect", str(store), keys[1].hex()]) == 0  # (as verify: intact, not a failure)
    assert "incompatible" in capsys.readouterr().out
    assert read_raw(store, backend, keys[1]) == newer


def test_valid_record_of_the_wrong_shape_is_not_served(tmp_path: Path, backend: str) -> None:
    """A record that verifies but does not fit the namespace (e.g. written under this key by
    a buggy or hostile writer) never reaches the caller as the chunk's KV."""
    store = tmp_path / "s"
    keys = _fill(store, backend)
    half = make_kv(TOKS[CHUNK:CHUNK + 16], start=CHUNK)
    h, p = codec.encode(half, key=keys[1], namespace_id=bytes(16), token_start=CHUNK, num_tokens=16)
    write_raw(store, backend, keys[1], h + bytes(p))
    with open_cache(store, backend, **CFG) as cache:
        assert same_bits(cache.load(TOKS), make_kv(TOKS[:CHUNK]))
