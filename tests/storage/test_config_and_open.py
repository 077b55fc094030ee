"""Configuration errors name the setting; store directories that are not ours, of another
backend or of another on-disk layout are refused with a clear message and left untouched."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kvhelpers import CHUNK, TAIL, config, make_kv, namespace, open_cache, same_bits, tokens

from kvtier import CacheConfig, ChunkStore, KVCache, Namespace, RequestExtras
from kvtier.backends import MARKER, StoreLock, stored_config
from kvtier.errors import ConfigError, StoreError, StoreFormatError

BAD_SETTINGS: list[tuple[dict[str, Any], str]] = [
    ({"backend": "rocksdb"}, "backend"),
    ({"backend": "LMDB"}, "backend"),
    ({"host_bytes": -1}, "host_bytes"),
    ({"disk_bytes": "-5G"}, "disk_bytes"),
    ({"write_queue_bytes": -4096}, "write_queue_bytes"),
    ({"disk_bytes": "12 parsecs"}, "disk_bytes"),
    ({"host_bytes": "1.5X"}, "host_bytes"),
    ({"commit_bytes": "G"}, "commit_bytes"),
    ({"max_record_bytes": True}, "max_record_bytes"),
    ({"disk_bytes": 0}, "disk_bytes"),
    ({"max_record_bytes": 100}, "max_record_bytes"),
    ({"durability": "fast"}, "durability"),
    ({"compression": "lz4"}, "compression"),
    ({"compression_level": 99}, "compression_level"),
    ({"chunk_tokens": 0}, "chunk_tokens"),
    ({"chunk_tokens": "256"}, "chunk_tokens"),
    ({"io_threads": -1}, "io_threads"),
    ({"direct_reads": "yes"}, "direct_reads"),
    ({"path": ""}, "path"),
    ({"host_bytes": 1.5}, "host_bytes"),  # (was 1 byte)
    ({"close_timeout_s": float("inf")}, "close_timeout_s"),  # (close() raised OverflowError)
]


@pytest.mark.parametrize(("settings", "name"), BAD_SETTINGS, ids=[f"{k}" for k, _ in BAD_SETTINGS])
def test_bad_setting_names_the_setting(tmp_path: Path, settings: dict[str, Any], name: str) -> None:
    values = {"path": str(tmp_path / "s"), **settings}
    with pytest.raises(ConfigError) as exc:
        CacheConfig(**values)
    assert name in str(exc.value)
    assert isinstance(exc.value, ValueError)
    with pytest.raises(ConfigError, match=name):
        CacheConfig.from_dict(values)


def test_path_that_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    with pytest.raises(ConfigError, match="path") as exc:
        CacheConfig(path=f)
    assert str(f) in str(exc.value)
    with pytest.raises(ConfigError, match="path"):
        CacheConfig.from_dict({"path": str(f)})
    with pytest.raises(ConfigError, match="which is not a directory") as exc:  # (was NotADirectoryError)
        KVCache.open(f / "cache", namespace(), config(f / "cache"))
    assert str(f) in str(exc.value)


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_a_new_store_inside_another_is_refused(tmp_path: Path, backend: str) -> None:
    """A store created in another's directory tree (say, its record directory) would have its
    files swept and evicted as the outer store's: refused, and nothing is created."""
    outer = tmp_path / "outer"
    _save_one(outer, backend)
    inner = outer / backend / "mine"
    with pytest.raises(StoreError, match="inside the kvtier store at") as exc:
        KVCache.open(inner, namespace(), config(inner, backend))
    assert str(outer) in str(exc.value) and not inner.exists()


