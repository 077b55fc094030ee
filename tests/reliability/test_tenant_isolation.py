"""Isolation on one store: different models, cache salts and LoRA adapters never see each
other's chunks, through the library or the CLI, unless the CLI is asked for them."""

from __future__ import annotations

import json
from pathlib import Path

from kvhelpers import make_kv, namespace, open_cache, same_bits, tokens  # noqa: I001
from relhelpers import kvtier_cli, record

from kvtier import RequestExtras

TOKS = tokens(8, 96)


def test_tenants_never_see_each_other(tmp_path: Path) -> None:
    store = tmp_path / "s"
    tenants = [
        (namespace(model="model-a"), RequestExtras()),
        (namespace(model="model-b"), RequestExtras()),
        (namespace(model="model-a"), RequestExtras(cache_salt="tenant-1")),
        (namespace(model="model-a"), RequestExtras(cache_salt="tenant-2")),
        (namespace(model="model-a"), RequestExtras(lora="sha256:adapter-1")),
        (namespace(model="model-a"), RequestExtras(lora="sha256:adapter-2")),
    ]
    for i, (ns, extras) in enumerate(tenants):  # each saves the same tokens, other KV
        with open_cache(store, "files", ns=ns) as cache:
            cache.save(TOKS, make_kv(TOKS, start=1000 * i), extras)
            assert cache.flush(30)
    for i, (ns, extras) in enumerate(tenants):  # the same tokens: each gets only its own KV
        with open_cache(store, "files", ns=ns) as cache:
            assert cache.lookup(TOKS, extras) == len(TOKS)
            got = cache.load(TOKS, extras)
            assert same_bits(got, make_kv(TOKS, start=1000 * i)), f"tenant {i} got someone else's KV"
        with open_cache(store, "files", ns=namespace(model="model-c")) as cache:
            assert cache.lookup(TOKS, extras) == 0  # a model that saved nothing sees nothing
    # The CLI lists and evicts one namespace only when asked for it.
    r = kvtier_cli("ls", store, "--json")
    assert r.returncode == 0, r.stderr
    ls = json.loads(r.stdout)
    assert {n["model"] for n in ls["namespaces"]} == {"model-a", "model-b", "model-c"}
    a = namespace(model="model-a").id.hex()
    r = kvtier_cli("evict", store, "--namespace", a[:12], "--all", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["removed"]["records"] > 0
    with open_cache(store, "files", ns=namespace(model="model-b")) as cache:
        assert cache.lookup(TOKS) == len(TOKS)  # the other model's chunks stay
    record("isolation", tenants=len(tenants), loads_checked=len(tenants), leaks=0)
