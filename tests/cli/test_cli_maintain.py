"""verify (with corruption), evict and compact, through the console script, both backends.

Each console-script start costs ~2 s (importing torch), so follow-up checks whose
console-script path is already covered run the same ``main()`` in-process."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
from clihelpers import (
    NS_LLAMA,
    NS_QWEN,
    Built,
    cli,
    corrupt,
    entries,
    one_line_error,
    run_main,
    run_many,
    touch,
)

from kvtier.backends import StoreLock, open_backend
from kvtier.config import CacheConfig
from kvtier.units import format_size


def test_verify_finds_and_removes_corruption(fresh_store: Built, capsys: pytest.CaptureFixture[str]) -> None:
    b = fresh_store
    llama = NS_LLAMA.id.hex()
    bad_payload, bad_header = b.keys[llama][1], b.keys[llama][4]
    corrupt(b.path, b.backend, bad_payload, "payload")
    corrupt(b.path, b.backend, bad_header, "header")

    ver = cli("verify", b.path)
    assert ver.returncode == 1, ver.stdout + ver.stderr
    assert "Traceback" not in ver.stderr
    assert "2 corrupt" in ver.stdout, ver.stdout
    assert f"{b.total_chunks - 2} ok" in ver.stdout
    assert bad_payload.hex()[:16] in ver.stdout and bad_header.hex()[:16] in ver.stdout
    assert "payload checksum mismatch" in ver.stdout and "header checksum mismatch" in ver.stdout
    assert "--remove-corrupt" in ver.stdout
    present = entries(b.path, b.backend)
    assert len(present) == b.total_chunks  # nothing removed without the flag

    ins = run_main(capsys, "inspect", b.path, bad_payload.hex(), "--json")
    assert ins.returncode == 1
    info = json.loads(ins.stdout)
    assert info["status"] == "corrupt: payload checksum mismatch" and info["header"]["num_tokens"] == 64

    rm = cli("verify", b.path, "--remove-corrupt", "--json")
    assert rm.returncode == 1, rm.stderr  # corruption was found (and removed)
    rep = json.loads(rm.stdout)
    assert {c["key"] for c in rep["corrupt"]} == {bad_payload.hex(), bad_header.hex()}
    assert rep["removed"] == 2
    assert rep["removed_bytes"] == present[bad_payload][0] + present[bad_header][0]
    assert rep["ok"] == b.total_chunks - 2
    left = entries(b.path, b.backend)
    assert bad_payload not in left and bad_header not in left
    assert len(left) == b.total_chunks - 2

    again = run_main(capsys, "verify", b.path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "all records verify" in again.stdout
    assert f"{b.total_chunks - 2} ok, 0 corrupt" in again.stdout


def test_verify_reports_and_drops_records_whose_file_was_removed(built_stores: dict[str, Built],
                                                               tmp_path: Path) -> None:
    src = built_stores["files"]
    store = tmp_path / "store"
    shutil.copytree(src.path, store)
    key = src.keys[NS_LLAMA.id.hex()][2]
    h = key.hex()
    (victim,) = (store / "files" / h[:2] / h[2:4]).glob(f"{h}.*.kvt")
    victim.unlink()
    ver = cli("verify", store, "--json")
    assert ver.returncode == 1, ver.stdout + ver.stderr
    rep = json.loads(ver.stdout)
    assert [m["key"] for m in rep["missing"]] == [h] and rep["gone"] == 0 and rep["removed"] == 0
    assert key in entries(store, "files")  # nothing removed without the flag
    rm = cli("verify", store, "--remove-corrupt")
    assert rm.returncode == 1 and "1 missing" in rm.stdout and "removed 1 corrupt or missing" in rm.stdout, rm.stdout
    assert key not in entries(store, "files") and len(entries(store, "files")) == src.total_chunks - 1
    again = cli("verify", store)
    assert again.returncode == 0 and "all records verify" in again.stdout, again.stdout


def test_evict(fresh_store: Built, capsys: pytest.CaptureFixture[str]) -> None:
    b = fresh_store
    now = time.time_ns()
    rng = random.Random(3)
    keys = [k for ks in b.keys.values() for k in ks]
    rng.shuffle(keys)
    old = keys[:5]  # last used ten days ago
    times = {k: now - 10 * 86400 * 10**9 + i for i, k in enumerate(old)}
    times |= {k: now - 3600 * 10**9 + i * 10**6 for i, k in enumerate(keys[5:])}
    touch(b.path, b.backend, times)
    before = entries(b.path, b.backend, occupied=True)
    assert {k: t for k, (_, t) in before.items()} == times
    sizes = {k: s for k, (s, _) in before.items()}
    budget = sum(sizes.values()) // 2

    # --dry-run removes nothing, and says what would go.
    dry = cli("evict", b.path, "--max-bytes", budget, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would remove" in dry.stdout and "nothing was removed" in dry.stdout
    total, would_go = sum(sizes.values()), 0  # --max-bytes alone: LRU first down to the budget
    for k in sorted(keys, key=lambda k: times[k]):
        if total <= budget:
            break
        total -= sizes[k]
        would_go += 1
    assert 0 < would_go < len(keys)
    assert f"would remove {would_go} of {len(keys)} chunks" in dry.stdout, dry.stdout
    dry_all = run_main(capsys, "evict", b.path, "--all", "--dry-run", "--json")
    d = json.loads(dry_all.stdout)
    assert d["dry_run"] and d["evict"]["records"] == len(keys) and d["removed"]["records"] == 0
    assert entries(b.path, b.backend, occupied=True) == before

    # --older-than drops what is unused for that long; --max-bytes then goes LRU first.
    r = cli("evict", b.path, "--older-than", "7d", "--max-bytes", budget, "--json")
    assert r.returncode == 0, r.stderr
    rest = sorted(keys[5:], key=lambda k: times[k])
    expect_gone = set(old)
    total = sum(sizes[k] for k in rest)
    for k in rest:
        if total <= budget:
            break
        expect_gone.add(k)
        total -= sizes[k]
    after = entries(b.path, b.backend, occupied=True)
    assert set(after) == set(keys) - expect_gone
    assert sum(s for s, _ in after.values()) <= budget
    out = json.loads(r.stdout)
    assert out["removed"]["records"] == len(expect_gone)
    assert out["after"]["bytes"] == sum(s for s, _ in after.values())
    # what is left is exactly the most recently used
    assert min(t for _, t in after.values()) > max(times[k] for k in expect_gone)

    # Narrowed to one namespace: by hex prefix (lmdb) or by model name (files).
    qwen = NS_QWEN.id.hex()
    narrow = ("--namespace", qwen[:8]) if b.backend == "lmdb" else ("--model", "qwen-mini")
    r2 = run_main(capsys, "evict", b.path, *narrow, "--all")
    assert r2.returncode == 0, r2.stderr
    assert "removed" in r2.stdout and "in 1 namespace(s)" in r2.stdout
    final = entries(b.path, b.backend, occupied=True)
    assert not set(final) & set(b.keys[qwen])
    assert set(final) == set(after) - set(b.keys[qwen])

    # The emptied namespace stays registered, but the table lists it only with --all.
    table = run_main(capsys, "ls", b.path)
    assert table.returncode == 0 and "qwen-mini" not in table.stdout and "tiny-llama" in table.stdout
    assert "1 namespace(s)" in table.stdout
    assert "1 empty namespace(s) not shown (--all lists them)" in table.stdout
    every = run_main(capsys, "ls", b.path, "--all")
    assert "qwen-mini" in every.stdout and "2 namespace(s)" in every.stdout
    listed = json.loads(run_main(capsys, "ls", b.path, "--json").stdout)
    assert {n["model"]: n["chunks"] for n in listed["namespaces"]}["qwen-mini"] == 0
    run_main(capsys, "evict", b.path, "--all")
    nothing = run_main(capsys, "ls", b.path)
    assert "no chunks stored; 2 empty namespace(s) not shown" in nothing.stdout


def test_compact(built_stores: dict[str, Built], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lm, busy = tmp_path / "lmdb", tmp_path / "busy"
    shutil.copytree(built_stores["lmdb"].path, lm)
    shutil.copytree(built_stores["lmdb"].path, busy)
    keep = built_stores["lmdb"].keys[NS_QWEN.id.hex()]
    backend = open_backend(CacheConfig(path=lm, backend="lmdb"), create=False)
    try:
        backend.delete([k for k in entries(lm, "lmdb") if k not in keep])
    finally:
        backend.close()
    size_before = (lm / "lmdb" / "data.mdb").stat().st_size
    busy_before = (busy / "lmdb" / "data.mdb").read_bytes()

    lock = StoreLock(busy)  # what a running server holds
    try:
        ok, refused = run_many(("compact", lm, "--json"), ("compact", busy))
    finally:
        lock.release()
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    # each LMDB file is reported on its own: the records' file and the shared index
    by_file = {f["file"]: f for f in out["files"]}
    assert set(by_file) == {"lmdb/data.mdb", "index/data.mdb"}
    rec = by_file["lmdb/data.mdb"]
    assert rec["reclaimed_bytes"] > 0 and rec["before_bytes"] == size_before
    assert (lm / "lmdb" / "data.mdb").stat().st_size == rec["after_bytes"] < size_before
    for f in out["files"]:
        assert f["reclaimed_bytes"] == f["before_bytes"] - f["after_bytes"]
        assert (lm / f["file"]).stat().st_size == f["after_bytes"]
    assert out["reclaimed_bytes"] == sum(f["reclaimed_bytes"] for f in out["files"])
    assert set(entries(lm, "lmdb")) == set(keep)  # the records survive compaction

    one_line_error(refused, 1, "in use", "stop the server")
    assert (busy / "lmdb" / "data.mdb").read_bytes() == busy_before


def test_compact_files_store_compacts_its_index(built_stores: dict[str, Built], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # 'stats' counts the index's free pages as reclaimable by compact: compact must give them back.
    fs = tmp_path / "files"
    shutil.copytree(built_stores["files"].path, fs)
    keep = built_stores["files"].keys[NS_QWEN.id.hex()]
    backend = open_backend(CacheConfig(path=fs, backend="files"), create=False)
    try:
        for k in entries(fs, "files"):  # one commit each: the index's file grows, then frees
            if k not in keep:
                backend.delete([k])
    finally:
        backend.close()
    index = fs / "index" / "data.mdb"
    before = index.stat().st_size
    stats = json.loads(run_main(capsys, "stats", fs, "--json").stdout)
    assert stats["lmdb"]["reclaimable_bytes"] > 0, stats["lmdb"]

    busy = StoreLock(fs)  # needs the store to itself, as for an lmdb store
    try:
        refused = run_main(capsys, "compact", fs)
    finally:
        busy.release()
    one_line_error(refused, 1, "in use", "stop the server")
    assert index.stat().st_size == before

    r = run_main(capsys, "compact", fs)
    assert r.returncode == 0, r.stderr
    after = index.stat().st_size
    assert after < before
    assert r.stdout.strip() == (f"{fs}: compacted index/data.mdb from {format_size(before)} to "
                                f"{format_size(after)} ({format_size(before - after)} reclaimed)")
    assert set(entries(fs, "files")) == set(keep)
    assert run_main(capsys, "verify", fs).returncode == 0


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_compact_of_a_store_named_relative_to_the_working_directory(
        built_stores: dict[str, Built], tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """STORE as typed (``./cache``): compact rewrites and reports each file, as with a full
    path (it failed half-way before, the records compacted and the index not)."""
    shutil.copytree(built_stores[backend].path, tmp_path / "cache")
    monkeypatch.chdir(tmp_path)
    r = run_main(capsys, "compact", "./cache", "--json")
    assert r.returncode == 0, r.stderr
    files = {f["file"] for f in json.loads(r.stdout)["files"]}
    assert files == ({"lmdb/data.mdb", "index/data.mdb"} if backend == "lmdb" else {"index/data.mdb"})
    assert run_main(capsys, "verify", "cache").returncode == 0


def test_compact_keeps_each_files_owner_and_permissions(built_stores: dict[str, Built], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """LMDB writes the compacted copy for whoever runs compact, under their umask: the
    store's files stay its owner's, readable by its owner only (the KV of users' prompts),
    also when root compacts a store a server's user owns."""
    import os

    store = tmp_path / "lmdb"
    shutil.copytree(built_stores["lmdb"].path, store)
    owner = os.getuid() if os.getuid() != 0 else 65534  # (root: a store of another user's)
    if os.getuid() == 0:
        for d, _, names in os.walk(store):
            os.chown(d, owner, owner)
            for n in names:
                os.chown(os.path.join(d, n), owner, owner)
    old_umask = os.umask(0o022)
    try:
        r = run_main(capsys, "compact", store)
    finally:
        os.umask(old_umask)
    assert r.returncode == 0, r.stderr
    for f in ("lmdb/data.mdb", "index/data.mdb"):
        st = (store / f).stat()
        assert (oct(st.st_mode & 0o777), st.st_uid) == (oct(0o600), owner), f


def test_compact_refuses_when_it_cannot_give_a_file_back_to_its_owner(
        built_stores: dict[str, Built], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user than the store's owner (one with write access to its directories): the
    copy would be theirs, 0600, and the owner's server could not open it. Refused, one
    line, nothing replaced. (Such a user cannot give a file away: ``chown`` fails as it
    does for them.)"""
    import os

    if os.getuid() != 0:
        pytest.skip("needs root, to give the store to another user first")
    store = tmp_path / "lmdb"
    shutil.copytree(built_stores["lmdb"].path, store)
    for d, _, names in os.walk(store):
        os.chown(d, 65534, 65534)
        for n in names:
            os.chown(os.path.join(d, n), 65534, 65534)
    before = {f: (store / f).read_bytes() for f in ("lmdb/data.mdb", "index/data.mdb")}

    def not_permitted(*args: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "chown", not_permitted)
    r = run_main(capsys, "compact", store)
    one_line_error(r, 1, "owned by user 65534", "run compact as the store's owner")
    assert {f: (store / f).read_bytes() for f in before} == before
    assert not list(store.rglob("compact.tmp"))


def test_compact_syncs_the_copy_before_it_replaces_the_file(built_stores: dict[str, Built], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """LMDB's copy is not synced, and the rename of it over the data file needs its directory
    synced: without both, a power loss soon after a compact could leave the store's only
    data file empty or partial. Each file is synced before it replaces the old one, and its
    directory after."""
    import os

    from kvtier.backends import lmdb_env

    store = tmp_path / "lmdb"
    shutil.copytree(built_stores["lmdb"].path, store)
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = lmdb_env.fsync_path, os.replace
    monkeypatch.setattr(lmdb_env, "fsync_path", lambda p: (events.append(("fsync", str(p))), real_fsync(p))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    assert run_main(capsys, "compact", store).returncode == 0
    for env in ("lmdb", "index"):
        data, where = str(store / env / "data.mdb"), str(store / env)
        copy = str(store / env / "compact.tmp" / "data.mdb")
        at = events.index(("replace", data))
        assert ("fsync", copy) in events[:at], events
        assert ("fsync", where) in events[at + 1:], events
