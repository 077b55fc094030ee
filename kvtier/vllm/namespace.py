"""Build kvtier namespaces and request extras from vLLM's configuration and requests."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from kvtier.codec import dtype_name
from kvtier.keys import Namespace, RequestExtras
from kvtier.vllm.identity import LoraFingerprints, config_digest, load_format_name

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
    """Namespace extras that change the KV bytes beyond weights and geometry, from vLLM's config.

    Computed once, when the connector is created, so every process derives the same
    namespace; the scheduler's ids also travel to the workers with each step's metadata.
    """
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    lc = vllm_config.load_config
    mm = getattr(mc, "multimodal_config", None)
    spec = getattr(vllm_config, "speculative_config", None)
    revision = getattr(getattr(mc, "revision", None), "resolved", None) or getattr(mc, "revision", None)
    return identity_extras(
        hf_config=getattr(mc, "hf_config", None),
        revision=revision, code_revision=getattr(mc, "code_revision", None),
        model_impl=getattr(mc, "model_impl", "auto"), quantization=getattr(mc, "quantization", None),
        kv_cache_dtype=getattr(vllm_config.cache_config, "cache_dtype", "auto"),
        load_format=load_format_name(lc), ignore_patterns=getattr(lc, "ignore_patterns", None),
        model_loader_extra_config=getattr(lc, "model_loader_extra_config", None),
        dcp_size=getattr(pc, "decode_context_parallel_size", 1),
        pcp_size=getattr(pc, "prefill_context_parallel_size", 1),
        mm_processor_kwargs=getattr(mm, "mm_processor_kwargs", None),
        speculative=f"{getattr(spec, 'method', None)}:{getattr(spec, 'model', None)}" if spec else "",
        max_model_len=getattr(mc, "max_model_len", None))


def identity_extras(*, hf_config: Any, revision: Any = None, code_revision: Any = None,
                    model_impl: Any = "auto", quantization: Any = None, kv_cache_dtype: Any = "auto",
                    load_format: str = "auto", ignore_patterns: Any = ("original/**/*",),
                    model_loader_extra_config: Any = None, dcp_size: Any = 1, pcp_size: Any = 1,
                    mm_processor_kwargs: Any = None, speculative: str = "",
                    max_model_len: Any = None) -> dict[str, str]:
    """The one place that turns engine settings into namespace extras. The defaults are
    vLLM's, so offline warm-up without vLLM (``kvtier.warmup``) derives the namespace a
    server started with default settings derives."""
    extra = model_loader_extra_config or {}
    if not isinstance(extra, dict):  # a TensorizerConfig object
        extra = getattr(extra, "__dict__", {"value": str(extra)})
    if isinstance(ignore_patterns, tuple):
        ignore_patterns = list(ignore_patterns)
    identity = {
        "revision": str(revision),
        "code_revision": str(code_revision),
        "model_impl": str(getattr(model_impl, "value", model_impl)),
        "quantization": str(quantization),
        "kv_cache_dtype": str(kv_cache_dtype),
        # The config the engine built, overrides applied (rope scaling, sliding window, ...).
        "hf_config": config_digest(hf_config),
        # Loader options that change which weights are loaded from the same files.
        "load_format": load_format,
        "ignore_patterns": json.dumps(ignore_patterns, default=str),
        "model_loader_extra_config": json.dumps(extra, sort_keys=True, default=str),
        # Context parallelism shards each block's tokens across ranks (kvtier refuses > 1,
        # see compat.py; keyed anyway so a future change cannot mix layouts).
        "dcp_size": str(dcp_size),
        "pcp_size": str(pcp_size),
        # Engine-wide multimodal processing options change the embeddings the KV comes from.
        "mm_processor_kwargs": json.dumps(mm_processor_kwargs, sort_keys=True, default=str),
        # A drafter's layers share the KV cache group.
        "speculative": speculative,
    }
    if _uses_long_rope(hf_config):
        # LongRoPE picks its short or long factors from max_model_len: it changes every K.
        identity["max_model_len"] = str(max_model_len)
    return identity


def _uses_long_rope(cfg: Any) -> bool:
    for name in ("rope_scaling", "rope_parameters"):
        rope = getattr(cfg, name, None)
        if isinstance(rope, dict) and "longrope" in (str(rope.get("rope_type")), str(rope.get("type"))):
            return True
    return False


def build_namespace(model: str, geometry: KVGeometry, chunk_tokens: int, fingerprint: str,
                    identity: dict[str, str], tp_rank: int, tp_size: int) -> Namespace:
    """The namespace of one tensor-parallel rank (the connector's and warm-up's)."""
    return Namespace(
        model=model,
        weights_fingerprint=fingerprint,
        dtype=dtype_name(geometry.dtype),
        kv_shape=(len(geometry.layer_names), 2, geometry.num_kv_heads, geometry.head_size),
        chunk_tokens=chunk_tokens,
        tp_rank=tp_rank,
        tp_size=tp_size,
        extra=tuple(sorted(identity.items())),
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
