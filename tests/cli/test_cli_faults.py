"""The CLI under faults that are not damage: a full disk, a compact that was interrupted, a
record re-saved while ``verify --remove-corrupt`` runs, a user who may only read the store.
None of them may be reported as damage, and only proven corruption removes data."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest
from clihelpers import (
    AS_NOBODY,
    NS_LLAMA,
    Built,
    Ran,
    build_store,
    cli,
    corrupt,
    entries,
    one_line_error,
    run_main,
)
from diskhelpers import fill_disk, small_tmpfs

from kvtier.backends import Backend, PutItem, open_backend
from kvtier.cli import verify as verify_cmd
from kvtier.cli._store import check_record
from kvtier.codec import decode_header
from kvtier.config import CacheConfig

FULL = ("no space left on the store's file system", "free space", "then retry")


@pytest.fixture
def full_disk_store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Built, Path]]:
    """A store on an 8 MiB tmpfs, built while there was room; the caller fills the disk."""
    with small_tmpfs(tmp_path, "8m") as mnt:
        yield build_store(mnt / "store", request.param), mnt


def _no_damage_advice(r: subprocess.CompletedProcess[str] | Ran) -> None:
    assert "damaged" not in r.stderr and "delete" not in r.stderr, r.stderr


@pytest.mark.parametrize("full_disk_store", ["lmdb", "files"], indirect=True)
def test_evict_on_a_full_disk_is_not_damage(full_disk_store: tuple[Built, Path],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    b, mnt = full_disk_store
    # compacted first: without free pages inside the index, its commit must grow the file
    assert run_main(capsys, "compact", b.path).returncode == 0
    filler = fill_disk(mnt)
    r = cli("evict", b.path, "--all")
    one_line_error(r, 1, *FULL, "or lower disk_bytes", str(b.path))
    _no_damage_advice(r)
    filler.unlink()
    ver = cli("verify", b.path)  # the store is intact: what was not removed still verifies
    assert ver.returncode == 0 and "all records verify" in ver.stdout, ver.stdout + ver.stderr


@pytest.mark.parametrize("full_disk_store", ["lmdb", "files"], indirect=True)
def test_compact_on_a_full_disk_leaves_nothing_behind(full_disk_store: tuple[Built, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    b, mnt = full_disk_store
    envs = [b.path / "index"] + ([b.path / "lmdb"] if b.backend == "lmdb" else [])
    filler = fill_disk(mnt)
    r = cli("compact", b.path)
    one_line_error(r, 1, *FULL, "compact writes a copy")
    _no_damage_advice(r)
    for env in envs:  # the partial copy is gone: it would block every later compact
        assert not (env / "compact.tmp").exists()
    filler.unlink()
    again = run_main(capsys, "compact", b.path)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("compacted") == len(envs)
    assert len(entries(b.path, b.backend)) == b.total_chunks
    assert run_main(capsys, "verify", b.path).returncode == 0


def test_compact_after_an_interrupted_one(built_stores: dict[str, Built], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    # A compact killed mid-copy leaves compact.tmp/ with a partial data.mdb in each env dir.
    lm = tmp_path / "lmdb"
    shutil.copytree(built_stores["lmdb"].path, lm)
    for env in ("index", "lmdb"):
        (lm / env / "compact.tmp").mkdir()
        (lm / env / "compact.tmp" / "data.mdb").write_bytes(os.urandom(8192))
    r = run_main(capsys, "compact", lm)
    assert r.returncode == 0, r.stderr
    for env in ("index", "lmdb"):
        assert not (lm / env / "compact.tmp").exists()
    assert len(entries(lm, "lmdb")) == built_stores["lmdb"].total_chunks
    assert run_main(capsys, "verify", lm).returncode == 0


def test_remove_corrupt_keeps_a_version_saved_after_the_check(fresh_store: Built,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    b = fresh_store
    key = b.keys[NS_LLAMA.id.hex()][2]
    backend = open_backend(CacheConfig(path=b.path, backend=b.backend), create=False)
    try:
        good = backend.read(key, bytes)
        entry = backend.lookup(key)
    finally:
        backend.close()
    assert good is not None and entry is not None
    corrupt(b.path, b.backend, key, "payload")
    hlen = decode_header(good).header_len
    resaved: list[bool] = []

    def resave_first(backend: Backend) -> None:
        # a server saves the chunk again (a new version, replacing the one it could not load)
        # after verify's last check of it
        if not resaved:
            res = backend.put_many([PutItem(key, good[:hlen], memoryview(good[hlen:]), entry.namespace_id,
                                            token_start=entry.token_start, num_tokens=entry.num_tokens,
                                            replace=True)])
            assert res.stored and not res.failed
            resaved.append(True)

    real_delete, real_delete_entry = Backend.delete, Backend.delete_entry
    monkeypatch.setattr(Backend, "delete",
                        lambda self, keys: (resave_first(self), real_delete(self, keys))[1])
    monkeypatch.setattr(Backend, "delete_entry",
                        lambda self, e: (resave_first(self), real_delete_entry(self, e))[1])
    rep = verify_cmd.verify(str(b.path), remove=True, show_progress=False)
    assert resaved and list(rep.corrupt) == [key]
    assert rep.removed == 0 and rep.removed_bytes == 0  # the checked version was gone already
    monkeypatch.undo()

    after = open_backend(CacheConfig(path=b.path, backend=b.backend), readonly=True, create=False)
    try:
        header = check_record(after, key)  # the new version is there and intact
    finally:
        after.close()
    assert header is not None and header.key == key
    assert len(entries(b.path, b.backend)) == b.total_chunks


def test_remove_corrupt_still_removes_what_stays_corrupt(fresh_store: Built,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    b = fresh_store
    key = b.keys[NS_LLAMA.id.hex()][0]
    corrupt(b.path, b.backend, key, "header")
    r = run_main(capsys, "verify", b.path, "--remove-corrupt")
    assert r.returncode == 1 and "removed 1 corrupt records" in r.stdout, r.stdout + r.stderr
    assert key not in entries(b.path, b.backend)
    assert len(entries(b.path, b.backend)) == b.total_chunks - 1


@pytest.fixture
def readable_only(built_stores: dict[str, Built]) -> Iterator[dict[str, Path]]:
    """Copies of both stores that nobody (uid 65534) may read but not write."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to use a store as another user")
    base = Path(tempfile.mkdtemp(prefix="kvtier-cli-ro-"))  # (tmp_path is root-only)
    try:
        base.chmod(0o755)
        stores = {}
        for name, built in built_stores.items():
            stores[name] = base / name
            shutil.copytree(built.path, stores[name])
            for p in [stores[name], *stores[name].rglob("*")]:
                p.chmod(0o755 if p.is_dir() else 0o644)
        yield stores
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_read_only_user_is_told_what_access_is_needed(readable_only: dict[str, Path], backend: str) -> None:
    store = readable_only[backend]
    r = cli("ls", store, prefix=AS_NOBODY)
    locks = ["index/lock.mdb (write)"] + (["lmdb/lock.mdb (write)"] if backend == "lmdb" else [])
    one_line_error(r, 1, str(store), *locks, "even a read-only one", "run as the store's owner", "sudo -u")
    assert r.stdout == ""


