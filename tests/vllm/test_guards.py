"""Settings under which kvtier would store or serve wrong KV turn the connector off.

Where vLLM on the CPU cannot run a setting (context parallelism, fp8 KV, the hybrid KV
manager), the connector is built directly from vLLM's real config objects, as vLLM builds it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from enginehelpers import tokens

from kvtier.testing.engine import Engine, kv_transfer_config
from kvtier.vllm.compat import unsupported_setting, version_problem

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """8 query heads over 2 KV heads: the smallest model vLLM accepts with DCP=2 (TP=4)."""
    from kvtier.testing.tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "gqa", heads=8, kv_heads=2)


def _vllm_config(model: Path, store: Path, **parallel: int):
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="bfloat16", skip_tokenizer_init=True),
        parallel_config=ParallelConfig(**parallel), cache_config=CacheConfig(block_size=128),
        kv_transfer_config=KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both",
                                            kv_connector_module_path="kvtier.vllm.connector",
                                            kv_connector_extra_config={"path": str(store)}))


def _kv_cache_config(*specs: object):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([LAYERS[i]], s) for i, s in enumerate(specs)]
    if len(specs) == 1:
        groups = [KVCacheGroupSpec(LAYERS, specs[0])]
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def _full(head_size: int = 16, **kw: object):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=head_size, dtype=torch.bfloat16, **kw)


def _scheduler_connector(config: object, kv_cache_config: object):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.vllm.connector import KVTierConnector

    return KVTierConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)


def test_plain_config_starts_the_connector(gqa_model: Path, tmp_path: Path) -> None:
    """The control for the tests below: the same objects without the setting are served."""
    c = _scheduler_connector(_vllm_config(gqa_model, tmp_path / "s", tensor_parallel_size=4), _kv_cache_config(_full()))
    assert c.disabled_reason is None and c._sched is not None
    c.shutdown()


def test_decode_context_parallelism_turns_the_connector_off(gqa_model: Path, tmp_path: Path) -> None:
    """With DCP=2 a manager block holds 256 tokens spread over two ranks: kvtier's token to
    block mapping would save one prompt's KV under another prompt's key."""
    cfg = _vllm_config(gqa_model, tmp_path / "s", tensor_parallel_size=4, decode_context_parallel_size=2)
    c = _scheduler_connector(cfg, _kv_cache_config(_full()))
    assert c.disabled_reason == "decode context parallelism (decode_context_parallel_size=2)"
    assert c._sched is None and c.get_num_new_matched_tokens(SimpleNamespace(request_id="r"), 0) == (0, False)


def test_prefill_context_parallelism_is_refused() -> None:
    """vLLM's CPU model runner cannot build a whole config with PCP; its ParallelConfig can."""
    from vllm.config import CacheConfig, ParallelConfig

    cfg = SimpleNamespace(parallel_config=ParallelConfig(prefill_context_parallel_size=2),
                          cache_config=CacheConfig(), model_config=SimpleNamespace())
    assert unsupported_setting(cfg) == "prefill context parallelism (prefill_context_parallel_size=2)"


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_quantized_kv_cache_is_refused(cache_dtype: str) -> None:
    from vllm.config import CacheConfig, ParallelConfig

    cfg = SimpleNamespace(parallel_config=ParallelConfig(), model_config=SimpleNamespace(),
                          cache_config=CacheConfig(cache_dtype=cache_dtype))
    assert unsupported_setting(cfg) == f"quantized KV cache (kv_cache_dtype={cache_dtype})"
    ok = SimpleNamespace(parallel_config=ParallelConfig(), model_config=SimpleNamespace(),
                         cache_config=CacheConfig(cache_dtype="auto"))
    assert unsupported_setting(ok) is None


def test_sleep_mode_is_refused() -> None:
    """Sleep mode is for swapping weights in place (vLLM on the CPU cannot enable it)."""
    from vllm.config import CacheConfig, ParallelConfig

    cfg = SimpleNamespace(parallel_config=ParallelConfig(), cache_config=CacheConfig(),
                          model_config=SimpleNamespace(enable_sleep_mode=True))
    assert "sleep mode" in str(unsupported_setting(cfg))
    cfg.model_config.enable_sleep_mode = False
    assert unsupported_setting(cfg) is None


def test_micro_batches_and_full_cuda_graphs_are_recognised() -> None:
    """Where vLLM splits a forward pass into micro-batches (dual-batch overlap), each calls
    save_kv_layer for every layer: the worker then copies every layer after the forward
    pass. Where a forward pass replays a full CUDA graph, no wait_for_layer_load runs: a
    synchronous load is then waited for whole. Both read from vLLM's own config and forward
    context types."""
    from vllm.config import CUDAGraphMode, ParallelConfig

    from kvtier.vllm.connector import _layer_waits_run, _micro_batched

    assert not _micro_batched(SimpleNamespace(parallel_config=ParallelConfig()))
    assert _micro_batched(SimpleNamespace(parallel_config=ParallelConfig(enable_dbo=True)))
    assert _micro_batched(SimpleNamespace(parallel_config=ParallelConfig(ubatch_size=2)))
    assert not _layer_waits_run(SimpleNamespace(cudagraph_runtime_mode=CUDAGraphMode.FULL))
    assert _layer_waits_run(SimpleNamespace(cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE))
    assert _layer_waits_run(SimpleNamespace(cudagraph_runtime_mode=CUDAGraphMode.NONE))


