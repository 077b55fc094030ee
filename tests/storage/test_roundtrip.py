"""Round trips across processes, prefix lookups, and isolation by namespace and extras.

The writer is a separate process (forked from the zygote, which runs under another
PYTHONHASHSEED than this one); this process finds and loads what it wrote, bit for bit,
computing the same keys.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from kvhelpers import (
    CHUNK,
    DTYPES,
    TAIL,
    Zygote,
    config,
    make_kv,
    matrix_tokens,
    namespace,
    open_cache,
    same_bits,
    tokens,
)

from kvtier import ChunkStore, ConfigError, KVCache, RequestExtras
from kvtier.keys import chain_seed, child_key, tail_lookup_step

SPECS = [
    {"name": f"{b}-{d}-{c}-{dur}", "backend": b, "dtype": d, "compression": c, "durability": dur}
    for b in ("lmdb", "files") for d in DTYPES for c in ("none", "zstd") for dur in ("process",)
] + [
    {"name": f"{b}-bfloat16-none-power", "backend": b, "dtype": "bfloat16", "compression": "none",
     "durability": "power"}
    for b in ("lmdb", "files")
]

def test_round_trip_across_processes(zygote: Zygote, tmp_path: Path) -> None:
    res = zygote.request("call", fn="write_matrix", timeout=180,
                         kwargs={"root": str(tmp_path), "specs": SPECS})
    assert "error" not in res, res.get("error")
    assert res["pid"] != os.getpid()
    # the writer ran with another PYTHONHASHSEED than this process (see the zygote fixture)
    assert res["hash"] != hash("kvtier")

    for spec in SPECS:
        dtype = DTYPES[spec["dtype"]]
        ns = namespace(spec["dtype"])
        # the reader's compression setting does not matter: records describe themselves
        with open_cache(tmp_path / spec["name"], spec["backend"], ns) as cache:
            for seed in (1, 2):
                toks = matrix_tokens(seed)
                assert cache.lookup(toks) == len(toks), spec
                got = cache.load(toks)
                assert same_bits(got, make_kv(toks, dtype)), f"{spec['name']}: bits differ"
            st = cache.stats()
            assert (st["hits_disk"], st["hits_host"]) == (6, 2), st  # from disk; the shared 2 then from host
            assert st["corrupt_records"] == 0 and st["misses"] == 0
            # keys computed here, under another hash seed, equal the writer's
            assert [c.key.hex() for c in cache.chunks(matrix_tokens(1))] == res["keys"][spec["name"]]
    assert len({tuple(k) for k in res["keys"].values()}) == len(DTYPES), "one key set per dtype"


def test_key_derivation_is_pinned() -> None:
    """Changing how keys are derived orphans every cache on disk: it must be deliberate
    (bump FORMAT_VERSION and this value together)."""
    ns = namespace()
    key = child_key(chain_seed(ns), np.arange(CHUNK, dtype="<u4"))
    assert ns.id.hex() == GOLDEN_NS_ID
    assert key.hex() == GOLDEN_KEY


GOLDEN_NS_ID = "4dcee2b19c25288bf771cb89f588fe82"
GOLDEN_KEY = "f6927f8b98b68447622816c4e610396ba7c33c095ceafaf54fa92cc56de2e639"


@pytest.fixture(params=["lmdb", "files"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def test_prefix_lookups_and_tail(tmp_path: Path, backend: str) -> None:
    toks = tokens(1, 3 * CHUNK + 16)  # 3 full chunks + a 16-token tail
    kv = make_kv(toks)
    with open_cache(tmp_path / "s", backend) as cache:
        assert [(c.start, c.end) for c in cache.chunks(toks)] == [(0, 32), (32, 64), (64, 96), (96, 112)]
        assert cache.save(toks, kv) == len(toks)
        assert cache.save(toks, kv) == 0  # already there
    with open_cache(tmp_path / "s", backend) as cache:  # a fresh store: from disk
        def check(query: np.ndarray, want: int) -> None:
            assert cache.lookup(query) == want, (len(query), want)
            got = cache.load(query)
            assert same_bits(got, make_kv(query[:want]))

        check(toks, len(toks))  # the exact sequence hits in full, tail included
        check(toks[:96], 96)
        check(toks[:100], 96)  # partial chunks are found only where one was saved
        check(toks[:69], 64)
        check(toks[:31], 0)
        check(np.concatenate([toks, tokens(2, 50)]), len(toks))  # longer: whole saved part
        for pos, want in ((70, 64), (40, 32), (100, 96), (5, 0)):
            other = toks.copy()
            other[pos] += 1  # diverges at pos: only whole chunks before it hit
            check(other, want)
        assert cache.load(toks, max_tokens=64).shape[2] == 64
        assert cache.stats()["corrupt_records"] == 0

        odd = tokens(3, CHUNK + 13)  # tail of 13 is rounded down to 8
        cache.save(odd, make_kv(odd))
        cache.flush()
        check(odd, CHUNK + 8)


def test_a_tail_saved_at_a_finer_granularity_is_found_by_a_coarser_reader(tmp_path: Path, backend: str) -> None:
    """A server restarted with a larger block size still finds the tails the old one saved
    (lookups try every 16 tokens, not only its own granularity)."""
    ns = namespace(chunk_tokens=64)
    toks = tokens(4, 64 + 50)  # a full chunk, then a tail of 50: saved as 48 at granularity 16
    with open_cache(tmp_path / "s", backend, ns, tail=16) as cache:
        assert cache.save(toks, make_kv(toks)) == 112
    with open_cache(tmp_path / "s", backend, ns, tail=32) as cache:
        assert [c.end for c in cache.chunks(toks)] == [64, 96]  # its own tail would be 32 tokens
        assert cache.lookup(toks) == 112
        assert same_bits(cache.load(toks), make_kv(toks[:112]))
        assert cache.lookup(toks[:100]) == 64  # a tail is found only where its tokens are
    # lengths tried every 16 tokens, or every block where blocks are smaller: a tail saved at
    # 8 of a length that is not a multiple of 16 is not found at 16 (the documented limit)
    assert [tail_lookup_step(g) for g in (1, 8, 16, 32, 64, 128)] == [1, 8, 16, 16, 16, 16]
    odd = tokens(5, 64 + 27)  # a tail of 27: saved as 24 at granularity 8
    with open_cache(tmp_path / "s", backend, ns, tail=8) as cache:
        cache.save(odd, make_kv(odd))
        assert cache.flush(30)  # saving is write-behind: a lookup reads the shared index
        assert cache.lookup(odd) == 88
    with open_cache(tmp_path / "s", backend, ns, tail=16) as cache:
        assert cache.lookup(odd) == 64


def test_request_extras_isolate(tmp_path: Path, backend: str) -> None:
    toks = tokens(4, 2 * CHUNK)
    saved = RequestExtras(cache_salt="tenant-a", lora="adapter-1", mm_hashes=(("img:abc", 3),))
    with open_cache(tmp_path / "s", backend) as cache:
        cache.save(toks, make_kv(toks), saved)
        cache.flush()
        assert cache.lookup(toks, saved) == 2 * CHUNK
        for other in (RequestExtras(), RequestExtras(cache_salt="tenant-b"),
                      RequestExtras(cache_salt="tenant-a"),
                      RequestExtras(cache_salt="tenant-a", lora="adapter-2", mm_hashes=(("img:abc", 3),)),
                      RequestExtras(cache_salt="tenant-a", lora="adapter-1", mm_hashes=(("img:abd", 3),)),
                      RequestExtras(cache_salt="tenant-a", lora="adapter-1", mm_hashes=(("img:abc", 4),))):
            assert cache.lookup(toks, other) == 0, other
            assert cache.load(toks, other).shape[2] == 0


NS_VARIANTS = {
    "model": {"model": "other-model"},
    "weights_fingerprint": {"weights_fingerprint": "sha256:4567"},
    "dtype": {"dtype": "float16"},
    "chunk_tokens": {"chunk_tokens": 64},
    "tp_rank": {"tp_rank": 1, "tp_size": 2},
    "tp_size": {"tp_size": 2},
    "kv_shape": {"kv_shape": (2, 2, 2, 64)},
    "layout": {"layout": "LKTHD-other"},
    "format_version": {"format_version": 999},
    "extra": {"extra": (("rope", "yarn"),)},
}


def test_namespace_isolates(tmp_path: Path, backend: str) -> None:
    base = namespace()
    toks = tokens(5, 4 * CHUNK)
    with open_cache(tmp_path / "s", backend, base) as cache:
        cache.save(toks, make_kv(toks))
    ids = {base.id}
    for name, change in NS_VARIANTS.items():
        kw = {"dtype": "bfloat16", **change}
        ns = namespace(**kw)
        ids.add(ns.id)
        store = ChunkStore(config(tmp_path / "s", backend, chunk_tokens=ns.chunk_tokens))
        if name in ("layout", "format_version"):  # keyed apart, and refused: records have one of each
            with store, pytest.raises(ConfigError, match=f"{name}: .*leave Namespace.{name} at its default"):
                KVCache(store, ns, tail_granularity=TAIL)
            continue
        with KVCache(store, ns, tail_granularity=TAIL) as cache:
            assert cache.lookup(toks) == 0, name
            assert cache.load(toks).shape[2] == 0, name
    assert len(ids) == len(NS_VARIANTS) + 1
    with open_cache(tmp_path / "s", backend, base) as cache:  # and the original still hits
        assert cache.lookup(toks) == 4 * CHUNK
        assert set(cache.store.backend.namespaces()) >= {base.id}


def test_kv_of_wrong_shape_or_dtype_is_refused(tmp_path: Path) -> None:
    toks = tokens(6, CHUNK)
    with open_cache(tmp_path / "s") as cache:
        with pytest.raises(ValueError, match="shape"):
            cache.save(toks, make_kv(toks[:-1]))
        with pytest.raises(ValueError, match="dtype"):
            cache.save(toks, make_kv(toks, torch.float16))


def test_load_many_reads_in_parallel_and_says_what_happened_to_each(tmp_path: Path) -> None:
    from kvtier.store import Outcome

    toks = tokens(5, 4 * CHUNK)
    with open_cache(tmp_path / "s", "files") as cache:
        cache.save(toks, make_kv(toks))
        assert cache.flush(30)
        keys = [c.key for c in cache.chunks(toks)][:4]
    victim = next((tmp_path / "s" / "files").rglob(keys[1].hex() + ".*.kvt"))
    data = bytearray(victim.read_bytes())
    data[-50] ^= 0xFF
    victim.write_bytes(bytes(data))
    with ChunkStore(config(tmp_path / "s", "files", host_bytes=0)) as store:
        got = list(store.load_many([keys[0], keys[1], os.urandom(32), keys[3]]))
    assert [g.outcome for g in got] == [Outcome.HIT, Outcome.CORRUPT, Outcome.MISS, Outcome.HIT]
    assert same_bits(got[3].tensor, make_kv(toks[3 * CHUNK:], start=3 * CHUNK))


def test_a_destination_of_the_wrong_shape_is_the_callers_mistake_and_the_record_is_kept(tmp_path: Path) -> None:
    from kvtier.store import Outcome

    toks = tokens(6, CHUNK)
    with open_cache(tmp_path / "s", "files") as cache:
        cache.save(toks, make_kv(toks))
        assert cache.flush(30)
        key = cache.chunks(toks)[0].key
    with ChunkStore(config(tmp_path / "s", "files", host_bytes=0)) as store:
        wrong = torch.empty(3, dtype=torch.bfloat16)
        got = store.load(key, wrong)
        assert got.outcome is Outcome.INCOMPATIBLE and "destination" in got.why
        assert store.counters.snapshot()["corrupt_records"] == 0
        assert store.load(key).outcome is Outcome.HIT  # still there


@pytest.mark.parametrize("where", ["write queue", "host tier"])
def test_a_wrong_destination_is_refused_from_memory_as_from_the_disk(tmp_path: Path, where: str) -> None:
    """A chunk held in memory was copied into any destination a copy could broadcast or
    cast into (a float32 one of three rows took a bfloat16 chunk of one) and called a hit;
    one it could not made load() raise. Now the same outcome as from the disk."""
    from kvtier.store import Outcome

    toks = tokens(6, CHUNK)
    kv = make_kv(toks)
    with open_cache(tmp_path / "s", "files") as cache:
        key = cache.chunks(toks)[0].key
        store = cache.store
        written = threading.Event()
        if where == "write queue":  # (written only once the test is done: held in the queue)
            put_many = store.backend.put_many

            def held(items: list, put_many: object = put_many) -> object:
                written.wait(30)
                return put_many(items)  # type: ignore[operator]

            store.backend.put_many = held  # type: ignore[method-assign]
            store.host.budget = 0
        else:
            written.set()
        cache.save(toks, kv)
        if where == "host tier":
            assert cache.flush(30)
        assert (store.host.get(key) is not None) == (where == "host tier") and (key in store._pending) != written.is_set()
        chunk_shape = tuple(kv.shape)
        for wrong in (torch.zeros((chunk_shape[0] * 3, *chunk_shape[1:]), dtype=torch.float32),
                      torch.zeros(chunk_shape, dtype=torch.float32), torch.zeros(3, dtype=torch.bfloat16)):
            got = store.load(key, wrong)
            assert got.outcome is Outcome.INCOMPATIBLE and "destination" in got.why, got
            assert not wrong.any()
        right = torch.empty(chunk_shape, dtype=kv.dtype)
        assert store.load(key, right).outcome is Outcome.HIT and same_bits(right, kv[:, :, :CHUNK])
        assert store.counters.snapshot()["corrupt_records"] == 0
        written.set()


def test_a_strided_token_array_keys_as_its_values(tmp_path: Path) -> None:
    """A uint32 array that is a view with a stride (every other token of a longer one) keys,
    saves and loads as the same tokens in a list (hashing a partial chunk failed on it)."""
    base = np.array(tokens(8, 2 * (2 * CHUNK + TAIL)), dtype=np.uint32)
    strided = base[::2]
    assert not strided.flags.c_contiguous
    as_list = [int(t) for t in strided]
    kv = make_kv(as_list)
    with open_cache(tmp_path / "s") as cache:
        assert cache.save(strided, kv, wait=10) == len(as_list)
        assert cache.flush(30)
        assert cache.lookup(as_list) == cache.lookup(strided) == len(as_list)
        assert same_bits(cache.load(strided), kv)
