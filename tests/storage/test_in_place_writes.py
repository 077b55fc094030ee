"""Saves are written from the pool buffers they were staged in: the chunk sits a header's
length into a page-aligned pooled buffer, the writer puts the record's header in front of it,
and the backend writes that memory as it is (``O_DIRECT`` for ``files``, the value itself for
``lmdb``) instead of assembling the record in a staging buffer first. Real LMDB and real
files; every record is read back in a new store and verified bit for bit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from kvhelpers import (
    CHUNK,
    config,
    make_kv,
    namespace,
    open_cache,
    same_bits,
    skip_without_o_direct,
    tokens,
)

from kvtier import ChunkStore, KVCache, codec


def _staging_bytes(store: ChunkStore) -> int:
    """What the backend's staging buffers hold (made on the first record that needs them)."""
    payloads = store.backend.payloads
    if store.config.backend == "files":
        return sum(len(b) for b in payloads._stage)
    return len(payloads._staging)


@pytest.mark.parametrize("backend", ["files", "lmdb"])
def test_saves_are_written_from_their_pool_buffers(tmp_path: Path, backend: str) -> None:
    skip_without_o_direct(tmp_path)
    seqs = [tokens(200 + i, 3 * CHUNK + 8) for i in range(3)]  # full chunks and an 8-token tail
    with open_cache(tmp_path / "s", backend) as cache:
        for toks in seqs:
            assert cache.save(toks, make_kv(toks)) == len(toks)
        assert cache.flush(60)
        assert cache.store.counters.snapshot()["saves_committed"] == 4 * len(seqs)
        assert _staging_bytes(cache.store) == 0, "a pooled chunk was copied to a staging buffer"
        if backend == "files":
            assert cache.store.backend.payloads._direct_write is True
    if backend == "files":  # the page padding written with O_DIRECT is cut off again
        files = sorted((tmp_path / "s" / "files").rglob("*.kvt"))
        assert len(files) == 4 * len(seqs)
        for f in files:
            head = codec.decode_header(f.read_bytes())
            assert f.stat().st_size == head.header_len + head.payload_len
            assert f.stat().st_size % 4096  # not page-sized: the truncation was needed
    with open_cache(tmp_path / "s", backend) as cache:  # a new store: read from disk
        for toks in seqs:
            got = cache.load(toks)
            assert same_bits(got, make_kv(toks)), "a record written in place reads back wrong"
        assert cache.store.counters.snapshot()["corrupt_records"] == 0


@pytest.mark.parametrize("backend", ["files", "lmdb"])
def test_reused_pool_buffers_write_only_their_own_record(tmp_path: Path, backend: str) -> None:
    """A pool of two buffers, reused for ten chunks of different sizes: a header written into
    a buffer, or padding left from its last record, never ends up in another record."""
    seqs = [tokens(300 + i, CHUNK + 8 * (i % 4)) for i in range(10)]
    per_chunk = make_kv(seqs[0][:CHUNK]).numel() * 2
    cfg = config(tmp_path / "s", backend, host_bytes=0, write_queue_bytes=2 * per_chunk)
    with KVCache.open(tmp_path / "s", namespace(), cfg, tail_granularity=8) as cache:
        for toks in seqs:
            for _ in range(4):  # a full pool drops a chunk: flush and save the rest again
                cache.save(toks, make_kv(toks))
                assert cache.flush(60)
                if cache.lookup(toks) == len(toks):
                    break
            assert cache.lookup(toks) == len(toks)
        assert cache.store.pool.created <= 2 + 1  # a larger tail chunk may resize the slots once
    with open_cache(tmp_path / "s", backend) as cache:
        for toks in seqs:
            assert same_bits(cache.load(toks), make_kv(toks))