def test_a_closed_or_read_only_cache_refuses_what_it_would_lose(tmp_path: Path) -> None:
    """A save into a closed or read-only cache used to return 0 and a flush True, with
    nothing stored; lookups after close found nothing. Each now says why."""
    path = tmp_path / "s"
    _save_one(path, "files")
    toks = tokens(0, CHUNK)
    with KVCache.open(path, namespace(), config(path, "files"), tail_granularity=TAIL, readonly=True) as ro:
        assert ro.lookup(toks) == CHUNK  # reading is what read-only is for
        with pytest.raises(StoreError, match="opened read-only"):
            ro.save(tokens(1, CHUNK), make_kv(tokens(1, CHUNK)))
    cache = open_cache(path, "files")
    before = cache.stats()
    cache.close()
    after = cache.stats()  # the counters stay readable after close (a closed index did not)
    assert (after["disk_records"], after["disk_bytes"]) == (before["disk_records"], before["disk_bytes"]) != (0, 0)
    for call in (lambda: cache.save(toks, make_kv(toks)), cache.flush, lambda: cache.lookup(toks),
                 lambda: cache.load(toks)):
        with pytest.raises(StoreError, match="this cache's store was closed"):
            call()
    with open_cache(path, "files") as cache, pytest.raises(ValueError, match="max_tokens"):
        cache.load(toks, max_tokens=-1)


def test_to_dict_round_trips_through_from_dict(tmp_path: Path) -> None:
    cfg = CacheConfig(path=tmp_path / "s", host_bytes="512M", remote="redis://h:1", remote_password="pw")
    d = cfg.to_dict()
    assert d["host_bytes"] == 512 << 20 and d["path"] == str(tmp_path / "s")
    assert CacheConfig.from_dict(d) == cfg
    assert "pw" not in repr(cfg)


