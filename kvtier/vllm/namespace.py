"""Build kvtier namespaces and request extras from vLLM's configuration and requests."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from kvtier.codec import dtype_name
from kvtier.keys import Namespace, RequestExtras
from kvtier.vllm.identity import LoraFingerprints, config_digest, loader_identity
from kvtier.vllm.settings import ConnectorSettings

log = logging.getLogger("kvtier")


@dataclass(frozen=True)
class KVGeometry:
    """The attention KV this connector handles: one group of full-attention layers."""

    layer_names: tuple[str, ...]
    block_size: int
    num_kv_heads: int  # this rank's heads
    head_size: int
    dtype: Any  # torch.dtype


def kv_geometry(kv_cache_config: Any) -> tuple[KVGeometry | None, str]:
    """The geometry, or None and the reason this model's KV is not handled."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if len(groups) != 1:
        return None, (f"{len(groups)} KV-cache groups (a hybrid model under vLLM's hybrid KV manager: "
                      "mamba or sliding-window layers in their own groups); for sliding-window models "
                      "start vLLM with --disable-hybrid-kv-cache-manager to cache them")
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec:
        return None, f"KV-cache spec {type(spec).__name__} (only full attention is supported)"
    # A FullAttentionSpec may carry a sliding_window or attention_chunk_size: vLLM promotes
    # local-attention layers of a mixed model to full-attention *allocation* when the hybrid
    # manager is off, so every token's KV is kept (kv_cache_utils._promote_local_kv_cache_specs)
    # and can be cached; the window still applies when attending. Models whose every layer is
    # local keep a SlidingWindowSpec (blocks behind the window are freed) and are refused above.
    head_v = getattr(spec, "head_size_v", None)
    if head_v not in (None, spec.head_size):
        return None, "K and V head sizes differ"
    if getattr(spec, "non_causal", False):
        return None, "non-causal attention (a token's KV depends on later tokens)"
    quant = getattr(spec, "kv_quant_mode", None)
    if quant is not None and int(quant) != 0:
        return None, f"quantized KV cache ({quant})"
    return KVGeometry(tuple(groups[0].layer_names), spec.block_size, spec.num_kv_heads,
                      spec.head_size, spec.dtype), ""


def model_identity(vllm_config: Any) -> dict[str, str]:
    """Namespace extras that change the KV bytes beyond weights and geometry.

    Computed once, when the connector is created (before the worker loads the model, which
    may touch the config), so the scheduler and every worker derive the same namespace.
    """
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    mm = getattr(mc, "multimodal_config", None)
    spec = getattr(vllm_config, "speculative_config", None)
    identity = {
        "revision": str(getattr(getattr(mc, "revision", None), "resolved", None) or getattr(mc, "revision", None)),
        "code_revision": str(getattr(mc, "code_revision", None)),
        "model_impl": str(getattr(mc, "model_impl", "auto")),
        "quantization": str(getattr(mc, "quantization", None)),
        "kv_cache_dtype": str(getattr(vllm_config.cache_config, "cache_dtype", "auto")),
        # The config vLLM built, overrides applied (rope scaling, sliding window, ...).
        "hf_config": config_digest(mc),
        **loader_identity(vllm_config),
        # Context parallelism shards each block's tokens across ranks (kvtier refuses > 1,
        # see compat.py; keyed anyway so a future change cannot mix layouts).
        "dcp_size": str(getattr(pc, "decode_context_parallel_size", 1)),
        "pcp_size": str(getattr(pc, "prefill_context_parallel_size", 1)),
        # Engine-wide multimodal processing options change the embeddings the KV comes from.
        "mm_processor_kwargs": json.dumps(getattr(mm, "mm_processor_kwargs", None), sort_keys=True, default=str),
        # A drafter's layers share the KV cache group.
        "speculative": f"{getattr(spec, 'method', None)}:{getattr(spec, 'model', None)}" if spec else "",
    }
    if _uses_long_rope(mc):
        # LongRoPE picks its short or long factors from max_model_len: it changes every K.
        identity["max_model_len"] = str(getattr(mc, "max_model_len", None))
    return identity


def _uses_long_rope(model_config: Any) -> bool:
    cfg = getattr(model_config, "hf_config", None)
    for name in ("rope_scaling", "rope_parameters"):
        rope = getattr(cfg, name, None)
        if isinstance(rope, dict) and "longrope" in (str(rope.get("rope_type")), str(rope.get("type"))):
            return True
    return False


def build_namespace(vllm_config: Any, geometry: KVGeometry, settings: ConnectorSettings,
                    fingerprint: str, identity: dict[str, str], tp_rank: int) -> Namespace:
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    extra = dict(identity)
    return Namespace(
        model=str(mc.model),
        weights_fingerprint=fingerprint,
        dtype=dtype_name(geometry.dtype),
        kv_shape=(len(geometry.layer_names), 2, geometry.num_kv_heads, geometry.head_size),
        chunk_tokens=settings.cache.chunk_tokens,
        tp_rank=tp_rank,
        tp_size=int(pc.tensor_parallel_size),
        extra=tuple(sorted(extra.items())),
    )


def request_extras(request: Any, loras: LoraFingerprints) -> RequestExtras | None:
    """The request's key extras, or None if it has inputs kvtier cannot key."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    mm = []
    for f in getattr(request, "mm_features", None) or []:
        ident = getattr(f, "identifier", None)
        pos = getattr(f, "mm_position", None)
        if not ident or pos is None:
            return None
        mm.append((str(ident), int(pos.offset)))
    lora = getattr(request, "lora_request", None)
    lora_id = None
    if lora is not None:
        lora_id = loras.fingerprint(lora)
        if lora_id is None:
            return None  # an adapter whose weights cannot be fingerprinted is never cached
    return RequestExtras(cache_salt=getattr(request, "cache_salt", None), lora=lora_id,
                         mm_hashes=tuple(mm))
