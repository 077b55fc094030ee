"""With ``direct_reads`` (``files`` backend), loads into the host tier read record files the
page cache does not hold with ``O_DIRECT`` straight into pooled buffers: the KV is bit-exact,
nothing of the file is left in the page cache, and a record the page cache does hold (warmed
by ``kvtier prefetch``) is copied from it instead. Without it, loads go through the page
cache. Real files on the test's filesystem."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from kvhelpers import config, make_kv, skip_without_o_direct, tokens

from kvtier import CacheConfig, ChunkStore
from kvtier.backends.files import FilePayloads, cached_pages

SHAPE_TOKENS = 64


def _chunks(n: int) -> list[tuple[bytes, torch.Tensor]]:
    out = []
    for i in range(n):
        toks = tokens(100 + i, SHAPE_TOKENS)
        out.append((bytes([i + 1]) * 32, make_kv(toks)))
    return out


def _record_files(store: Path) -> list[Path]:
    return sorted((store / "files").rglob("*.kvt"))


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cached_bytes(path: Path) -> int:
    """How much of the file the page cache holds (asked with mincore: no read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return cached_pages(fd, 0, path.stat().st_size) * 4096
    finally:
        os.close(fd)


def _config(path: Path, direct: bool = True) -> CacheConfig:
    return config(path, "files", chunk_tokens=SHAPE_TOKENS, direct_reads=direct)


def _saved_store(path: Path) -> list[tuple[bytes, torch.Tensor]]:
    chunks = _chunks(4)
    store = ChunkStore(_config(path))
    for key, kv in chunks:
        assert store.put(key, kv, namespace_id=bytes(16), token_start=0, num_tokens=SHAPE_TOKENS)
    assert store.flush(60)
    store.close()
    return chunks


def _cold(store: Path) -> None:
    for f in _record_files(store):
        _drop_from_page_cache(f)
    if any(_cached_bytes(f) > 0 for f in _record_files(store)):
        pytest.skip("this filesystem keeps files in memory (the page cache cannot be dropped)")


@pytest.mark.parametrize("direct", [True, False])
def test_cold_loads_bypass_the_page_cache(tmp_path: Path, direct: bool) -> None:
    skip_without_o_direct(tmp_path)
    path = tmp_path / "s"
    chunks = _saved_store(path)
    _cold(path)
    store = ChunkStore(_config(path, direct))
    try:
        payloads = store.backend.payloads
        assert isinstance(payloads, FilePayloads) and payloads.direct_reads == direct
        got = list(store.load_many([k for k, _ in chunks]))
        for (_, kv), loaded in zip(chunks, got, strict=True):
            assert loaded.tensor is not None and torch.equal(loaded.tensor.view(torch.int16), kv.view(torch.int16))
        cached = [_cached_bytes(f) for f in _record_files(path)]
        size = [f.stat().st_size for f in _record_files(path)]
        if direct:
            # only the header's page, read to learn the record's shape, went through the cache
            assert all(c <= 4096 for c in cached), (cached, size)
            assert all(s > 8 * 4096 for s in size)  # (records of many pages: the test means something)
            assert payloads.direct_reads  # it worked on this filesystem
        else:
            assert all(c >= s for c, s in zip(cached, size, strict=True))  # buffered: the page cache fills
    finally:
        store.close()


def test_warm_records_are_copied_from_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record the page cache holds is not read from the disk again (no O_DIRECT open)."""
    path = tmp_path / "s"
    chunks = _saved_store(path)
    for f in _record_files(path):
        f.read_bytes()  # as `kvtier prefetch` warms them
    opened_direct = []
    real_open = os.open

    def watching(p: str, flags: int, *a: int) -> int:
        if flags & os.O_DIRECT and str(p).endswith(".kvt"):
            opened_direct.append(p)
        return real_open(p, flags, *a)

    store = ChunkStore(_config(path))
    try:
        monkeypatch.setattr(os, "open", watching)
        got = list(store.load_many([k for k, _ in chunks]))
        assert all(g.tensor is not None and torch.equal(g.tensor.view(torch.int16), kv.view(torch.int16))
                   for (_, kv), g in zip(chunks, got, strict=True))
        assert opened_direct == []
    finally:
        monkeypatch.undo()
        store.close()
