"""KV is keyed by what vLLM actually computes with: the weights it loads, the config it built,
the LoRA adapter's weights. What kvtier cannot fingerprint is not cached, and the server runs."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import shutil
from pathlib import Path

import pytest
from enginehelpers import tokens

from kvtier.cli.main import main as cli_main
from kvtier.testing.engine import Engine, kv_transfer_config
from kvtier.testing.tiny_model import make_tiny_lora

P = tokens(640, seed=70)
HIT = (len(P) - 1) // 32 * 32


def _serve(model: Path, store: Path, extra: dict[str, object] | None = None, **engine: object):
    """One engine run: (result, the scheduler-side connector's disabled_reason)."""
    with Engine(model, kv_transfer_config(store, **(extra or {})), **engine) as e:
        r = e.generate([P], max_tokens=6)[0]
        reason = e.scheduler_connector.disabled_reason
        if e.worker_connector._store is not None:
            e.worker_connector._store.flush()
    return r, reason


def test_dummy_weights_never_share_kv_with_real_weights(tiny_model: Path, store_dir: Path) -> None:
    real, _ = _serve(tiny_model, store_dir)
    assert _serve(tiny_model, store_dir)[0].num_cached_tokens == HIT  # sanity: real weights hit
    dummy, reason = _serve(tiny_model, store_dir, load_format="dummy")
    assert reason is None and dummy.num_cached_tokens == 0
    assert _serve(tiny_model, store_dir, load_format="dummy")[0].num_cached_tokens == HIT
    assert real.tokens != dummy.tokens  # the namespaces had to differ: the KV does


def test_hf_overrides_change_the_namespace(tiny_model: Path, store_dir: Path) -> None:
    """A rope change through hf_overrides changes every K: no hits from the plain config."""
    rope = {"rope_parameters": {"rope_theta": 50.0, "rope_type": "default"}}
    with Engine(tiny_model, hf_overrides=rope) as e:
        base = e.generate([P], max_tokens=6)[0]
    plain, _ = _serve(tiny_model, store_dir)
    assert plain.tokens != base.tokens  # the override changes the KV, so it must change keys
    got, _ = _serve(tiny_model, store_dir, hf_overrides=rope)
    assert got.num_cached_tokens == 0
    assert got.tokens == base.tokens


def test_hf_config_path_is_the_config_that_is_keyed(tiny_model: Path, tmp_path: Path) -> None:
    """With hf_config_path, the config vLLM reads (not the one beside the weights) is keyed."""
    cfg_dir = tmp_path / "other-config"
    cfg_dir.mkdir()
    cfg = json.loads((tiny_model / "config.json").read_text())
    cfg["rope_parameters"]["rope_theta"] = 50.0
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    store = tmp_path / "store"
    plain, _ = _serve(tiny_model, store)
    with Engine(tiny_model, hf_config_path=str(cfg_dir)) as e:
        base = e.generate([P], max_tokens=6)[0]
    assert plain.tokens != base.tokens  # the other config changes the KV
    got, _ = _serve(tiny_model, store, hf_config_path=str(cfg_dir))
    assert got.num_cached_tokens == 0
    assert got.tokens == base.tokens
    assert _serve(tiny_model, store, hf_config_path=str(cfg_dir))[0].num_cached_tokens == HIT


def test_prefix_caching_hash_algo_does_not_matter(tiny_model: Path, store_dir: Path) -> None:
    """kvtier hashes token ids itself; vLLM's own block-hash setting cannot split the cache."""
    first, _ = _serve(tiny_model, store_dir, prefix_caching_hash_algo="sha256")
    second, _ = _serve(tiny_model, store_dir, prefix_caching_hash_algo="sha256_cbor")
    assert second.num_cached_tokens == HIT
    assert first.tokens == second.tokens


def test_weights_kvtier_cannot_hash_turn_the_connector_off(tiny_model: Path, store_dir: Path) -> None:
    """A loader kvtier does not know (here a custom one registered with vLLM) loads weights
    from somewhere kvtier cannot see: no caching, one line saying what to set, and the
    server serves; with an explicit weights_fingerprint it caches."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    @register_model_loader("kvtier_test_remote")
    class RemoteLoader(DefaultModelLoader):  # stands for any loader kvtier cannot see into
        def __init__(self, load_config):  # noqa: ANN001
            local = copy.copy(load_config)  # vLLM's own config keeps the custom format
            local.load_format = "auto"
            super().__init__(local)

    with Engine(tiny_model) as e:
        base = e.generate([P], max_tokens=6)[0]
    for _ in range(2):
        got, reason = _serve(tiny_model, store_dir, load_format="kvtier_test_remote")
        assert reason is not None and "weights_fingerprint" in reason and "kvtier_test_remote" in reason
        assert got.num_cached_tokens == 0 and got.tokens == base.tokens
    assert not store_dir.exists() or not any(store_dir.rglob("*.kvt"))
    fp = {"weights_fingerprint": "my-remote-model@2026-11-01"}
    for expect in (0, HIT):
        got, reason = _serve(tiny_model, store_dir, fp, load_format="kvtier_test_remote")
        assert reason is None and got.num_cached_tokens == expect and got.tokens == base.tokens


def test_lora_retrained_in_place_gets_no_stale_kv(tiny_model: Path, tmp_path: Path) -> None:
    """Same adapter name, id and path, new weights after a restart: no hits, and the output
    is the new adapter's. The unchanged adapter hits across a restart."""
    from vllm.lora.request import LoRARequest

    adapter = make_tiny_lora(tmp_path / "adapter", tiny_model, seed=1)
    store = tmp_path / "store"
    lora = LoRARequest("support-bot", 1, str(adapter))
    kw = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}

    def run(with_cache: bool):
        cfg = kv_transfer_config(store) if with_cache else None
        with Engine(tiny_model, cfg, **kw) as e:
            r = e.generate([P], max_tokens=6, lora=lora)[0]
            if with_cache:
                e.worker_connector._store.flush()
        return r

    v1 = run(False)
    assert run(True).num_cached_tokens == 0
    again = run(True)
    assert again.num_cached_tokens == HIT and again.tokens == v1.tokens
    # `kvtier inspect --lora` finds what the server saved by the adapter's directory (its
    # keys hold the weights' fingerprint); the adapter's name finds nothing
    (tmp_path / "p.json").write_text(json.dumps(P))
    for lora_arg, cached in ((str(adapter), True), ("support-bot", False)):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert cli_main(["inspect", str(store), "--tokens", str(tmp_path / "p.json"),
                             "--lora", lora_arg, "--json"]) == 0
        assert (json.loads(out.getvalue())["cached_prefix_tokens"] >= 512) == cached, (lora_arg, out.getvalue())
    make_tiny_lora(adapter, tiny_model, seed=2)  # retrained in place
    v2 = run(False)
    assert v2.tokens != v1.tokens  # the adapter matters to the output
    stale_check = run(True)
    assert stale_check.num_cached_tokens == 0
    assert stale_check.tokens == v2.tokens
    # No adapter at all never sees the adapter's chunks either.
    with Engine(tiny_model, kv_transfer_config(store), **kw) as e:
        assert e.generate([P], max_tokens=6)[0].num_cached_tokens == 0
    shutil.rmtree(store)


