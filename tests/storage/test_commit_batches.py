"""Group commits are bounded by ``commit_bytes``, whose default depends on the backend: an
LMDB write transaction holds a copy of its whole batch in allocated memory until it commits,
so LMDB's batches default to 16 MiB; the files backend holds no copy and defaults to 256 MiB.
Real LMDB and real files; the writer is held on its first batch so the rest queue up."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from kvhelpers import CHUNK, make_kv, namespace, open_cache, same_bits, tokens

from kvtier import CacheConfig
from kvtier.backends.files import FilePayloads
from kvtier.backends.lmdb import LmdbPayloads

MIB = 1 << 20
SHAPE = (8, 2, 16, 64)  # 1 MiB per 32-token bf16 chunk
CHUNKS = 40


def test_default_commit_bytes_by_backend(tmp_path: Path) -> None:
    assert CacheConfig(path=tmp_path, backend="lmdb").commit_bytes == 16 * MIB
    assert CacheConfig(path=tmp_path, backend="files").commit_bytes == 256 * MIB
    assert CacheConfig(path=tmp_path, backend="lmdb", commit_bytes="64M").commit_bytes == 64 * MIB
    assert CacheConfig.from_dict({"path": str(tmp_path), "commit_bytes": None}).commit_bytes == 16 * MIB


def _batches_of_a_backlog(tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch,
                          **cfg: Any) -> list[int]:
    """Save CHUNKS chunks while the writer is held inside its first batch; return the bytes
    of every batch the backend was given, after checking each chunk reads back intact."""
    cls = LmdbPayloads if backend == "lmdb" else FilePayloads
    real = cls.write_many
    batches: list[int] = []
    release = threading.Event()

    def spy(self: Any, items: list[Any], locations: list[int]) -> list[BaseException | None]:
        batches.append(sum(it.size for it in items))
        if len(batches) == 1:
            assert release.wait(30), "the test never released the writer"
        return real(self, items, locations)

    monkeypatch.setattr(cls, "write_many", spy)
    ns = namespace(kv_shape=SHAPE)
    toks = tokens(3, CHUNKS * CHUNK)
    kv = make_kv(toks, kv_shape=SHAPE)
    with open_cache(tmp_path / "s", backend, ns=ns, write_queue_bytes="128M", host_bytes="8M",
                    disk_bytes="1G", **cfg) as cache:
        head = cache.save(toks[:CHUNK], kv[:, :, :CHUNK])  # the writer takes it and is held
        while not batches:
            threading.Event().wait(0.01)
        assert head + cache.save(toks, kv) == CHUNKS * CHUNK
        release.set()
        assert cache.flush(60)
        assert cache.stats()["saves_committed"] == CHUNKS
    with open_cache(tmp_path / "s", backend, ns=ns, disk_bytes="1G") as cache:  # from disk, not the host tier
        assert cache.lookup(toks) == CHUNKS * CHUNK
        assert same_bits(cache.load(toks), kv)
    return batches


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_a_backlog_is_committed_in_bounded_batches(tmp_path: Path, backend: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    batches = _batches_of_a_backlog(tmp_path, backend, monkeypatch)
    backlog = batches[1:]
    assert sum(backlog) >= (CHUNKS - 1) * MIB
    if backend == "lmdb":  # 39 MiB waiting: three transactions of at most 16 MiB of chunks
        assert len(backlog) == 3
        assert max(backlog) <= 16 * MIB + 16 * 4096  # 16 chunks and their headers
    else:  # all of it in one batch
        assert len(backlog) == 1


def test_lmdb_honours_an_explicit_commit_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    batches = _batches_of_a_backlog(tmp_path, "lmdb", monkeypatch, commit_bytes="64M")
    assert len(batches) == 2 and batches[1] >= (CHUNKS - 1) * MIB
