"""Corruption fuzzing of every on-disk structure: record payloads and headers, index entries,
the store marker and settings, and the LMDB pages of the index and of an ``lmdb`` store.

Every damaged record must be a miss (a shorter, correct prefix through the library, as in
vLLM a recompute): never wrong KV, never an exception into the caller. Damage to LMDB's own
pages is probed in a separate process, since LMDB does not checksum its pages."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest
import torch
from kvhelpers import (  # noqa: I001
    KV_SHAPE,
    Zygote,
    craft,
    free_list_pages,
    header_fields,
    lmdb_leaf_nodes,
    make_kv,
    open_cache,
    same_bits,
    seq_tokens,
)
from relhelpers import fuzz_seed, kvtier_cli, record, scale

from kvtier import codec
from kvtier.backends import MARKER as MARKER_NAME
from kvtier.backends.index import StoreIndex
from kvtier.errors import StoreDamaged

SEQS = list(range(12))


def _fill(store: Path, backend: str) -> None:
    with open_cache(store, backend) as cache:
        for i in SEQS:
            toks = seq_tokens(i)
            cache.save(toks, make_kv(toks))
        assert cache.flush(60)


def _entries(store: Path) -> dict[bytes, tuple[int, int, int]]:
    """key -> (location, token_start, tokens), from the store's index."""
    index = StoreIndex(store, readonly=True)
    try:
        return {e.key: (e.location, e.token_start, e.num_tokens) for e in index.entries()}
    finally:
        index.close()


# -- raw access to a record (the store closed) -----------------------------------------------
def _raw_get(store: Path, backend: str, key: bytes, loc: int) -> bytes:
    if backend == "files":
        h = key.hex()
        return (store / "files" / h[:2] / h[2:4] / f"{h}.{loc:016x}.kvt").read_bytes()
    env = lmdb.open(str(store / "lmdb"), max_dbs=8, subdir=True, map_size=1 << 30)
    try:
        with env.begin() as txn:
            return bytes(txn.get(loc.to_bytes(8, "big") + key, db=env.open_db(b"records", txn=txn)))
    finally:
        env.close()


def _raw_put(store: Path, backend: str, key: bytes, loc: int, data: bytes) -> None:
    if backend == "files":
        h = key.hex()
        (store / "files" / h[:2] / h[2:4] / f"{h}.{loc:016x}.kvt").write_bytes(data)
        return
    env = lmdb.open(str(store / "lmdb"), max_dbs=8, subdir=True, map_size=1 << 30)
    try:
        with env.begin(write=True) as txn:
            txn.put(loc.to_bytes(8, "big") + key, data, db=env.open_db(b"records", txn=txn))
    finally:
        env.close()