@pytest.mark.parametrize("backend", ["files", "lmdb"])
def test_a_chunk_outside_the_pool_is_assembled_first(tmp_path: Path, backend: str) -> None:
    """``ChunkStore.put`` of the caller's own tensor (no room for a header in front of it),
    and compressed records, take the staging path; they read back the same."""
    toks = tokens(400, CHUNK)
    kv = make_kv(toks)
    key = bytes([7]) * 32
    with ChunkStore(config(tmp_path / "s", backend)) as store:
        assert codec.record_in_place(kv, b"\0" * codec.header_bytes(kv.dim())) is None
        assert store.put(key, kv.clone(), namespace_id=bytes(16), token_start=0, num_tokens=CHUNK)
        assert store.flush(60)
        assert _staging_bytes(store) > 0
    with ChunkStore(config(tmp_path / "s", backend)) as store:
        assert same_bits(store.get(key), kv)
    with ChunkStore(config(tmp_path / "z", backend, compression="zstd")) as store:
        buf = store.buffer(tuple(kv.shape), kv.dtype)
        buf.copy_(kv)
        assert store.put(key, buf, namespace_id=bytes(16), token_start=0, num_tokens=CHUNK)
        assert store.flush(60)
        assert _staging_bytes(store) > 0
    with ChunkStore(config(tmp_path / "z", backend, compression="zstd")) as store:
        assert same_bits(store.get(key), kv)


def test_record_in_place_places_the_header_in_front_of_the_payload(tmp_path: Path) -> None:
    kv = make_kv(tokens(500, CHUNK))
    with ChunkStore(config(tmp_path / "s", "files")) as store:
        buf = store.buffer(tuple(kv.shape), kv.dtype)
        buf.copy_(kv)
        header, payload = codec.encode(buf, key=bytes(32), namespace_id=bytes(16), token_start=0,
                                       num_tokens=CHUNK)
        rec = codec.record_in_place(buf, header)
        assert rec is not None and len(rec) % 4096 == 0
        assert np.frombuffer(rec, dtype=np.uint8).ctypes.data % 4096 == 0
        size = len(header) + payload.nbytes
        assert bytes(rec[: len(header)]) == header and bytes(rec[len(header) : size]) == bytes(payload)
        decoded = codec.decode(rec[:size], expect_key=bytes(32))[1]
        assert same_bits(decoded, kv)


@pytest.mark.parametrize("backend", ["files", "lmdb"])
def test_only_the_stores_own_buffers_are_written_in_place(tmp_path: Path, backend: str) -> None:
    """A caller's tensor that happens to sit a header's length into page-aligned memory is
    not written into (the bytes around it stay the caller's), and one pooled buffer put
    under two keys is written in place at most once: both records read back as saved."""
    from kvtier.buffer_pool import BufferPool

    kv = make_kv(tokens(600, CHUNK))
    shape = tuple(kv.shape)
    theirs = BufferPool(1 << 20).acquire(shape, kv.dtype, lead=codec.record_lead(shape, kv.dtype))
    assert theirs is not None
    around = theirs.untyped_storage()
    mem = np.frombuffer(memoryview(torch.empty(0, dtype=torch.uint8).set_(around).numpy()), dtype=np.uint8)
    mem[:] = 0xAB
    theirs.copy_(kv)
    before = mem.copy()
    key_a, key_b, key_c = bytes([1]) * 32, bytes([2]) * 32, bytes([3]) * 32
    with ChunkStore(config(tmp_path / "s", backend)) as store:
        assert store.put(key_a, theirs, namespace_id=bytes(16), token_start=0, num_tokens=CHUNK)
        ours = store.buffer(shape, kv.dtype)
        ours.copy_(kv)
        for key in (key_b, key_c):
            assert store.put(key, ours, namespace_id=bytes(16), token_start=0, num_tokens=CHUNK)
        assert store.flush(60)
        assert np.array_equal(mem, before), "the store wrote into a caller's memory"
    with ChunkStore(config(tmp_path / "s", backend)) as store:
        for key in (key_a, key_b, key_c):
            got = store.load(key)
            assert got.tensor is not None, (key[0], got.outcome, got.why)
            assert same_bits(got.tensor, kv)
        assert store.counters.snapshot()["corrupt_records"] == 0