def test_external_launcher_with_several_ranks_is_refused() -> None:
    """With torchrun's external launcher every rank schedules on its own: a store written by
    others between two ranks' lookups would give them different steps."""
    from vllm.config import CacheConfig, ParallelConfig

    def cfg(**kw: object) -> SimpleNamespace:
        return SimpleNamespace(parallel_config=ParallelConfig(**kw), cache_config=CacheConfig(),
                               model_config=SimpleNamespace())

    assert "external_launcher executor with 2 ranks" in str(unsupported_setting(
        cfg(distributed_executor_backend="external_launcher", tensor_parallel_size=2)))
    # one rank per engine (data parallel under torchrun): nothing to agree on
    assert unsupported_setting(cfg(distributed_executor_backend="external_launcher")) is None
    assert unsupported_setting(cfg(tensor_parallel_size=2)) is None


@pytest.mark.parametrize(("version", "ok"), [
    ("0.29.9", False), ("0.30.0", True), ("0.31.2", True), ("0.32.0", True), ("0.33.1rc1", True),
    ("0.34.0", False), ("1.0.0", False), ("dev", False),
])
def test_version_range(version: str, ok: bool) -> None:
    assert (version_problem(version) is None) == ok


def test_vllm_keeps_its_hybrid_manager_on_for_kvtier() -> None:
    """vLLM turns its hybrid KV manager off for connectors without SupportsHMA, and hybrid
    mamba models then fail to start; with kvtier they start (and kvtier sits out)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import kvtier.vllm.plugin

    kvtier.vllm.plugin.register()
    for module in (None, "kvtier.vllm.connector"):
        ktc = KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both", kv_connector_module_path=module)
        assert KVConnectorFactory.supports_hma_config(ktc)


def test_several_kv_groups_turn_the_connector_off_and_every_call_is_safe(gqa_model: Path, tmp_path: Path) -> None:
    """Under the hybrid manager a mamba/sliding-window model has several KV groups."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba = MambaSpec(block_size=128, shapes=((4, 8),), dtypes=(torch.float32,))
    c = _scheduler_connector(_vllm_config(gqa_model, tmp_path / "s"), _kv_cache_config(_full(), mamba))
    assert c.disabled_reason is not None and "2 KV-cache groups" in c.disabled_reason
    req = SimpleNamespace(request_id="r", prompt_token_ids=list(range(300)))
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    assert c.request_finished_all_groups(req, ([1, 2], [3])) == (False, None)
    assert c.reset_cache() is True
    meta = c.build_connector_meta(SchedulerOutput.make_empty())
    assert not meta.loads and not meta.saves


def test_non_causal_attention_is_refused(gqa_model: Path, tmp_path: Path) -> None:
    c = _scheduler_connector(_vllm_config(gqa_model, tmp_path / "s"), _kv_cache_config(_full(non_causal=True)))
    assert c.disabled_reason is not None and "non-causal" in c.disabled_reason


def test_reset_cache_stops_caching_in_this_process(tiny_model: Path, store_dir: Path) -> None:
    """vLLM resets connector caches after in-place weight updates: kvtier cannot see those,
    so the running engine stops using its store (a restarted one uses it again)."""
    p = tokens(600, seed=90)
    with Engine(tiny_model, kv_transfer_config(store_dir)) as e:
        e.generate([p], max_tokens=2)
        e.worker_connector._store.flush()
        assert e.generate([p], max_tokens=2)[0].num_cached_tokens > 0
        assert e.llm.reset_prefix_cache(reset_connector=True)
        assert e.generate([p], max_tokens=2)[0].num_cached_tokens == 0
    with Engine(tiny_model, kv_transfer_config(store_dir)) as e:
        assert e.generate([p], max_tokens=2)[0].num_cached_tokens == (600 - 1) // 32 * 32


def test_sliding_window_model_serves_and_is_cached_without_the_hybrid_manager(tiny_model: Path,
                                                                           tmp_path: Path) -> None:
    """One sliding-window layer beside a full-attention one. Under vLLM's hybrid manager (the
    default, which kvtier keeps on) the layers form two KV groups: kvtier sits out and the model
    serves. With ``disable_hybrid_kv_cache_manager`` vLLM keeps every token's KV for both (the
    window applies when attending): kvtier caches the whole prompt, with identical output."""
    model = tmp_path / "swa"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    (model / "config.json").write_text(json.dumps(cfg))
    prompt = tokens(640, seed=91)
    with Engine(tiny_model) as e:
        full_attention = e.generate([prompt], max_tokens=8)[0]
    with Engine(model) as e:
        base = e.generate([prompt], max_tokens=8)[0]
    assert base.tokens != full_attention.tokens  # the window is in effect
    store = tmp_path / "store"
    with Engine(model, kv_transfer_config(store)) as e:
        got = e.generate([prompt], max_tokens=8)[0]
        assert "2 KV-cache groups" in str(e.scheduler_connector.disabled_reason)
    assert got.tokens == base.tokens
    for expect in (0, (640 - 1) // 32 * 32):
        with Engine(model, kv_transfer_config(store), disable_hybrid_kv_cache_manager=True) as e:
            got = e.generate([prompt], max_tokens=8)[0]
            assert e.scheduler_connector.disabled_reason is None
            e.worker_connector._store.flush()
        assert got.num_cached_tokens == expect and got.tokens == base.tokens
