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