@pytest.mark.parametrize("path", ["in place", "staged"])
def test_a_record_is_written_in_one_call_on_the_io_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        path: str) -> None:
    """The files backend writes each record (open, O_DIRECT writes, truncation, sync, close,
    rename) in one call on its I/O pool: each call's hand-over and wake-up take the GIL,
    which a serving process's model thread waits for. Records several write segments long
    (``_STAGE_BYTES`` and ``_DIRECT_WRITE_BYTES`` made small), with ``power`` durability, assembled in place in their
    pool buffers or (a caller's own tensor) staged segment by segment: one call per record,
    and each reads back bit for bit."""
    from kvtier.backends import files

    skip_without_o_direct(tmp_path)
    for segment in ("_STAGE_BYTES", "_DIRECT_WRITE_BYTES"):
        monkeypatch.setattr(files, segment, 8192)  # (a chunk here is several of them)
    calls: list[str] = []
    real = files.FilePayloads._on_pool

    def counted(self: files.FilePayloads, fn: object, args: list[object]) -> object:
        calls.append(getattr(fn, "__name__", str(fn)))
        return real(self, fn, args)

    monkeypatch.setattr(files.FilePayloads, "_on_pool", counted)
    kvs = {bytes([k]) * 32: make_kv(tokens(300 + k, CHUNK)) for k in range(3)}
    with ChunkStore(config(tmp_path / "s", "files", durability="power")) as store:
        for key, kv in kvs.items():
            if path == "staged":
                buf = kv.clone()
            else:
                buf = store.buffer(tuple(kv.shape), kv.dtype)
                buf.copy_(kv)
            assert store.put(key, buf, namespace_id=bytes(16), token_start=0, num_tokens=CHUNK)
        assert store.flush(60)
        assert (_staging_bytes(store) > 0) == (path == "staged")
        assert calls == ["_write_record"] * len(kvs)
    with ChunkStore(config(tmp_path / "s", "files")) as store:
        for key, kv in kvs.items():
            assert same_bits(store.get(key), kv)


def test_a_record_in_place_is_written_in_one_system_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record assembled in its pool buffer is written with one ``write(2)``, however many
    staging segments long it is (each system call takes the GIL again on its way out, a
    wait for a serving process's model thread); a staged one segment by segment."""
    from kvtier.backends import files

    skip_without_o_direct(tmp_path)
    monkeypatch.setattr(files, "_STAGE_BYTES", 8192)  # (a chunk here is several segments)
    writes: list[int] = []
    real = files._write_view

    def counted(f: object, buf: object, start: int, n: int) -> int:
        writes.append(n)
        return real(f, buf, start, n)  # type: ignore[arg-type]

    monkeypatch.setattr(files, "_write_view", counted)
    kv = make_kv(tokens(400, CHUNK))
    with ChunkStore(config(tmp_path / "s", "files")) as store:
        buf = store.buffer(tuple(kv.shape), kv.dtype)
        buf.copy_(kv)
        assert store.put(b"\x01" * 32, buf, namespace_id=bytes(16), token_start=0, num_tokens=CHUNK)
        assert store.put(b"\x02" * 32, kv.clone(), namespace_id=bytes(16), token_start=0, num_tokens=CHUNK)
        assert store.flush(60)
        record = store.backend.lookup(b"\x01" * 32).size
        assert record > 2 * 8192
        assert sorted(writes)[-1] == -(-record // 4096) * 4096  # the record in place: one write
        assert len(writes) == 1 + -(-record // 8192)  # the staged one: a write per segment
        for key in (b"\x01" * 32, b"\x02" * 32):
            assert same_bits(store.get(key), kv)