def _flip(rec: bytes, rng: random.Random) -> bytes:
    b = bytearray(rec)
    b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def _zero_page(rec: bytes, rng: random.Random) -> bytes:
    b = bytearray(rec)
    start = rng.randrange(0, max(1, len(b) // 4096)) * 4096
    b[start : start + 4096] = bytes(len(b[start : start + 4096]))
    return bytes(b)


def _crafted(rec: bytes, rng: random.Random) -> bytes:
    f = header_fields(rec)
    dims = list(struct.unpack_from(f"<{f['ndim']}Q", rec, 116))
    choice = rng.choice(["shape", "dtype", "key", "payload_len", "raw_len", "codec", "format_version",
                         "header_len"])
    if choice == "shape":  # the same number of elements, another shape
        rng.shuffle(dims)
        if dims == list(struct.unpack_from(f"<{f['ndim']}Q", rec, 116)):
            dims = [dims[0] * 2, dims[1] // 2 or 1, *dims[2:]]
        return craft(rec, shape=tuple(dims))
    if choice == "dtype":
        return craft(rec, dtype=f["dtype"] ^ 1)
    if choice == "key":
        return craft(rec, key=os.urandom(32))
    if choice == "codec":
        return craft(rec, codec=f["codec"] ^ 1)
    if choice == "format_version":
        return craft(rec, format_version=f["format_version"] + 1)
    if choice == "header_len":
        return craft(rec, header_len=rng.choice([0, 9, 65535]))
    return craft(rec, **{choice: f[choice] + rng.choice([-8, -1, 1, 8, 1 << 40])})


def _purge_kept_damage(store: Path, backend: str) -> None:
    """Remove what earlier rounds left damaged but kept by design (another format version,
    a valid record of another dtype or shape): a mutation of such a record could restore the
    original, and the fill could not heal it."""
    if not (store / MARKER_NAME).exists():
        return
    with open_cache(store, backend) as cache:
        b = cache.store.backend
        bad = [e.key for e in b.entries()
               if not b.read(e.key, lambda v, n=e.num_tokens: _intact(bytes(v), n))]
        b.delete(bad)


def _intact(rec: bytes, ntok: int) -> bool:
    """Whether a stored record is what the fill wrote: a valid record of this chunk's shape
    and dtype."""
    try:
        _, t = codec.decode(rec)
    except Exception:
        return False
    return tuple(t.shape) == (*KV_SHAPE[:2], ntok, *KV_SHAPE[2:]) and t.dtype == torch.bfloat16


MUTATIONS: dict[str, Callable[[bytes, bytes, random.Random], bytes]] = {
    # name -> fn(record, another record, rng) -> damaged record
    "bit flip": lambda r, _, rng: _flip(r, rng),
    "truncation": lambda r, _, rng: r[: rng.randrange(len(r))],
    "zeroed page": lambda r, _, rng: _zero_page(r, rng),
    "swapped record": lambda _, other, rng: other,
    "crafted header": lambda r, _, rng: _crafted(r, rng),
}


def _check_all(store: Path, backend: str) -> tuple[int, dict[int, int]]:
    """Load every sequence; return (wrong loads, sequence -> tokens served)."""
    wrong, served = 0, {}
    with open_cache(store, backend) as cache:
        for i in SEQS:
            toks = seq_tokens(i)
            got = cache.load(toks)  # never raises for damage
            served[i] = got.shape[2]
            if not same_bits(got, make_kv(toks[: got.shape[2]])):
                wrong += 1
    return wrong, served


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_damaged_records_are_never_served(tmp_path: Path, backend: str) -> None:
    store = tmp_path / "s"
    seed = fuzz_seed()
    rng = random.Random(seed)
    rounds = scale(30, 500)
    tried = detected = missed = 0
    by_kind: dict[str, int] = {}
    misses: list[str] = []
    for n in range(rounds):
        _purge_kept_damage(store, backend)
        _fill(store, backend)  # re-saves (heals) what an earlier round's detection removed
        entries = _entries(store)
        key = rng.choice(sorted(entries))
        other = rng.choice(sorted(k for k in entries if k != key))
        loc, start, ntok = entries[key]
        kind = rng.choice(sorted(MUTATIONS))
        rec = _raw_get(store, backend, key, loc)
        bad = MUTATIONS[kind](rec, _raw_get(store, backend, other, entries[other][0]), rng)
        if bad == rec:
            continue
        _raw_put(store, backend, key, loc, bad)
        tried += 1
        by_kind[kind] = by_kind.get(kind, 0) + 1
        wrong, served = _check_all(store, backend)
        assert wrong == 0, f"round {n} ({kind}, seed {seed}): wrong KV served"
        # the damaged chunk was not served: no sequence's loaded prefix reaches into it
        # through this key (its chain is the only one that names it)
        with open_cache(store, backend) as cache:
            got = cache.store.load(key)
            ok_shape = got.tensor is not None and got.tensor.shape[2] == ntok
            served_it = got.tensor is not None and ok_shape and any(
                served[i] >= start + ntok and any(c.key == key for c in cache.chunks(seq_tokens(i)))
                for i in SEQS)
        if served_it:
            missed += 1
            misses.append(f"round {n}: {kind} on {key.hex()[:12]} ({got.outcome.value}, seed {seed})")
        else:
            detected += 1
    record(f"fuzz/records/{backend}", mutations=tried, detected=detected, missed=missed,
           **{f"kind {k}": v for k, v in sorted(by_kind.items())})
    assert missed == 0, misses


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_damaged_index_entries_never_serve_wrong_kv(tmp_path: Path, backend: str) -> None:
    """Bit flips and truncations in the index's own rows (entries, chain places, LRU order):
    lookups may promise less or more, loads only ever serve correct KV, nothing raises, and
    the store keeps taking saves."""
    store = tmp_path / "s"
    seed = fuzz_seed()
    rng = random.Random(seed)
    rounds = scale(30, 300)
    tried = 0
    for n in range(rounds):
        _fill(store, backend)
        env = lmdb.open(str(store / "index"), max_dbs=8, subdir=True, map_size=64 << 30)
        try:
            with env.begin(write=True) as txn:
                db_name = rng.choice([b"entries", b"entries", b"chains", b"lru"])
                db = env.open_db(db_name, txn=txn)
                rows = [(bytes(k), bytes(v)) for k, v in txn.cursor(db=db)]
                if db_name == b"entries":
                    rows = [(k, v) for k, v in rows if v]  # (an earlier round may have emptied one)
                k, v = rows[rng.randrange(len(rows))]
                if db_name == b"entries":
                    new = _flip(v, rng) if rng.random() < 0.7 else v[: rng.randrange(len(v))]
                    txn.put(k, new, db=db)
                else:  # a row whose key is damaged: the old place gone, a wrong one there
                    txn.delete(k, db=db)
                    txn.put(_flip(k, rng), v, db=db)
        finally:
            env.close()
        tried += 1
        wrong, _ = _check_all(store, backend)
        assert wrong == 0, f"round {n} ({db_name!r}, seed {seed})"
    with open_cache(store, backend, disk_bytes="400K") as cache:  # saves and evictions still work
        for i in range(100, 140):
            toks = seq_tokens(i)
            cache.save(toks, make_kv(toks))
        assert cache.flush(60)
        st = cache.stats()
        assert st["saves_committed"] > 0 and st["evicted_disk"] > 0, st
    record(f"fuzz/index/{backend}", mutations=tried, wrong_kv_served=0, exceptions=0)


@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_index_rows_with_keys_of_the_wrong_length_are_passed_over(tmp_path: Path, backend: str) -> None:
    """A damaged order row whose key is cut short (LMDB refuses an empty key outright) and
    damaged relatives of the wrong length: eviction drops or skips them, saves keep landing."""
    store = tmp_path / "s"
    _fill(store, backend)
    env = lmdb.open(str(store / "index"), max_dbs=8, subdir=True, map_size=64 << 30)
    try:
        with env.begin(write=True) as txn:
            lru = env.open_db(b"lru", txn=txn)
            for short in (b"\0" * 8, b"\0" * 3):
                txn.put(short, b"", db=lru)
            first = bytes(next(iter(txn.cursor(db=env.open_db(b"entries", txn=txn)).iternext(values=False))))
            for name in (b"children", b"groups"):
                txn.put(first, b"\1", db=env.open_db(name, txn=txn, dupsort=True))
    finally:
        env.close()
    with open_cache(store, backend, disk_bytes="400K") as cache:
        for i in range(100, 140):
            toks = seq_tokens(i)
            cache.save(toks, make_kv(toks))
        assert cache.flush(60)
        st = cache.stats()
        assert st["dropped_saves"] == 0 and st["io_errors"] == 0, st
        assert st["saves_committed"] > 0 and st["evicted_disk"] > 0, st
    wrong, _ = _check_all(store, backend)
    assert wrong == 0


def test_damaged_marker_and_settings(tmp_path: Path) -> None:
    """A damaged marker is refused with a clear message (no traceback); damaged or absurd
    stored settings are ignored with a warning, and the store keeps working."""
    store = tmp_path / "s"
    _fill(store, "files")
    good = (store / MARKER_NAME).read_text()
    tried = 0
    for bad in ["", "{", "[]", '{"format": "kvtier-store"}', good.replace("files", "tape"),
                good.replace('"layout_version": 2', '"layout_version": "2"')]:
        (store / MARKER_NAME).write_text(bad)
        r = kvtier_cli("ls", str(store))
        assert r.returncode == 1 and "Traceback" not in r.stderr and r.stderr.startswith("kvtier: error:"), r
        tried += 1
    (store / MARKER_NAME).write_text(good)
    for settings in [b"not json", b"[1, 2]", json.dumps({"disk_bytes": -5, "max_record_bytes": "huge",
                                                          "chunk_tokens": 0}).encode()]:
        env = lmdb.open(str(store / "index"), max_dbs=8, subdir=True, map_size=64 << 30)
        with env.begin(write=True) as txn:
            txn.put(b"settings", settings, db=env.open_db(b"info", txn=txn))
        env.close()
        r = kvtier_cli("verify", str(store))
        assert r.returncode == 0 and "Traceback" not in r.stderr, r
        assert _check_all(store, "files")[0] == 0
        tried += 1
    record("fuzz/marker_and_settings", mutations=tried, refused_clearly_or_ignored=tried)


@pytest.mark.parametrize("where", ["any page", "free list"])
@pytest.mark.parametrize("backend", ["lmdb", "files"])
def test_damaged_lmdb_pages(zygote: Zygote, tmp_path: Path, backend: str, where: str) -> None:
    """Bytes flipped or pages zeroed in LMDB's files, probed in a separate process: loads
    serve only correct KV, or the store is refused with an error. LMDB does not checksum its
    pages, so a damaged page could crash the process that reads it; the page check at open
    (``kvtier.backends.lmdb_check``) refuses such a store instead. ``free list``: only pages
    of LMDB's free-page list, which only writers read (the probe writes: loads touch LRU)."""
    seed = fuzz_seed()
    rng = random.Random(seed)
    rounds = scale(12, 400) if where == "any page" else scale(8, 200)
    outcomes = {"served only correct KV": 0, "refused with an error": 0, "crashed": 0}
    errors: dict[str, int] = {}  # why stores were refused, with counts
    crashes: list[str] = []  # what each crash said
    files = ["index/data.mdb"] + (["lmdb/data.mdb"] if backend == "lmdb" else [])
    for n in range(rounds):
        store = tmp_path / f"s{n}"
        _fill(store, backend)
        target = store / rng.choice(files)
        data = bytearray(target.read_bytes())
        page = (rng.randrange(2, max(3, len(data) // 4096)) if where == "any page"  # not the two meta pages
                else rng.choice(free_list_pages(data)))
        if rng.random() < 0.5:
            data[page * 4096 : (page + 1) * 4096] = bytes(4096)
        else:
            for _ in range(8):
                data[page * 4096 + rng.randrange(4096)] ^= 0xFF
        target.write_bytes(bytes(data))
        rep = zygote.request("call", timeout=60, fn="probe_store",
                             kwargs={"path": str(store), "backend": backend, "sequences": SEQS})
        if "error" not in rep:
            assert rep["wrong"] == 0, f"round {n} (seed {seed}): wrong KV served"
            outcomes["served only correct KV"] += 1
        elif "no answer" in rep["error"] or "did not finish" in rep["error"]:
            outcomes["crashed"] += 1
            crashes.append(f"round {n}: {target.relative_to(store)} page {page}: {rep['error'][-300:]}")
        else:
            outcomes["refused with an error"] += 1
            last = rep["error"].strip().splitlines()[-1]
            crash = re.search(r"crashed the checking process \((\w+)\)|did not finish", last)
            codes = re.findall(r"MDB_[A-Z_]+", last)
            why = (f"the page check's helper {crash.group(1) or 'hung'}" if crash else
                   ", ".join(codes) if codes else "a key not found by a search" if "search" in last
                   else "a malformed free list" if "free list:" in last
                   else "malformed pages" if "page structure:" in last else last[-80:])
            why = f"{last.split(':', 1)[0].rsplit('.', 1)[-1]}: {why}"
            errors[why] = errors.get(why, 0) + 1
    part = "lmdb_pages" if where == "any page" else "lmdb_free_list"
    record(f"fuzz/{part}/{backend}", mutations=rounds, wrong_kv_served=0, **outcomes,
           refused=dict(sorted(errors.items())))
    # the page check at open turns what crashed readers (3 of 800 before it) and writers
    # (damaged free lists: 1 of 60 before it walked them) into StoreDamaged
    assert outcomes["crashed"] == 0, f"seed {seed}: {outcomes}; {crashes}"


def _crash_record_row(store: Path, dbkey: bytes) -> None:
    """Give a record's row in an ``lmdb`` store's payload database a value length of about
    2 GiB, in LMDB's own node header: LMDB keeps no checksums and does not check a large
    value's length against its pages, so a reader that copies the value reads past the file."""
    data = bytearray((store / "lmdb" / "data.mdb").read_bytes())
    at, changed = data.find(dbkey), 0
    while at >= 0:  # the node header before a key: data size lo, hi, flags, key size (u16 each)
        _, _, flags, ksize = struct.unpack_from("<HHHH", data, at - 8)
        leaf = struct.unpack_from("<H", data, at // 4096 * 4096 + 10)[0] & 0x02  # the page's flags
        if leaf and flags == 0x01 and ksize == len(dbkey):  # a large value (every copy: old pages too)
            struct.pack_into("<H", data, at - 6, 0x7FFF)
            changed += 1
        at = data.find(dbkey, at + 1)
    assert changed, "the record's row was not found in the payload file"
    (store / "lmdb" / "data.mdb").write_bytes(bytes(data))


def _refused_everywhere(zygote: Zygote, store: Path, backend: str, says: str) -> None:
    """kvtier refuses the damaged ``store`` with StoreDamaged naming ``says`` (a regex): in
    this process, in a probe process, and in ``kvtier ls`` (one line, what to do)."""
    with pytest.raises(StoreDamaged, match=says):
        open_cache(store, backend).close()
    rep = zygote.request("call", timeout=60, fn="probe_store",
                         kwargs={"path": str(store), "backend": backend, "sequences": SEQS})
    assert "StoreDamaged" in rep.get("error", ""), rep
    r = kvtier_cli("ls", str(store))
    assert r.returncode == 1 and "Traceback" not in r.stderr and re.search(says, r.stderr), r
    assert r.stderr.startswith("kvtier: error:") and "damaged" in r.stderr and "delete it" in r.stderr, r


def _plain_lmdb(script: str, *args: object) -> int:
    """The exit status of ``script`` run with plain py-lmdb in a new process (negative: a signal)."""
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True).returncode


def test_lmdb_page_that_crashes_readers_is_refused(zygote: Zygote, tmp_path: Path) -> None:
    """Regression (found by the damaged-page probes): a damaged LMDB page can kill the process
    that reads it. The store is checked in a helper process before it is trusted, so opening
    it is refused with StoreDamaged, the CLI says so in one line, and nothing crashes."""
    store = tmp_path / "s"
    _fill(store, "lmdb")
    key, (loc, _, _) = sorted(_entries(store).items())[3]
    dbkey = struct.pack(">Q", loc) + key  # (how the lmdb backend keys a record's payload)
    _crash_record_row(store, dbkey)
    # the damage is real: a plain LMDB reader of that row dies
    read = ("import lmdb, sys; env = lmdb.open(sys.argv[1], readonly=True, max_dbs=8); "
            "db = env.open_db(b'records'); env.begin().get(bytes.fromhex(sys.argv[2]), db=db)")
    assert _plain_lmdb(read, store / "lmdb", dbkey.hex()) < 0  # killed by a signal
    # kvtier refuses it and names the cause (the page check's structure walk names it
    # before its reader would die on it)
    _refused_everywhere(zygote, store, "lmdb", "page structure: b'records': page .* no run of overflow pages")
    record("fuzz/lmdb_pages/crafted_crash", reader_without_check="killed by a signal",
           kvtier="refused (StoreDamaged)")


def test_damaged_free_list_that_crashes_writers_is_refused(zygote: Zygote, tmp_path: Path) -> None:
    """Regression (2 of 2,012 damaged-page probes crashed, with the page check passing): only
    a writer reads LMDB's free-page list, so the reader's walk never met its damage, and LMDB
    trusts it. The page check parses the free list too: a node offset sent past its page
    kills a plain LMDB writer, and kvtier refuses the store instead."""
    store = tmp_path / "s"
    _fill(store, "files")
    data = bytearray((store / "index" / "data.mdb").read_bytes())
    struct.pack_into("<H", data, free_list_pages(data)[0] * 4096 + 16, 0xF000)  # the first node's offset
    (store / "index" / "data.mdb").write_bytes(bytes(data))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "data.mdb").write_bytes(bytes(data))
    # the damage is real: a plain LMDB writer dies at its first page allocation
    write = ("import lmdb, sys; env = lmdb.open(sys.argv[1], max_dbs=8); "
             "txn = env.begin(write=True); txn.put(b'k', b'v' * 100); txn.commit()")
    assert _plain_lmdb(write, plain) < 0  # killed by a signal
    _refused_everywhere(zygote, store, "files", "free list: page .* a node at offset 61440")
    record("fuzz/lmdb_free_list/crafted_crash", writer_without_check="killed by a signal",
           kvtier="refused (StoreDamaged)")


def test_damaged_node_that_crashes_writers_is_refused(zygote: Zygote, tmp_path: Path) -> None:
    """Regression (found by the damaged-page probes, then a writer fuzz: 1 of 2,000 damaged
    index pages): a node whose key size was grown into its neighbours reads back (readers
    only follow each node's offset), but a writer trusts the node sizes when it moves nodes
    and corrupts its heap ("free(): invalid size", SIGABRT). The page check requires a
    page's nodes to lie end to end, as LMDB keeps them, and refuses the store."""
    store = tmp_path / "s"
    _fill(store, "files")
    data = bytearray((store / "index" / "data.mdb").read_bytes())
    nodes = lmdb_leaf_nodes(data, b"entries")
    node = nodes[len(nodes) // 2]
    struct.pack_into("<H", data, node + 6, struct.unpack_from("<H", data, node + 6)[0] + 100)  # its key size
    (store / "index" / "data.mdb").write_bytes(bytes(data))
    # the damage is real: a plain LMDB reader of every row gets through, a writer dies
    for what, code in [("read", "for k, v in txn.cursor(db): bytes(k), bytes(v)"),
                       ("write", "for k in list(txn.cursor(db).iternext(values=False)): txn.delete(bytes(k), db=db)")]:
        plain = tmp_path / what
        shutil.copytree(store / "index", plain)
        script = (f"import lmdb, sys; env = lmdb.open(sys.argv[1], max_dbs=8); db = env.open_db(b'entries')\n"
                  f"with env.begin(write={what == 'write'}) as txn:\n    {code}\n")
        status = _plain_lmdb(script, plain)
        assert (status == 0) if what == "read" else (status < 0), (what, status)
    _refused_everywhere(zygote, store, "files", "page structure: b'entries': page .* a node at .*overlapping")
    record("fuzz/lmdb_pages/crafted_writer_crash", reader_without_check="read every row",
           writer_without_check="killed by a signal", kvtier="refused (StoreDamaged)")