def test_read_only_user_needs_no_write_access_to_the_store_lock(readable_only: dict[str, Path],
                                                                 built_stores: dict[str, Built]) -> None:
    # kvtier.lock stays read-only (a shared flock needs no write access); only LMDB's reader
    # tables (lock.mdb) must be writable
    for store in readable_only.values():
        for lock in store.rglob("lock.mdb"):
            lock.chmod(0o666)
    for name, store in readable_only.items():
        n = built_stores[name].total_chunks
        for argv in (("ls", store), ("stats", store), ("verify", store)):
            r = cli(*argv, prefix=AS_NOBODY)
            assert r.returncode == 0, (argv, r.stdout, r.stderr)
        assert f"checked {n} records" in r.stdout and "all records verify" in r.stdout
        # a command that changes the store says what it lacks
        ev = cli("evict", store, "--all", prefix=AS_NOBODY)
        one_line_error(ev, 1, "index/data.mdb (write)", "which changing the store needs")
        assert len(entries(store, name)) == n


def test_removing_records_whose_directory_this_user_cannot_write_is_refused(
        readable_only: dict[str, Path], built_stores: dict[str, Built]) -> None:
    """A files store's record files go with their directory's write bit: a user who may
    change the index but not a record directory is refused before anything changes (else
    the index would forget records whose files stay, their space leaked, and evict would
    report space freed that was not)."""
    store = readable_only["files"]
    n = built_stores["files"].total_chunks
    for p in [store, *store.rglob("*")]:
        os.chown(p, 65534, 65534)  # nobody owns the store ...
    shard = sorted((store / "files").glob("??/??"))[0]
    os.chown(shard, 0, 0)  # ... but one record directory
    for argv in (("evict", store, "--all"), ("verify", store, "--remove-corrupt")):
        r = cli(*argv, prefix=AS_NOBODY)
        one_line_error(r, 1, f"files/{shard.parent.name}/{shard.name}/ (write)", "which changing the store needs")
    assert len(entries(store, "files")) == n
    assert len(list((store / "files").glob("??/??/*"))) == n


@pytest.mark.parametrize(("error", "needles"), [
    (lmdb.DiskError("mdb_txn_commit: No space left on device"), FULL),
    (lmdb.CorruptedError("mdb_get: MDB_CORRUPTED"), ("LMDB database is damaged or unreadable",)),
])
def test_an_lmdb_error_in_warmup_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                             error: lmdb.Error, needles: tuple[str, ...]) -> None:
    # warmup has no STORE argument: the handler must not need one
    from kvtier.cli import warmup

    def fails(args: object) -> int:
        raise error

    monkeypatch.setattr(warmup, "run", fails)
    r = run_main(capsys, "warmup", "--model", "m", "--prompts", "p.jsonl")
    one_line_error(r, 1, *needles)
    assert "internal error" not in r.stderr


def test_store_on_a_read_only_file_system(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # kvtier.lock cannot be opened for writing there: it is locked through a read-only fd
    with small_tmpfs(tmp_path, "8m") as mnt:
        b = build_store(mnt / "store", "lmdb")
        r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot remount the tmpfs read-only: {r.stderr.strip()}")
        ls = cli("ls", b.path)
        assert ls.returncode == 0 and f"{b.total_chunks} chunks" in ls.stdout, ls.stdout + ls.stderr
        ver = run_main(capsys, "verify", b.path)
        assert ver.returncode == 0 and "all records verify" in ver.stdout, ver.stdout + ver.stderr
        ev = run_main(capsys, "evict", b.path, "--all")
        one_line_error(ev, 1, "mounted read-only", "remount it read-write")
        _no_damage_advice(ev)
