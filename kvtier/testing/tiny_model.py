"""Build tiny Llama models with real random weights locally (no model hub involved).

Random weights (not vLLM's near-degenerate ``dummy`` ones) make generated tokens depend on
every KV value, so a wrong KV byte shows up as a different output.
"""

from __future__ import annotations

from pathlib import Path


def make_tiny_llama(path: str | Path, *, seed: int = 0, layers: int = 2, hidden: int = 128,
                    heads: int = 4, kv_heads: int = 2, vocab: int = 1024, max_len: int = 4096,
                    std: float = 0.2) -> Path:
    """Write a LlamaForCausalLM with random bf16 weights to ``path`` (idempotent)."""
    path = Path(path)
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=max_len, initializer_range=std,
        tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_lora(path: str | Path, base: str | Path, *, seed: int = 0, rank: int = 8,
                   targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj"), std: float = 0.5) -> Path:
    """Write a PEFT-format LoRA adapter for a tiny Llama at ``base`` (overwrites).

    Both A and B are random (PEFT starts B at zero), so the adapter changes K and V, and a
    stale adapter's KV shows up as a different output.
    """
    import json

    import torch
    from safetensors.torch import save_file

    path, cfg = Path(path), json.loads((Path(base) / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    out = {"q_proj": cfg["num_attention_heads"] * head_dim,
           "k_proj": cfg["num_key_value_heads"] * head_dim,
           "v_proj": cfg["num_key_value_heads"] * head_dim}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for t in targets:
            prefix = f"base_model.model.model.layers.{i}.self_attn.{t}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out[t], rank, generator=g) * std
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(targets),
        "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": str(base),
        "task_type": "CAUSAL_LM", "fan_in_fan_out": False,
    }))
    return path
