"""Bad input gives one ``kvtier: error: ...`` line with advice and a non-zero status, never a
traceback. The cases the issue lists run through the console script, all at once (a start
costs ~2 s), then are checked one by one; further cases run ``main()`` in-process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from clihelpers import AS_NOBODY, Built, cli, one_line_error, run_main

# id -> (expected exit status, substrings of the one-line message)
CASES: dict[str, tuple[int, tuple[str, ...]]] = {
    "missing_path": (1, ("no such directory", "check the path")),
    "not_a_store": (1, ("not a kvtier store", "kvtier-store.json")),
    "file_not_dir": (1, ("not a directory", "store directory")),
    "newer_format": (1, ("newer kvtier", "upgrade kvtier")),
    "damaged_marker": (1, ("kvtier-store.json is unreadable", "damaged", "move the directory away")),
    "unreadable_marker": (1, ("permission denied", "owner")),
    "damaged_lmdb": (1, ("LMDB database is damaged or unreadable", "permissions")),
    "bad_size": (2, ("--max-bytes", "cannot read '50Q' as a size", "50G")),
    "bad_budget": (2, ("--budget", "cannot read 'lots' as a size")),
    "bad_age": (2, ("--older-than", "cannot read '7 days' as an age", "7d")),
    "huge_age": (2, ("--older-than", "too long an age", "at most 1000 years")),
    "huge_size": (2, ("--max-bytes", "too large a size", "at most 8 EiB")),
    "negative_size": (2, ("--max-bytes", "'-5G' is negative", "(see 'kvtier evict --help')")),
    "unknown_namespace": (2, ("unknown namespace 'ffffffff'", "kvtier ls")),
    "non_hex_namespace": (2, ("not hexadecimal",)),
    "unknown_model": (2, ("no namespace of model 'gpt-9'", "tiny-llama")),
    "unknown_key": (1, ("no record whose key starts with",)),
    "tokens_unreadable": (2, ("--tokens", "cannot read it")),
    "tokens_garbage": (2, ("--tokens", "expected token ids")),
    "tokens_out_of_range": (2, ("--tokens", "[0, 2**32)")),
    "bad_option": (2, ("unrecognized arguments: --colour", "(see 'kvtier ls --help')")),
    "empty_path": (2, ("STORE: an empty path",)),
    "evict_what": (2, ("say what to evict", "--max-bytes")),
}
# Through the console script: the list (missing path, not a store, newer format,
# unreadable file, malformed size or age, unknown namespace).
CONSOLE = {"missing_path", "not_a_store", "newer_format", "unreadable_marker", "bad_size", "bad_age",
           "unknown_namespace"}


@pytest.fixture(scope="module")
def runs(built_stores: dict[str, Built], tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[dict[str, subprocess.CompletedProcess[str]]]:
    base = tmp_path_factory.mktemp("bad")
    lmdb_store, files_store = built_stores["lmdb"].path, built_stores["files"].path
    (base / "empty").mkdir()
    (base / "a-file").write_text("x")
    (base / "newer").mkdir()
    (base / "newer" / "kvtier-store.json").write_text(json.dumps(
        {"format": "kvtier-store", "layout_version": 99, "backend": "lmdb"}))
    (base / "damaged").mkdir()
    (base / "damaged" / "kvtier-store.json").write_text("{not json")
    shutil.copytree(lmdb_store, base / "badlmdb")
    (base / "badlmdb" / "lmdb" / "data.mdb").write_bytes(os.urandom(64 * 1024))
    (base / "garbage.txt").write_text("these are not token ids\n")
    (base / "huge.json").write_text("[99999999999999999999]")
    # A store whose marker its user cannot read (as root: run as nobody, see AS_NOBODY).
    as_root = os.geteuid() == 0
    locked = Path(tempfile.mkdtemp(prefix="kvtier-cli-test-"))
    locked.chmod(0o755)
    shutil.copytree(files_store, locked / "store")
    for d in [locked / "store", *(p for p in (locked / "store").rglob("*") if p.is_dir())]:
        d.chmod(0o755)
    (locked / "store" / "kvtier-store.json").chmod(0)

    calls: dict[str, tuple[tuple[object, ...], tuple[str, ...]]] = {
        "missing_path": (("ls", base / "nope"), ()),
        "not_a_store": (("stats", base / "empty"), ()),
        "file_not_dir": (("verify", base / "a-file"), ()),
        "newer_format": (("ls", base / "newer"), ()),
        "damaged_marker": (("inspect", base / "damaged", "abcd"), ()),
        "unreadable_marker": (("ls", locked / "store"), AS_NOBODY if as_root else ()),
        "damaged_lmdb": (("ls", base / "badlmdb"), ()),
        "bad_size": (("evict", lmdb_store, "--max-bytes", "50Q"), ()),
        "bad_budget": (("stats", files_store, "--budget", "lots"), ()),
        "bad_age": (("evict", files_store, "--older-than", "7 days"), ()),
        "huge_age": (("evict", files_store, "--older-than", "9" * 400 + "d", "--dry-run"), ()),
        "huge_size": (("evict", lmdb_store, "--max-bytes", "9" * 400 + "G", "--dry-run"), ()),
        "negative_size": (("evict", lmdb_store, "--max-bytes", "-5G", "--dry-run"), ()),
        "unknown_namespace": (("evict", files_store, "--namespace", "ffffffff", "--all"), ()),
        "non_hex_namespace": (("evict", lmdb_store, "--namespace", "xyz", "--all"), ()),
        "unknown_model": (("evict", lmdb_store, "--model", "gpt-9", "--all", "--dry-run"), ()),
        "unknown_key": (("inspect", lmdb_store, "0123abcd9"), ()),
        "tokens_unreadable": (("inspect", lmdb_store, "--tokens", base, "--model", "tiny-llama"), ()),
        "tokens_garbage": (("inspect", files_store, "--tokens", base / "garbage.txt"), ()),
        "tokens_out_of_range": (("inspect", lmdb_store, "--tokens", base / "huge.json", "--model", "tiny-llama"), ()),
        "bad_option": (("ls", lmdb_store, "--colour"), ()),
        "empty_path": (("stats", ""), ()),
        "evict_what": (("evict", lmdb_store), ()),
    }
    assert set(calls) == set(CASES)
    if as_root and not shutil.which("setpriv"):
        del calls["unreadable_marker"]  # cannot make a file unreadable to root here
    try:
        with ThreadPoolExecutor(4) as pool:
            futures = {k: pool.submit(cli, *argv, prefix=prefix)
                       for k, (argv, prefix) in calls.items() if k in CONSOLE}
            done = {k: f.result() for k, f in futures.items()}
        yield {k: done.get(k, argv) for k, (argv, _) in calls.items()}
    finally:
        shutil.rmtree(locked, ignore_errors=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input(case: str, runs: dict[str, subprocess.CompletedProcess[str] | tuple[object, ...]],
                   capsys: pytest.CaptureFixture[str]) -> None:
    status, needles = CASES[case]
    if case not in runs:
        pytest.skip("running as root without setpriv: every file is readable")
    r = runs[case]
    result = run_main(capsys, *r) if isinstance(r, tuple) else r
    one_line_error(result, status, *needles)
    assert result.stdout == ""
