"""Build kvtier namespaces and request extras from vLLM's configuration and requests."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvtier.codec import dtype_name
from kvtier.fingerprint import resolve_model_dir, weights_fingerprint
from kvtier.keys import Namespace, RequestExtras
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
        return None, f"{len(groups)} KV-cache groups (hybrid attention/mamba models are not supported)"
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec:
        return None, f"KV-cache spec {type(spec).__name__} (only full attention is supported)"
    if getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None):
        return None, "sliding-window or chunked-local attention"
    head_v = getattr(spec, "head_size_v", None)
    if head_v not in (None, spec.head_size):
        return None, "K and V head sizes differ"
    quant = getattr(spec, "kv_quant_mode", None)
    if quant is not None and int(quant) != 0:
        return None, f"quantized KV cache ({quant})"
    return KVGeometry(tuple(groups[0].layer_names), spec.block_size, spec.num_kv_heads,
                      spec.head_size, spec.dtype), ""


def model_fingerprint(vllm_config: Any, settings: ConnectorSettings) -> str:
    """The weights fingerprint: configured, else hashed from the local weight files."""
    if settings.weights_fingerprint:
        return settings.weights_fingerprint
    mc = vllm_config.model_config
    load_format = str(getattr(vllm_config.load_config, "load_format", "auto"))
    model_dir = resolve_model_dir(mc.model, getattr(mc, "revision", None))
    if load_format == "dummy":
        # Dummy weights are generated from a fixed seed from the config alone.
        return "dummy:" + (weights_fingerprint_config(model_dir) if model_dir else mc.model)
    if model_dir is None:
        log.warning("kvtier: cannot find %s's weight files to fingerprint; keying by name and "
                    "revision only (set weights_fingerprint to be safe)", mc.model)
        return f"unresolved:{mc.model}@{getattr(mc, 'revision', None)}"
    return weights_fingerprint(model_dir, settings.cache.path / "fingerprints.json")


def weights_fingerprint_config(model_dir: Any) -> str:
    import hashlib
    from pathlib import Path

    cfg = Path(model_dir) / "config.json"
    return hashlib.sha256(cfg.read_bytes()).hexdigest() if cfg.exists() else "no-config"


def build_namespace(vllm_config: Any, geometry: KVGeometry, settings: ConnectorSettings,
                    fingerprint: str, tp_rank: int) -> Namespace:
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    extra = {
        "revision": str(getattr(mc, "revision", None)),
        "quantization": str(getattr(mc, "quantization", None)),
        "kv_cache_dtype": str(getattr(vllm_config.cache_config, "cache_dtype", "auto")),
        "hf_overrides": str(getattr(mc, "hf_overrides", None) or ""),
    }
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


def request_extras(request: Any) -> RequestExtras | None:
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
        lora_id = f"{lora.lora_name}|{getattr(lora, 'lora_path', '')}|{lora.lora_int_id}"
    return RequestExtras(cache_salt=getattr(request, "cache_salt", None), lora=lora_id,
                         mm_hashes=tuple(mm))
