"""A store directory prepared by someone else: links out of the store, stray files, absurd
records; and what kvtier itself creates is owner-only. kvtier never reads, writes or removes
a file outside the store through a link, and never runs or unpickles anything from it."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from kvhelpers import REPO, make_kv, open_cache, same_bits, tokens  # noqa: I001
from relhelpers import record

from kvtier.backends.index import StoreIndex

TOKS = tokens(3, 96)


def _fill(store: Path) -> dict[bytes, int]:
    with open_cache(store, "files") as cache:
        cache.save(TOKS, make_kv(TOKS))
        assert cache.flush(30)
    index = StoreIndex(store, readonly=True)
    try:
        return {e.key: e.location for e in index.entries()}
    finally:
        index.close()


def _record_path(store: Path, key: bytes, loc: int) -> Path:
    h = key.hex()
    return store / "files" / h[:2] / h[2:4] / f"{h}.{loc:016x}.kvt"


def test_links_out_of_the_store_are_not_followed(tmp_path: Path) -> None:
    store = tmp_path / "s"
    entries = _fill(store)
    outside = tmp_path / "outside"
    outside.mkdir()
    keys = sorted(entries, key=lambda k: k.hex())
    # 1) a record file replaced by a link to a file outside (a valid record, even)
    k1 = keys[0]
    p1 = _record_path(store, k1, entries[k1])
    target1 = outside / "victim.kvt"
    target1.write_bytes(p1.read_bytes())
    p1.unlink()
    p1.symlink_to(target1)
    # 2) a record's shard directory replaced by a link to a directory outside
    k2 = keys[1]
    p2 = _record_path(store, k2, entries[k2])
    shard = p2.parent
    (outside / "shard").mkdir()
    moved = outside / "shard" / p2.name
    moved.write_bytes(p2.read_bytes())
    for f in shard.iterdir():
        if f != p2:
            os.replace(f, outside / "shard" / f.name)
    p2.unlink()
    shard.rmdir()
    shard.symlink_to(outside / "shard")
    with open_cache(store, "files") as cache:
        for k in (k1, k2):
            got = cache.store.load(k)
            assert got.tensor is None and got.outcome.value in ("io_error", "miss"), got
        got = cache.load(TOKS)  # a correct (shorter) prefix, nothing from outside
        assert same_bits(got, make_kv(TOKS[: got.shape[2]]))
        cache.store.backend.delete([k1, k2])  # removal never reaches outside either
        cache.store.backend.sweep_orphans(grace_s=0)
    assert target1.exists() and moved.exists(), "a file outside the store was removed"
    record("hostile/links", links_planted=2, followed=0, outside_files_removed=0)


def test_a_fifo_in_place_of_a_file_is_refused_not_waited_on(tmp_path: Path) -> None:
    """A FIFO where a record or the store marker should be would block a plain open forever
    (a load on the model's path, or the CLI): it is an unreadable file instead, and kept."""
    import subprocess
    import sys
    import threading

    store = tmp_path / "s"
    entries = _fill(store)
    key = min(entries, key=lambda k: k.hex())
    fifo = _record_path(store, key, entries[key])
    fifo.unlink()
    os.mkfifo(fifo)
    got: list[object] = []
    with open_cache(store, "files") as cache:
        t = threading.Thread(target=lambda: got.append(cache.store.load(key)), daemon=True)
        t.start()
        t.join(20)
        assert got and got[0].outcome.value == "io_error", got  # type: ignore[attr-defined]
    kvtier = Path(sys.executable).parent / "kvtier"
    r = subprocess.run([str(kvtier), "verify", str(store)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "unreadable" in r.stdout + r.stderr, (r.stdout, r.stderr)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # kept: not proven corrupt
    marker = store / "kvtier-store.json"
    marker.unlink()
    os.mkfifo(marker)
    r = subprocess.run([str(kvtier), "ls", str(store)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "kvtier-store.json is unreadable" in r.stderr, r.stderr
    record("hostile/fifos", planted=2, waited_on=0)


def test_stray_files_are_ignored_and_kept(tmp_path: Path) -> None:
    store = tmp_path / "s"
    entries = _fill(store)
    key = next(iter(entries))
    shard = _record_path(store, key, entries[key]).parent
    strays = [shard / "notes.txt", shard / "x.kvt", shard / f"{key.hex()}.kvt", shard / f"{key.hex()}.zz.kvt",
              store / "files" / "README"]
    for f in strays:
        f.write_bytes(b"someone else's file")
    with open_cache(store, "files") as cache:
        assert same_bits(cache.load(TOKS), make_kv(TOKS))
        assert cache.store.backend.sweep_orphans(grace_s=0) == 0
    assert all(f.exists() for f in strays)
    record("hostile/stray_files", planted=len(strays), touched=0)


def test_what_kvtier_creates_is_owner_only(tmp_path: Path) -> None:
    for backend in ("lmdb", "files"):
        store = tmp_path / backend
        with open_cache(store, backend) as cache:
            cache.save(TOKS, make_kv(TOKS))
            assert cache.flush(30)
        loose = []
        for root, dirs, files in os.walk(store):
            for d in dirs:
                if stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode) & 0o077:
                    loose.append(os.path.join(root, d))
            for f in files:
                if stat.S_IMODE(os.stat(os.path.join(root, f)).st_mode) & 0o077:
                    loose.append(os.path.join(root, f))
        assert stat.S_IMODE(os.stat(store).st_mode) == 0o700
        assert not loose, loose
    record("hostile/owner_only", stores_checked=2, loose_modes=0)


def test_nothing_is_executed_or_unpickled_from_a_store() -> None:
    """Records, the index and the marker are parsed with struct and json only."""
    risky = re.compile(r"import (pickle|marshal|shelve)|\b(pickle|marshal|shelve)\.|"
                       r"(torch|np|numpy)\.load\(|(?<![\w.])(eval|exec)\(")
    found = []
    for path in (REPO / "kvtier").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if risky.search(code):
                found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not found, found