@pytest.mark.parametrize("version", ["0.29.1", "0.99.0"])
def test_unknown_vllm_version_turns_the_connector_off(tiny_model: Path, store_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", version)
    got, reason = _serve(tiny_model, store_dir)
    assert reason is not None and f"vLLM {version} is outside" in reason
    assert got.num_cached_tokens == 0
    assert not store_dir.exists() or not any(store_dir.rglob("*.kvt"))


def test_unexpected_startup_error_never_takes_the_server_down(tiny_model: Path, store_dir: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """An API change kvtier did not foresee surfaces as an exception while starting: the
    connector turns off and the engine serves."""
    import kvtier.vllm.connector as connector

    def broken(_vllm_config: object) -> dict[str, str]:
        raise AttributeError("'ModelConfig' object has no attribute 'hf_config'")

    monkeypatch.setattr(connector, "model_identity", broken)
    with Engine(tiny_model) as e:
        base = e.generate([P], max_tokens=6)[0]
    got, reason = _serve(tiny_model, store_dir)
    assert reason is not None and "unexpected error while starting (AttributeError" in reason
    assert got.tokens == base.tokens


def _hub_snapshot(download_dir: Path, repo: str, files: dict[str, bytes]) -> Path:
    """A model in the hub-cache layout vLLM uses under --download-dir (nothing downloaded)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = download_dir / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, data in files.items():
        (snap / name).write_bytes(data)
    return snap


def _config(model: str, download_dir: Path | None = None, load_format: str = "auto"):
    """vLLM's real LoadConfig; the model config stands in for one built from a hub id, which
    would need the hub."""
    from types import SimpleNamespace

    from vllm.config import LoadConfig

    return SimpleNamespace(model_config=SimpleNamespace(model=model, revision=None),
                           load_config=LoadConfig(load_format=load_format,
                                                  download_dir=str(download_dir) if download_dir else None))


def test_download_dir_snapshot_without_weights_is_refused_not_a_crash(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A repo id whose snapshot under --download-dir holds only the config: no fingerprint,
    a message naming what to set (not a FileNotFoundError at start-up)."""
    from kvtier.vllm.identity import IdentityUnavailable, model_fingerprint

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dl = tmp_path / "dl"
    _hub_snapshot(dl, "acme/tiny", {"config.json": b"{}"})
    with pytest.raises(IdentityUnavailable, match="no weight files.*weights_fingerprint"):
        model_fingerprint(_config("acme/tiny", dl), None, None)
    with pytest.raises(IdentityUnavailable, match="under download_dir .*weights_fingerprint"):
        model_fingerprint(_config("acme/other", dl), None, None)
    # The explicit fingerprint is what the user asked for.
    assert model_fingerprint(_config("acme/tiny", dl), "acme-tiny@v3", None) == "acme-tiny@v3"


def test_download_dir_snapshot_with_weights_is_hashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.vllm.identity import model_fingerprint

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dl = tmp_path / "dl"
    snap = _hub_snapshot(dl, "acme/tiny", {"config.json": b"{}", "model.safetensors": b"w1"})
    first = model_fingerprint(_config("acme/tiny", dl), None, None)
    assert first.startswith("sha256:")
    (snap / "model.safetensors").write_bytes(b"w2")  # new weights under the same repo id
    assert model_fingerprint(_config("acme/tiny", dl), None, None) != first


def test_single_file_checkpoint_is_hashed(tmp_path: Path) -> None:
    from kvtier.vllm.identity import model_fingerprint

    gguf = tmp_path / "tiny.Q8_0.gguf"
    gguf.write_bytes(b"GGUF-v1")
    first = model_fingerprint(_config(str(gguf)), None, None)
    gguf.write_bytes(b"GGUF-v2")
    assert model_fingerprint(_config(str(gguf)), None, None) != first


@pytest.mark.parametrize("fmt", ["tensorizer", "ipc_cache", "modelexpress"])
def test_loaders_kvtier_cannot_see_into_need_a_fingerprint(tiny_model: Path, fmt: str) -> None:
    from kvtier.vllm.identity import IdentityUnavailable, model_fingerprint

    with pytest.raises(IdentityUnavailable, match=f"load_format '{fmt}'.*weights_fingerprint"):
        model_fingerprint(_config(str(tiny_model), load_format=fmt), None, None)
