"""KV is shared only within a namespace: salt, weights, dtype and chunk size all separate it."""

from __future__ import annotations

from pathlib import Path

import pytest
from enginehelpers import tokens

from kvtier.testing.engine import Engine, kv_transfer_config

P = tokens(640, seed=40)
HIT = (len(P) - 1) // 32 * 32


def _serve(model: Path, store: Path, salt: str | None = None, dtype: str = "bfloat16", **extra: object):
    with Engine(model, kv_transfer_config(store, **extra), dtype=dtype) as e:
        r = e.generate([P], max_tokens=4, salts=[salt])[0]
        e.worker_connector._store.flush()
    return r


def test_cache_salt_isolates_tenants(tiny_model: Path, store_dir: Path) -> None:
    assert _serve(tiny_model, store_dir, salt="tenant-a").num_cached_tokens == 0
    other = _serve(tiny_model, store_dir, salt="tenant-b")
    unsalted = _serve(tiny_model, store_dir, salt=None)
    same = _serve(tiny_model, store_dir, salt="tenant-a")
    assert other.num_cached_tokens == 0
    assert unsalted.num_cached_tokens == 0
    assert same.num_cached_tokens == HIT
    assert same.tokens == other.tokens == unsalted.tokens


def test_same_name_different_weights_never_share(tiny_model: Path, other_weights_model: Path,
                                                 tmp_path: Path) -> None:
    """Two checkpoints served from the same path (same model name) get different namespaces."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    store = tmp_path / "store"
    _serve(model, store)
    assert _serve(model, store).num_cached_tokens == HIT  # sanity: same weights hit
    for f in other_weights_model.glob("*.safetensors"):
        shutil.copy(f, model / f.name)  # new weights, same name and path
    with Engine(other_weights_model) as e:
        base = e.generate([P], max_tokens=4)[0]
    swapped = _serve(model, store)
    assert swapped.num_cached_tokens == 0
    assert swapped.tokens == base.tokens


@pytest.mark.parametrize("change", [{"dtype": "float32"}, {"chunk_tokens": 128}])
def test_dtype_or_chunk_size_change_means_no_hits(tiny_model: Path, store_dir: Path,
                                                  change: dict[str, object]) -> None:
    _serve(tiny_model, store_dir)
    dtype = str(change.get("dtype", "bfloat16"))
    extra = {k: v for k, v in change.items() if k != "dtype"}
    assert _serve(tiny_model, store_dir, dtype=dtype, **extra).num_cached_tokens == 0
    assert _serve(tiny_model, store_dir, dtype=dtype, **extra).num_cached_tokens == HIT
