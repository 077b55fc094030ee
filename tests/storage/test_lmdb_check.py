"""The page check a process runs before it trusts an existing LMDB environment
(``kvtier.backends.lmdb_check``): intact stores open (checked once per process while
unchanged), damaged ones are refused with ``StoreDamaged``, and a helper that cannot run
never stops a store from opening. Damaged pages that crash readers are in
``tests/reliability/test_corruption_fuzz.py``."""

from __future__ import annotations

import logging
import random
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
from kvhelpers import free_list_pages, lmdb_leaf_nodes, make_kv, open_cache, same_bits, seq_tokens

from kvtier import KVCache
from kvtier.backends import lmdb_check
from kvtier.backends.lmdb_check import damage_report
from kvtier.errors import StoreDamaged


def _loads_intact(cache: KVCache, i: int) -> bool:
    got = cache.load(seq_tokens(i))
    return got.shape[2] > 0 and same_bits(got, make_kv(seq_tokens(i)[: got.shape[2]]))


def _filled(path: Path, backend: str = "lmdb") -> Path:
    with open_cache(path, backend) as cache:
        for i in range(4):
            cache.save(seq_tokens(i), make_kv(seq_tokens(i)))
        assert cache.flush(60)
    return path


def _count_helpers(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    runs: list[list[str]] = []
    real = subprocess.run

    def counting(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[bytes]:
        runs.append(cmd)
        return real(cmd, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(lmdb_check.subprocess, "run", counting)
    return runs


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_intact_store_is_checked_once_while_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      backend: str) -> None:
    store = _filled(tmp_path / "s", backend)
    runs = _count_helpers(monkeypatch)
    assert damage_report(store / "index") is None
    assert damage_report(store / "index") is None
    monkeypatch.chdir(store)
    assert damage_report(Path("index")) is None  # (the same environment, named relatively)
    assert len(runs) == 1  # remembered: the data file did not change
    envs = 2 if backend == "lmdb" else 1  # (an lmdb store's records are a second environment)
    lmdb_check._CHECKED.clear()
    runs.clear()
    with open_cache(store, backend) as cache:  # a fresh process's open: each environment once
        assert _loads_intact(cache, 2)
        cache.save(seq_tokens(9), make_kv(seq_tokens(9)))
        assert cache.flush(60)
    assert len(runs) == envs, runs
    with open_cache(store, backend) as cache:  # written since: checked again
        assert _loads_intact(cache, 9)
    assert len(runs) == 2 * envs, runs


def test_new_store_needs_no_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _count_helpers(monkeypatch)
    _filled(tmp_path / "s")
    assert runs == []  # nothing existed to be damaged


def test_not_an_lmdb_file_is_refused(tmp_path: Path) -> None:
    store = _filled(tmp_path / "s")
    (store / "index" / "data.mdb").write_bytes(b"\x00" * 8192)
    assert "MDB_INVALID" in (damage_report(store / "index") or "")
    with pytest.raises(StoreDamaged, match="damaged or unreadable .*delete it"):
        open_cache(store, "lmdb").close()


def test_helper_that_hangs_is_damage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _filled(tmp_path / "s")
    monkeypatch.setattr(lmdb_check, "_helper_command",
                        lambda path, preread: [sys.executable, "-c", "import time; time.sleep(30)"])
    monkeypatch.setattr(lmdb_check, "_timeout_s", lambda data: 0.5)
    assert "did not finish" in (damage_report(store / "index") or "")


@pytest.mark.parametrize("cause", ["no interpreter", "helper fails"])
def test_helper_that_cannot_run_opens_unchecked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture, cause: str) -> None:
    """Not the store's fault (an embedded Python, a broken environment): warn and open."""
    store = _filled(tmp_path / "s")
    lmdb_check._CHECKED.clear()
    command = [str(tmp_path / "no-such-python")] if cause == "no interpreter" else \
        [sys.executable, "-c", "raise SystemExit('cannot import lmdb')"]
    monkeypatch.setattr(lmdb_check, "_helper_command", lambda path, preread: command)
    with caplog.at_level(logging.WARNING, logger="kvtier"), open_cache(store, "lmdb") as cache:
        assert _loads_intact(cache, 1)
    assert "opening it unchecked" in caplog.text


def test_an_address_space_limit_is_not_damage(tmp_path: Path) -> None:
    """LMDB maps a whole environment (an lmdb store's records: up to disk_bytes, 64G by
    default). Under ``ulimit -v`` a healthy store fails to map with ENOMEM, which without a
    limit means a damaged meta page. With a limit set it is reported as the limit, with what
    to do, and never as damage to delete."""
    from kvhelpers import REPO

    store = tmp_path / "s"
    toks = seq_tokens(0)
    with open_cache(store, "lmdb", disk_bytes="64G") as cache:
        cache.save(toks, make_kv(toks))
        assert cache.flush(30)
    script = (
        "import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))\n"
        "from kvtier import CacheConfig, ChunkStore\n"
        "from kvtier.errors import StoreDamaged\n"
        "try:\n"
        f"    ChunkStore(CacheConfig(path={str(store)!r})).close()\n"
        "except StoreDamaged as exc:\n"
        "    print('DAMAGED', exc)\n"
        "except Exception as exc:\n"
        "    print('REFUSED', exc)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("REFUSED"), out.stdout + out.stderr
    assert "address-space limit (ulimit -v" in out.stdout and "raise or remove the limit" in out.stdout
    with open_cache(store, "lmdb", disk_bytes="64G") as cache:  # untouched: intact without the limit
        got = cache.load(toks)
        assert got.shape[2] == cache.lookup(toks) > 0 and same_bits(got, make_kv(toks[: got.shape[2]]))


# -- LMDB's free-page list, which only writers read ------------------------------------------
def _busy_env(path: Path, seed: int) -> None:
    """An environment with every shape the page check walks: a free list that is a two-level
    tree with records in overflow pages (a reader held open keeps every freed page listed
    while many commits rewrite and delete), values in overflow pages, and a database of
    sorted duplicates holding both inline pages of duplicates and trees of them."""
    rng = random.Random(seed)
    env = lmdb.open(str(path), max_dbs=4, map_size=1 << 30, sync=False)
    db, dups = env.open_db(b"a"), env.open_db(b"d", dupsort=True)
    pinned = env.begin()
    for step in range(300):
        with env.begin(write=True) as txn:
            for _ in range(20):
                key = rng.randrange(2000).to_bytes(4, "big")
                if rng.random() < 0.6:
                    txn.put(key, bytes(rng.choice([10, 300, 5000])), db=db)
                else:
                    txn.delete(key, db=db)
                txn.put(b"few%d" % rng.randrange(2000), rng.randbytes(20), db=dups)  # a few each: inline
                txn.put(b"a-many", rng.randbytes(40), db=dups)  # thousands: a tree of its own
            if step % 100 == 99:  # one commit that frees hundreds of pages: a record in overflow pages
                cur = txn.cursor(db=db)
                while cur.first() and cur.delete():
                    pass
    pinned.abort()
    env.close()


def _free_list_meta(data: bytes) -> tuple[int, int]:
    """(depth, overflow pages) of the free list, from the later meta page (see free_list_pages)."""
    meta = max((data[n * 4096 : (n + 1) * 4096] for n in (0, 1)), key=lambda m: struct.unpack_from("<Q", m, 144)[0])
    return struct.unpack_from("<H", meta, 46)[0], struct.unpack_from("<Q", meta, 64)[0]


def test_a_large_busy_environment_reads_back_sound(tmp_path: Path) -> None:
    """No false alarm on a healthy environment of every shape (see _busy_env)."""
    _busy_env(tmp_path / "env", seed=1)
    data = (tmp_path / "env" / "data.mdb").read_bytes()
    assert _free_list_meta(data)[0] == 2 and _free_list_meta(data)[1] > 0  # the shapes this covers:
    dup_kinds = {struct.unpack_from("<H", data, node + 4)[0] for node in lmdb_leaf_nodes(data, b"d")}
    assert {0x04, 0x06} <= dup_kinds, dup_kinds  # inline duplicates (F_DUPDATA), a tree of them (+F_SUBDATA)
    with lmdb.open(str(tmp_path / "env"), readonly=True, max_dbs=4) as env, env.begin() as txn:
        listed = lmdb_check.check_structure(str(tmp_path / "env" / "data.mdb"), txn.id())
    assert listed is not None and listed > 1000
    assert damage_report(tmp_path / "env") is None


def test_the_free_list_check_holds_while_another_process_commits(tmp_path: Path) -> None:
    """The check parses pages outside py-lmdb, so it must read the free list of the snapshot
    its reader holds: a writer committing all the while never makes it report damage."""
    env_dir = tmp_path / "env"
    lmdb.open(str(env_dir), max_dbs=4).close()
    writer = ("import lmdb, os, random, sys, time\n"
              "env = lmdb.open(sys.argv[1], max_dbs=4, map_size=1 << 30, sync=False)\n"
              "db = env.open_db(b'a'); rng = random.Random(5); end = time.monotonic() + 4\n"
              "while time.monotonic() < end:\n"
              "    with env.begin(write=True) as txn:\n"
              "        for _ in range(rng.randrange(1, 40)):\n"
              "            k = rng.randrange(2000).to_bytes(4, 'big')\n"
              "            txn.put(k, os.urandom(rng.choice([10, 5000])), db=db) if rng.random() < 0.6 else txn.delete(k, db=db)\n")
    proc = subprocess.Popen([sys.executable, "-c", writer, str(env_dir)])
    checks = 0
    try:
        while proc.poll() is None:
            lmdb_check.walk(str(env_dir))  # raises lmdb.CorruptedError on any finding
            checks += 1
    finally:
        proc.wait(10)
    assert proc.returncode == 0 and checks > 20, (proc.returncode, checks)


def _damage_free_list(data: bytearray, how: str) -> None:
    leaf = next(pg for pg in free_list_pages(data) if struct.unpack_from("<H", data, pg * 4096 + 10)[0] & 0x02)
    at = leaf * 4096
    ptr = struct.unpack_from("<H", data, at + 16)[0]  # the leaf's first record
    lo, hi, flags, ksize = struct.unpack_from("<HHHH", data, at + ptr)
    ids = at + ptr + 8 + ksize  # its page numbers: a count, then the numbers (descending)
    if flags & 0x01:  # a record in overflow pages
        ids = struct.unpack_from("<Q", data, ids)[0] * 4096 + 16
    if how == "node offset":
        struct.pack_into("<H", data, at + 16, 0xF000)
    elif how == "page number":
        struct.pack_into("<Q", data, at, leaf + 1)
    elif how == "record count":
        struct.pack_into("<Q", data, ids, struct.unpack_from("<Q", data, ids)[0] + 1000)
    elif how == "free page number":
        struct.pack_into("<Q", data, ids + 8, 1 << 40)
    elif how == "page order":
        assert struct.unpack_from("<Q", data, ids)[0] >= 2
        struct.pack_into("<Q", data, ids + 8, 2)  # the first (largest) number made the smallest
    elif how == "page listed twice":
        struct.pack_into("<Q", data, ids + 16, struct.unpack_from("<Q", data, ids + 8)[0])
    elif how == "page in use":  # the record now lists one page: the free list's own leaf
        struct.pack_into("<QQ", data, ids, 1, leaf)
    elif how == "database flags":  # the free list's record in the later meta page: DUPSORT
        meta = max((0, 1), key=lambda n: struct.unpack_from("<Q", data, n * 4096 + 144)[0])
        struct.pack_into("<H", data, meta * 4096 + 44, struct.unpack_from("<H", data, meta * 4096 + 44)[0] | 0x04)
    elif how == "dirty flag":  # what LMDB clears before writing a page, forged
        struct.pack_into("<H", data, at + 10, 0x02 | 0x10)
    else:  # "record length": the record's size in its node, beyond the page
        struct.pack_into("<H", data, at + ptr, 0xFFF0)


@pytest.mark.parametrize(("how", "says"), [
    ("node offset", "a node at offset 61440"), ("page number", "says it is page"),
    ("record count", "page numbers says it has"), ("free page number", "free page numbers outside 2.."),
    ("page order", "free page numbers out of order"), ("page listed twice", "or one twice"),
    ("page in use", "is listed free and is in use"), ("database flags", "the free list: database flags 0xc"),
    ("dirty flag", "has flags 0x12 where a leaf page belongs"),
    ("record length", "(overlapping, or with a gap)")])
def test_each_kind_of_free_list_damage_is_named(tmp_path: Path, how: str, says: str) -> None:
    """What a writer would trust blindly is found and named, and the store is refused. (The
    flags, a page listed twice and a free page in use are from a review against mdb.c: each
    passed the reader's walk, and the first aborted a writer, the others would in upstream
    LMDB or with ``writemap``.)"""
    store = _filled(tmp_path / "s", "files")
    data = bytearray((store / "index" / "data.mdb").read_bytes())
    _damage_free_list(data, how)
    (store / "index" / "data.mdb").write_bytes(bytes(data))
    assert says in (damage_report(store / "index") or ""), damage_report(store / "index")
    with pytest.raises(StoreDamaged, match="page structure"):
        open_cache(store, "files").close()


@pytest.mark.parametrize("size", [1, 2, 8])
def test_fixed_size_duplicates_read_back_sound(tmp_path: Path, size: int) -> None:
    """Regression (a false alarm found in review): on a page of fixed-size duplicates,
    ``mp_upper`` only counts (``end - n * (size - 2)``, modulo 2**16), so with 1-byte values
    it passes the page's end. Inline pages and trees of such duplicates read back sound."""
    env = lmdb.open(str(tmp_path / "env"), max_dbs=2)
    db = env.open_db(b"f", dupsort=True, dupfixed=True)
    with env.begin(write=True) as txn:
        for key, count in ((b"two", 2), (b"some", 60), (b"many", 3000)):  # inline, inline, a tree
            for v in range(count):
                txn.put(key, (v % 256 ** size).to_bytes(size, "big"), db=db)
    with env.begin() as txn:
        assert lmdb_check.check_structure(str(tmp_path / "env" / "data.mdb"), txn.id()) is not None
    env.close()
    assert damage_report(tmp_path / "env") is None
