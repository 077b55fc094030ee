"""``--engine transformers``: compute a prompt's KV with the Hugging Face model's own forward
pass, without vLLM, and key it exactly as the connector would for that checkpoint.

The namespace comes from the connector's own functions (``identity_extras`` with vLLM's
default settings, ``weights_identity``, ``build_namespace``), so a server started on the same
model directory with default settings finds these chunks. Only model families whose attention
transformers and vLLM compute the same way are accepted; anything else is refused rather than
stored as KV that differs from what the server computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.errors import KVTierError
from kvtier.keys import Namespace
from kvtier.vllm.identity import weights_identity
from kvtier.vllm.namespace import KVGeometry, build_namespace, identity_extras
from kvtier.vllm.settings import ConnectorSettings

# Decoder families with standard rotary attention, identical in transformers and vLLM.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = (None, "default", "linear", "llama3")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class WarmupRefused(KVTierError):
    """This model or setting cannot be warmed up offline without risking KV that differs."""


def _rope_type(cfg: Any) -> str | None:
    for name in ("rope_parameters", "rope_scaling"):
        rope = getattr(cfg, name, None)
        if isinstance(rope, dict):
            return rope.get("rope_type") or rope.get("type")
    return None


def check_supported(cfg: Any) -> None:
    mt = getattr(cfg, "model_type", None)
    if mt not in MODEL_TYPES:
        raise WarmupRefused(
            f"model type {mt!r}: offline warm-up through transformers supports {', '.join(MODEL_TYPES)}; "
            "use --engine vllm for this model")
    rope = _rope_type(cfg)
    if rope not in ROPE_TYPES:
        raise WarmupRefused(
            f"rope type {rope!r}: its transformers and vLLM implementations are not known to give "
            "identical keys; use --engine vllm for this model")
    layer_types = set(getattr(cfg, "layer_types", None) or [])
    if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in layer_types:
        raise WarmupRefused("sliding-window attention: use --engine vllm for this model")


@dataclass
class HFModel:
    """A loaded model and the namespace its KV is stored under."""

    model: Any
    namespace: Namespace
    tokenizer: Any | None

    def kv(self, token_ids: list[int]) -> torch.Tensor:
        """The prompt's KV in kvtier's canonical layout ``[layers, 2, tokens, kv_heads, head_dim]``."""
        with torch.inference_mode():
            out = self.model(torch.tensor([token_ids]), use_cache=True)
        cache = out.past_key_values
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        # [batch=1, kv_heads, tokens, head_dim] -> [tokens, kv_heads, head_dim]
        kv = torch.stack([torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)]) for k, v in layers])
        return kv.to(self.namespace_dtype).contiguous()

    @property
    def namespace_dtype(self) -> torch.dtype:
        return DTYPES[self.namespace.dtype]

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise WarmupRefused("this model directory has no tokenizer; give prompt_token_ids instead")
        return list(self.tokenizer(text)["input_ids"])


def check_model(model: str) -> Any:
    """The model's HF config, or :class:`WarmupRefused` if it cannot be warmed up here."""
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise WarmupRefused("the transformers engine needs the transformers package: pip install "
                            f"transformers (vLLM brings it too) ({exc})") from None

    if not Path(model).is_dir():
        raise WarmupRefused(f"{model}: not a model directory (offline warm-up reads local files only)")
    try:
        cfg = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as exc:  # no config.json, or one without a model type
        raise WarmupRefused(
            f"{model}: not a Hugging Face model directory transformers can read ({_first_sentence(exc)}); "
            "pass the directory the server loads (with its config.json and weights)") from None
    check_supported(cfg)
    return cfg


def load(model: str, settings: ConnectorSettings, dtype: str = "auto", need_tokenizer: bool = True) -> HFModel:
    """Load the model; open the store at ``settings.cache.path`` first (the fingerprint cache
    is written into it)."""
    from transformers import AutoModelForCausalLM

    cfg = check_model(model)
    if dtype == "auto":
        dtype = str(getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or "bfloat16")
        dtype = dtype.removeprefix("torch.")
    if dtype not in DTYPES:
        raise WarmupRefused(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    geometry = KVGeometry(tuple(str(i) for i in range(cfg.num_hidden_layers)), 0, kv_heads, head_dim,
                          DTYPES[dtype])
    fingerprint = weights_identity(model, user_fingerprint=settings.weights_fingerprint,
                                   cache_file=settings.cache.path / "fingerprints.json")
    namespace = build_namespace(model, geometry, settings.cache.chunk_tokens, fingerprint,
                                identity_extras(hf_config=cfg), tp_rank=0, tp_size=1)
    tokenizer = None
    if need_tokenizer:  # before the weights: a refusal should not wait for them
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model)
        except (OSError, ValueError) as exc:  # no tokenizer files, or none transformers can build
            raise WarmupRefused(
                f"{model}: the model directory has no tokenizer transformers can load ({_first_sentence(exc)}); "
                "give the prompts as prompt_token_ids instead, or add the tokenizer files") from None
    try:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=DTYPES[dtype])
    except (OSError, ValueError) as exc:  # e.g. config.json without weight files
        raise WarmupRefused(f"{model}: cannot load the model's weights ({_first_sentence(exc)}); "
                            "pass the directory the server loads") from None
    hf.eval()
    return HFModel(hf, namespace, tokenizer)


def _first_sentence(exc: BaseException) -> str:
    """An exception's message up to its first sentence's end: transformers' messages run
    to several lines of advice that does not apply here."""
    text = " ".join(str(exc).split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]
