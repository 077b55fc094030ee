"""Everything kvtier creates in a store is owner-only: files 0o600, directories 0o700,
even under a permissive umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from kvhelpers import CHUNK, make_kv, open_cache, tokens


@pytest.mark.parametrize("backend", ["lmdb", "files"])
@pytest.mark.parametrize("durability", ["process", "power"])
def test_store_is_owner_only(tmp_path: Path, backend: str, durability: str) -> None:
    store = tmp_path / "s"
    old = os.umask(0)  # anything created without an explicit mode would be world-writable
    try:
        with open_cache(store, backend, durability=durability) as cache:
            for seed in range(20):  # many keys: many shard directories
                toks = tokens(seed, CHUNK + 8)
                cache.save(toks, make_kv(toks))
    finally:
        os.umask(old)
    paths = [store, *store.rglob("*")]
    files = [p for p in paths if p.is_file()]
    assert len(files) >= (20 if backend == "files" else 2)
    wrong = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in paths
             if stat.S_IMODE(p.stat().st_mode) != (0o700 if p.is_dir() else 0o600)}
    assert not wrong, f"not owner-only: {wrong}"
    names = {p.name for p in files}
    assert "kvtier-store.json" in names and "kvtier.lock" in names
    if backend == "lmdb":
        assert {"data.mdb", "lock.mdb"} <= names


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_a_store_on_a_read_only_file_system_is_not_called_damaged(tmp_path: Path, backend: str) -> None:
    """A store whose files cannot be opened for writing (here: a file system mounted
    read-only; likewise missing permissions) is refused saying so, never as a damaged store
    to delete. Reading it still works."""
    import subprocess

    from kvhelpers import config, small_tmpfs

    from kvtier import ChunkStore
    from kvtier.errors import StoreDamaged, StoreError

    with small_tmpfs(tmp_path, "16m") as mnt:
        store = mnt / "s"
        toks = tokens(1, CHUNK)
        with open_cache(store, backend) as cache:
            cache.save(toks, make_kv(toks))
            assert cache.flush(30)
        r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
        with pytest.raises(StoreError, match="mounted read-only.*remount it read-write, or open the store "
                                             "read-only") as exc:
            ChunkStore(config(store, backend))
        assert not isinstance(exc.value, StoreDamaged)
        assert "Read-only file system" in str(exc.value)
        with ChunkStore(config(store, backend), readonly=True) as ro:
            assert ro.backend.usage()[0] == 1
        # a new store there: refused saying so (it was a raw OSError from mkdir)
        with pytest.raises(StoreError, match="cannot create the store directory .*Read-only file system"):
            ChunkStore(config(mnt / "new", backend))