def test_unknown_key_in_from_dict_names_it_and_suggests(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        CacheConfig.from_dict({"path": str(tmp_path), "backnd": "files"})
    msg = str(exc.value)
    assert "'backnd'" in msg and "'backend'" in msg
    with pytest.raises(ConfigError, match="'colour'"):
        CacheConfig.from_dict({"colour": "blue"}, where="kv_connector_extra_config")


@pytest.mark.parametrize("values", [["path"], "path=/x", None])
def test_settings_that_are_not_a_dict_say_so(values: object) -> None:
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config: expected a dict of settings, got "):
        CacheConfig.from_dict(values, where="kv_connector_extra_config")  # type: ignore[arg-type]


def test_sizes_parse(tmp_path: Path) -> None:
    c = CacheConfig.from_dict({"path": str(tmp_path), "host_bytes": "512M", "disk_bytes": "2GB",
                               "write_queue_bytes": 4096})
    assert (c.host_bytes, c.disk_bytes, c.write_queue_bytes) == (512 << 20, 2 * 10**9, 4096)


@pytest.mark.parametrize("value", [-1, "-1", "-5G", " -0.5G "])
def test_a_negative_size_is_said_to_be_negative(tmp_path: Path, value: object) -> None:
    """Whether given as a number or a string (a string with a sign read as unreadable)."""
    with pytest.raises(ConfigError, match=r"host_bytes: must not be negative, got "):
        CacheConfig(path=tmp_path, host_bytes=value)  # type: ignore[arg-type]


def test_a_built_config_refuses_changes_and_says_how_to_make_a_changed_copy(tmp_path: Path) -> None:
    """Assigning to a config used to be accepted unchecked: ``disk_bytes = "abc"`` failed later
    in arithmetic far from the mistake, and a store opened with the config applied a change
    partly (settings it reads later, such as compression) or not at all (its budget, recorded
    when it opened). A built config is read-only; the error names the setting and the way."""
    cfg = config(tmp_path / "s", "files", disk_bytes="3M", remote_password="old-secret")
    for name, value in [("disk_bytes", "abc"), ("chunk_tokens", 0), ("disk_bytes", "6M"),
                        ("compression", "zstd"), ("path", tmp_path / "t"), ("remote_password", "new-secret")]:
        with pytest.raises(ConfigError, match=rf"^{name}: a CacheConfig cannot be changed once built") as exc:
            setattr(cfg, name, value)
        assert f"config.replaced({name}=...)" in str(exc.value) and "secret" not in str(exc.value)
    with pytest.raises(ConfigError, match="disk_bytes: a CacheConfig cannot be changed"):
        del cfg.disk_bytes
    with pytest.raises(ConfigError, match=r"^disk_byte: not a CacheConfig setting \(did you mean 'disk_bytes'\?\)"):
        cfg.disk_byte = 1  # type: ignore[attr-defined]
    assert (cfg.path, cfg.disk_bytes, cfg.chunk_tokens, cfg.compression) == (tmp_path / "s", 3 << 20, CHUNK, "none")
    # the ways to a changed config; what they make is just as read-only
    changed = cfg.replaced(disk_bytes="6M")
    assert changed.disk_bytes == 6 << 20 and changed.chosen == cfg.chosen and cfg.disk_bytes == 3 << 20
    assert dataclasses.replace(cfg, compression="zstd").compression == "zstd"
    for other in (changed, dataclasses.replace(cfg), copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert other.disk_bytes in (3 << 20, 6 << 20)
        with pytest.raises(ConfigError, match="host_bytes: a CacheConfig cannot be changed"):
            other.host_bytes = 1
    # nor can the config a store holds be changed under it
    with ChunkStore(cfg) as store, pytest.raises(ConfigError, match="compression"):
        store.config.compression = "zstd"


def test_namespace_and_cache_mismatches_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_shape"):
        namespace(kv_shape=(2, 3, 4, 32))
    with pytest.raises(ValueError, match="tp_rank"):
        namespace(tp_rank=2, tp_size=2)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        KVCache.open(tmp_path / "a", namespace(), config(tmp_path / "a", chunk_tokens=64))
    with pytest.raises(ConfigError, match="tail_granularity"):
        open_cache(tmp_path / "b", tail=5)
    with pytest.raises(ConfigError, match="dtype"):
        KVCache.open(tmp_path / "c", namespace(dtype="bf16"))
    with pytest.raises(ConfigError, match="'float' is an alias; give its name, 'float32'"):
        KVCache.open(tmp_path / "c", namespace(dtype="float"))
    with pytest.raises(ConfigError, match="does not store 'complex64'"):  # (every save dropped, before)
        KVCache.open(tmp_path / "c", namespace(dtype="complex64"))
    with pytest.raises(ConfigError, match="max_record_bytes.*smaller than one chunk"):
        KVCache.open(tmp_path / "d", namespace(), config(tmp_path / "d", max_record_bytes="4K"))
    with pytest.raises(ConfigError, match="write_queue_bytes.*smaller than one chunk"):  # (all dropped)
        KVCache.open(tmp_path / "d", namespace(), config(tmp_path / "d", write_queue_bytes="4K"))
    # records are written in the format's one layout and version whatever the namespace says
    # (both were taken, and KV stored under a label it does not have)
    with pytest.raises(ConfigError, match="layout: records are stored as 'LKTHD'.*got 'LKTDH'"):
        KVCache.open(tmp_path / "e", namespace(layout="LKTDH"))
    with pytest.raises(ConfigError, match="format_version: this kvtier writes and reads format 1.* says 2"):
        KVCache.open(tmp_path / "e", namespace(format_version=2))
    assert not any((tmp_path / n).exists() for n in "abcde")  # refused before anything was created


@pytest.mark.parametrize(("ids", "message"), [
    ([0.5] * CHUNK, "must be integers"),  # (else keyed as token 0: another prompt's KV)
    ([2**32] * CHUNK, r"in \[0, 2\*\*32\)"),
    ([10**20] * CHUNK, r"in \[0, 2\*\*32\)"),
    ([-1] * CHUNK, r"in \[0, 2\*\*32\)"),
    (np.array([Decimal("0.5")] * CHUNK, dtype=object), "got Decimal values"),  # (keyed as 0 before)
    (np.ones(CHUNK, dtype=bool), "got bool values"),
    ((t for t in range(CHUNK)), "a one-dimensional sequence of integers .* got generator"),
])
def test_token_ids_that_are_not_uint32_are_refused(tmp_path: Path, ids: list, message: str) -> None:
    with open_cache(tmp_path / "s") as cache:
        with pytest.raises(ValueError, match=message):
            cache.save(ids, make_kv(list(range(CHUNK))))
        with pytest.raises(ValueError, match=message):
            cache.lookup(ids)
    with open_cache(tmp_path / "s") as cache, pytest.raises(ValueError, match="one-dimensional"):
        cache.lookup(np.zeros((2, CHUNK), dtype="<u4"))


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_a_refused_open_leaves_the_stores_settings_alone(tmp_path: Path, backend: str) -> None:
    """A bad argument must not change what every server of the store reads: the budget a
    refused open was given would otherwise make the next writer evict nearly everything."""
    path = tmp_path / "s"
    _save_one(path, backend)
    before = stored_config(path, backend)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        KVCache.open(path, namespace(), config(path, backend, chunk_tokens=2 * CHUNK, disk_bytes="1M"))
    after = stored_config(path, backend)
    assert (after.disk_bytes, after.chunk_tokens) == (before.disk_bytes, before.chunk_tokens)


def test_a_chunk_over_max_record_bytes_is_dropped_not_stored(tmp_path: Path) -> None:
    """A record no process with the store's limit could load is not written."""
    with ChunkStore(config(tmp_path / "s", max_record_bytes="4K")) as store:
        assert not store.put(b"k" * 32, torch.zeros(4097, dtype=torch.uint8), namespace_id=b"n" * 16,
                             token_start=0, num_tokens=1)
        assert store.put(b"j" * 32, torch.zeros(4096, dtype=torch.uint8), namespace_id=b"n" * 16,
                         token_start=0, num_tokens=1)
        assert store.flush(30)
        assert store.counters.snapshot()["dropped_saves"] == 1
        assert store.backend.present_each([b"k" * 32, b"j" * 32]) == [False, True]


def _save_one(path: Path, backend: str) -> None:
    with open_cache(path, backend) as cache:
        toks = tokens(0, CHUNK)
        cache.save(toks, make_kv(toks))


def _assert_not_locked(path: Path) -> None:
    """A failed open must not leave this process holding the store's lock."""
    lock = StoreLock(path, exclusive=True)
    lock.release()


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_non_empty_foreign_directory_is_refused_and_left_untouched(tmp_path: Path, backend: str) -> None:
    d = tmp_path / "photos"
    d.mkdir()
    (d / "holiday.jpg").write_bytes(b"\xff\xd8")
    before = sorted(p.name for p in d.iterdir())
    with pytest.raises(StoreError, match="not a kvtier store|not empty"):
        ChunkStore(config(d, backend))
    with pytest.raises(StoreError):
        KVCache.open(d, namespace(), config(d, backend))
    assert sorted(p.name for p in d.iterdir()) == before, "opening a foreign directory wrote into it"


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_empty_directory_becomes_a_store(tmp_path: Path, backend: str) -> None:
    d = tmp_path / "empty"
    d.mkdir()
    _save_one(d, backend)
    info = json.loads((d / MARKER).read_text())
    assert info["backend"] == backend and info["format"] == "kvtier-store"


@pytest.mark.parametrize("backend", ["lmdb", "files"])
@pytest.mark.parametrize("version", [3, 99])
def test_newer_layout_version_is_refused_clearly(tmp_path: Path, backend: str, version: int) -> None:
    d = tmp_path / "s"
    _save_one(d, backend)
    info = json.loads((d / MARKER).read_text())
    info["layout_version"] = version
    (d / MARKER).write_text(json.dumps(info))
    with pytest.raises(StoreFormatError) as exc:
        ChunkStore(config(d, backend))
    msg = str(exc.value)
    assert f"layout version {version}" in msg and "newer kvtier" in msg and "upgrade" in msg
    with pytest.raises(StoreFormatError):
        ChunkStore(config(d, backend), readonly=True)
    _assert_not_locked(d)
    assert json.loads((d / MARKER).read_text())["layout_version"] == version


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_older_layout_version_and_damaged_marker(tmp_path: Path, backend: str) -> None:
    d = tmp_path / "s"
    _save_one(d, backend)
    good = (d / MARKER).read_text()
    info = json.loads(good)
    info["layout_version"] = 0
    (d / MARKER).write_text(json.dumps(info))
    with pytest.raises(StoreFormatError, match="older"):
        ChunkStore(config(d, backend))
    for damaged in ("{", "[]", json.dumps({"format": "something-else"})):
        (d / MARKER).write_text(damaged)
        with pytest.raises(StoreError):
            ChunkStore(config(d, backend))
    for version in ("2", 2.0, None):  # damaged, not "written by a newer kvtier"
        (d / MARKER).write_text(json.dumps({**json.loads(good), "layout_version": version}))
        with pytest.raises(StoreError, match="no valid layout_version.*damaged; restore it from a backup, "
                                             "or move the directory away") as exc:
            ChunkStore(config(d, backend))
        assert not isinstance(exc.value, StoreFormatError)
    (d / MARKER).write_text(json.dumps({**json.loads(good), "backend": "tape"}))
    with pytest.raises(StoreError, match=r"unknown backend 'tape' in kvtier-store.json \(a newer kvtier's\?\); "
                                         "upgrade kvtier, or move the directory away"):
        ChunkStore(config(d, backend))
    other = "files" if backend == "lmdb" else "lmdb"  # a marker that names the other backend
    (d / MARKER).write_text(json.dumps({**json.loads(good), "backend": other}))
    with pytest.raises(StoreError, match=f"says backend '{other}', but the store holds '{backend}'"):
        ChunkStore(config(d, other))
    _assert_not_locked(d)
    (d / MARKER).write_text(good)
    with open_cache(d, backend) as cache:  # nothing was changed or removed
        assert cache.lookup(tokens(0, CHUNK)) == CHUNK


@pytest.mark.parametrize(("created", "opened"), [("lmdb", "files"), ("files", "lmdb")])
def test_store_of_another_backend_is_refused(tmp_path: Path, created: str, opened: str) -> None:
    d = tmp_path / "s"
    _save_one(d, created)
    with pytest.raises(StoreError) as exc:
        ChunkStore(config(d, opened))
    msg = str(exc.value)
    assert repr(created) in msg and repr(opened) in msg and "backend" in msg
    _assert_not_locked(d)
    # the store is intact and opens with its own backend
    with open_cache(d, created) as cache:
        assert cache.lookup(tokens(0, CHUNK)) == CHUNK


@pytest.mark.parametrize("created", ["lmdb", "files"])
def test_a_config_that_names_no_backend_follows_the_stores(tmp_path: Path, created: str) -> None:
    """A server or tool opened with only a path works on a store of either backend (a new
    store gets the default, files); only a backend named explicitly can conflict."""
    from kvtier.vllm.settings import ConnectorSettings

    assert CacheConfig(path=tmp_path / "new").backend == "files"
    older = CacheConfig(path=tmp_path / "new")
    del older.__dict__["_chosen"]  # as unpickled from a kvtier that did not record it
    assert "backend" in older.chosen  # every setting counts as given, as it then did
    d = tmp_path / "s"
    _save_one(d, created)
    settings = ConnectorSettings.from_extra_config({"path": str(d), "chunk_tokens": CHUNK})
    assert settings.cache.backend == created and "backend" not in settings.cache.chosen
    with KVCache.open(d, namespace(), settings.cache) as cache:
        assert cache.lookup(tokens(0, CHUNK)) == CHUNK
        assert cache.store.backend.payloads.name == created
    # the path given to KVCache.open wins over the config's, and so does its store's backend
    elsewhere = CacheConfig(path=tmp_path / "elsewhere", chunk_tokens=CHUNK)
    with KVCache.open(d, namespace(), elsewhere) as cache:
        assert cache.store.backend.payloads.name == created
    # a config made before its store existed follows the store another process created
    later = tmp_path / "later"
    early = CacheConfig(path=later, chunk_tokens=CHUNK)
    _save_one(later, created)
    with ChunkStore(early) as store:
        assert store.backend.payloads.name == created == early.backend


def test_readonly_open_of_missing_store(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no such directory"):
        ChunkStore(config(tmp_path / "nope"), readonly=True)
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_one_process_opening_a_store_two_incompatible_ways_is_told_what_to_change(
        tmp_path: Path, backend: str) -> None:
    """LMDB shares one environment per file and process, opened the first user's way: a
    writer after a read-only user, or durability "power" after "process", would not get
    what it asked for (writes refused and called damage; commits not synced): refused, with
    what to change. The other orders share the environment."""
    from kvtier.errors import StoreDamaged

    path = tmp_path / "s"
    with ChunkStore(config(path, backend)):
        pass
    with ChunkStore(config(path, backend), readonly=True), \
            pytest.raises(StoreError, match="read-only first") as exc:
        ChunkStore(config(path, backend))
    assert not isinstance(exc.value, StoreDamaged)
    with ChunkStore(config(path, backend, durability="process")), \
            pytest.raises(StoreError, match="durability 'process' first"):
        ChunkStore(config(path, backend, durability="power"))
    with ChunkStore(config(path, backend, durability="power")), \
            ChunkStore(config(path, backend, durability="process")), \
            ChunkStore(config(path, backend), readonly=True):
        pass


_CREATOR = """
import json, sys, time
from kvhelpers import CHUNK, open_cache, make_kv, tokens
from kvtier.errors import StoreError
backend, start, paths = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
for i, path in enumerate(paths):
    while time.time() < start + 0.25 * i:  # both processes open each new store at once
        pass
    try:
        with open_cache(path, backend) as cache:
            toks = tokens(i, CHUNK)
            cache.save(toks, make_kv(toks), wait=10)
        print(json.dumps([path, "opened"]), flush=True)
    except StoreError as exc:
        print(json.dumps([path, str(exc)]), flush=True)
"""


def test_two_processes_creating_one_store_with_different_backends_end_with_one_store(tmp_path: Path) -> None:
    """Of two processes creating a new store at the same instant, one with each backend, one
    creates it and the other is refused; the store is never a mix of both, with a marker
    that names the loser (before: 11 of 20 such races broke the store)."""
    import os
    import subprocess
    import sys
    import time

    paths = [str(tmp_path / f"s{i}") for i in range(8)]
    start = time.time() + 8  # after both have imported torch
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    procs = [subprocess.Popen([sys.executable, "-c", _CREATOR, backend, str(start), *paths], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for backend in ("lmdb", "files")]
    outcomes: dict[str, dict[str, str]] = {}
    for backend, p in zip(("lmdb", "files"), procs, strict=True):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        outcomes[backend] = dict(json.loads(line) for line in out.splitlines())
    for path in paths:
        winner = json.loads((Path(path) / MARKER).read_text())["backend"]
        loser = "files" if winner == "lmdb" else "lmdb"
        assert outcomes[winner][path] == "opened", (path, outcomes)
        assert "created with backend" in outcomes[loser][path], (path, outcomes)
        assert not (Path(path) / loser).exists(), f"{path}: the refused backend left its records"
        with open_cache(path, winner) as cache:  # whole and usable
            assert cache.lookup(tokens(paths.index(path), CHUNK)) == CHUNK


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_a_relative_path_holds_after_the_process_changes_directory(tmp_path: Path, backend: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The files backend opened paths under a relative store path after an os.chdir: saves
    failed, and a load took the missing file for one removed by hand and dropped a good entry."""
    monkeypatch.chdir(tmp_path)
    toks, later = tokens(1, 2 * CHUNK), tokens(2, 2 * CHUNK)
    with open_cache("rel", backend) as cache:
        cache.save(toks, make_kv(toks))
        assert cache.flush(30)
        (tmp_path / "elsewhere").mkdir()
        monkeypatch.chdir(tmp_path / "elsewhere")
        cache.save(later, make_kv(later))
        assert cache.flush(30)
        assert same_bits(cache.load(toks), make_kv(toks)) and same_bits(cache.load(later), make_kv(later))
        stats = cache.stats()
        assert stats["io_errors"] == 0 and stats["missing_payloads"] == 0
    assert cache.store.config.path == tmp_path / "rel"


def test_paths_that_cannot_be_a_store_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="NUL"):
        CacheConfig(path=Path("/tmp/a\0b"))
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="symbolic link to nothing"):
        CacheConfig(path=tmp_path / "dangling")


_NS = {"model": "m", "weights_fingerprint": "sha256:0123", "dtype": "bfloat16", "kv_shape": (2, 2, 4, 32),
       "chunk_tokens": CHUNK}


@pytest.mark.parametrize(("change", "error", "message"), [
    ({"model": None}, TypeError, "model must be a non-empty string, got None"),
    ({"weights_fingerprint": ""}, TypeError, "never keyed by a model's name alone"),
    ({"chunk_tokens": str(CHUNK)}, TypeError, f"chunk_tokens must be an integer, got '{CHUNK}'"),
    ({"chunk_tokens": 0}, ValueError, "chunk_tokens must be 1 or more"),
    ({"tp_size": True}, TypeError, "tp_size must be an integer"),
    ({"kv_shape": (2.5, 2, 4, 32)}, ValueError, r"kv_shape must be \(layers, 2, kv_heads, head_dim\), integers"),
    ({"kv_shape": (2, 3, 4, 32)}, ValueError, "kv_shape must be"),
    ({"extra": (("lora_rank", 8),)}, TypeError, "extra must be \\(name, value\\) pairs of strings"),
    ({"extra": (("a", "1"), ("a", "2"))}, ValueError, "extra names a setting twice"),
    ({"tp_rank": 2, "tp_size": 2}, ValueError, "tp_rank 2 must be in"),
])
def test_a_namespace_refuses_what_would_key_kv_wrongly(change: dict[str, Any], error: type, message: str) -> None:
    """A namespace is checked when built: a chunk size of "256" keyed KV under a namespace
    no server could name (and failed later with "namespace says 256, store config says
    256"), an empty fingerprint keyed KV by the model's name alone, a kv_shape of 2.5 was
    truncated to 2."""
    with pytest.raises(error, match=message):
        Namespace(**{**_NS, **change})


def test_a_namespace_takes_what_users_have_at_hand_with_the_same_keys() -> None:
    """A torch dtype, numpy integers, a list or an array for the shape and a dict for
    ``extra`` name the same namespace as the canonical values (the same keys, so stores stay
    shared)."""
    canonical = Namespace(**{**_NS, "extra": (("a", "1"), ("b", "2"))})
    for change in ({"dtype": torch.bfloat16}, {"chunk_tokens": np.int64(CHUNK)},
                   {"kv_shape": [2, 2, 4, 32]}, {"kv_shape": np.array([2, 2, 4, 32])}):
        ns = Namespace(**{**_NS, "extra": {"b": "2", "a": "1"}, **change})
        assert ns.id == canonical.id and ns == canonical


@pytest.mark.parametrize(("extras", "message"), [
    ({"cache_salt": 5}, "cache_salt must be a string or None, got 5"),
    ({"lora": 1}, "lora must be a string or None"),
    ({"mm_hashes": ["abc"]}, "mm_hashes must be \\(content hash, token offset\\) pairs"),
    ({"mm_hashes": [("h", -1)]}, "an integer of 0 or more"),
])
def test_request_extras_refuse_what_would_key_kv_wrongly(extras: dict[str, Any], message: str) -> None:
    """A salt of 5 keyed apart from "5"; mm_hashes=["abc"] keyed as three one-letter hashes."""
    with pytest.raises(TypeError, match=message):
        RequestExtras(**extras)
    assert RequestExtras(mm_hashes=[["h", np.int64(3)]]) == RequestExtras(mm_hashes=(("h", 3),))


def test_misused_arguments_say_what_to_give(tmp_path: Path) -> None:
    toks = tokens(1, CHUNK)
    with open_cache(tmp_path / "s") as cache:
        with pytest.raises(TypeError, match="expected kvtier.RequestExtras"):
            cache.lookup(toks, {"cache_salt": "a"})  # type: ignore[arg-type]
        for bad in ("40", 2.5, True, -1):
            with pytest.raises(ValueError, match="max_tokens must be an integer, 0 or more"):
                cache.load(toks, max_tokens=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="meta device"):
            cache.save(toks, make_kv(toks).to("meta"))
        with pytest.raises(TypeError, match=r"kv must be a torch.Tensor, got ndarray \(torch.from_numpy"):
            cache.save(toks, make_kv(toks).float().numpy())  # (with a float32 namespace: "float32 differs from float32")
        for call in (lambda: cache.save(toks, make_kv(toks), wait="5"), lambda: cache.flush(float("nan"))):
            with pytest.raises(ValueError, match="must be a number of seconds, got"):
                call()
        # a time already past (flush(deadline - now)) waits not at all; numpy's numbers are numbers
        assert cache.flush(-1.0) in (True, False) and cache.flush(np.float32(5)) is True
    with pytest.raises(ConfigError, match="setting names are strings, got 5"):
        CacheConfig.from_dict({5: 1})  # type: ignore[dict-item]
    # the constructors' arguments, given as what a user might have at hand (a path, a dict, a
    # model name): a TypeError that says what to give, not an AttributeError from deep inside
    store, ns = tmp_path / "t", namespace()
    with pytest.raises(TypeError, match=r"ChunkStore\(config\): expected a kvtier.CacheConfig, got str"):
        ChunkStore(str(store))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got dict \(CacheConfig\(path=...\), or CacheConfig.from_dict"):
        ChunkStore({"path": str(store)})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"store must be an open kvtier.ChunkStore, got CacheConfig; .*KVCache.open"):
        KVCache(CacheConfig(path=store), ns)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"KVCache.open\(path, namespace, config\): namespace must be a kvtier.Namespace"):
        KVCache.open(store, "llama")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"config must be a kvtier.CacheConfig, got dict"):
        KVCache.open(store, ns, {"chunk_tokens": CHUNK})  # type: ignore[arg-type]
    assert not store.exists()  # nothing was created on the way
    with ChunkStore(CacheConfig(path=store, chunk_tokens=CHUNK)) as opened:
        with pytest.raises(TypeError, match=r"KVCache\(store, namespace\): namespace must be a kvtier.Namespace"):
            KVCache(opened, "llama")  # type: ignore[arg-type]
        # ChunkStore's own calls: a key of the wrong kind was queued and kept in the host tier
        # (a load of it hit there), then failed in the writer thread, logged far from the call
        kv, ns_id = make_kv(tokens(2, CHUNK)), namespace().id
        for kwargs, message in (({"key": "abc"}, "put: key must be 32 bytes, got str"),
                                ({"key": b"abc"}, "put: key must be 32 bytes, got 3 bytes"),
                                ({"namespace_id": "x"}, "put: namespace_id must be 16 bytes, got str"),
                                ({"parent": b"p"}, "put: parent must be 32 bytes, got 1 bytes"),
                                ({"tensor": [1, 2]}, "put: tensor must be a torch.Tensor, got list")):
            with pytest.raises(TypeError, match=message):
                opened.put(**{"key": b"k" * 32, "tensor": kv, "namespace_id": ns_id, "token_start": 0,
                              "num_tokens": CHUNK, **kwargs})
        with pytest.raises(TypeError, match="load: key must be 32 bytes, got str"):
            opened.load("abc")  # type: ignore[arg-type]
        # lookups and batch loads: a wrong key was an "I/O error" and a miss (one key where a
        # list goes was read as its bytes, one by one)
        key = b"k" * 32
        for call, message in (
                (lambda: opened.count_present_prefix(key), r"count_present_prefix: keys must be a list of 32-byte keys, "
                                                           r"got 32 bytes \(put one key in a list\)"),
                (lambda: opened.present_each(["abc"]), "present_each: each key must be 32 bytes, got str"),
                (lambda: opened.count_present_chain(key, [(0, key[:16])]),
                 "count_present_chain: each key must be 32 bytes, got 16 bytes"),
                (lambda: opened.count_present_chain("head", [(0, key)]), "count_present_chain: each key must be 32 bytes, got str"),
                (lambda: next(opened.load_many({key})), "load_many: keys must be a list of 32-byte keys, got set"),
                (lambda: opened.load_into([1], [kv]), "load_into: each key must be 32 bytes, got int"),
                (lambda: opened.get_async(key.hex()), "get_async: keys must be a list of 32-byte keys, got str"),
                (lambda: opened.prefetch([None]), "prefetch: each key must be 32 bytes, got NoneType")):
            with pytest.raises(TypeError, match=message):
                call()
        assert opened.present_each([key]) == [False] and opened.count_present_prefix([key]) == 0
        assert opened.stats()["io_errors"] == 0
        assert opened.stats()["saves_queued"] == 0 and opened.stats()["host_chunks"] == 0
