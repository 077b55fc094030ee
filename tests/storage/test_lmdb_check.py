"""The page check a process runs before it trusts an existing LMDB environment
(``kvtier.backends.lmdb_check``): intact stores open (checked once per process while
unchanged), damaged ones are refused with ``StoreDamaged``, and a helper that cannot run
never stops a store from opening. Damaged pages that crash readers are in
``tests/reliability/test_corruption_fuzz.py``."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from kvhelpers import make_kv, open_cache, same_bits, seq_tokens

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
