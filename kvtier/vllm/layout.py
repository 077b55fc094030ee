"""Conversion between vLLM's paged KV blocks and kvtier's canonical chunk layout.

vLLM hands connectors one tensor per attention layer, a standardized ``[B, H, N, C]`` view
(blocks, kv heads, tokens in a block, content). What ``C`` holds depends on the attention
backend:

* ``cpu`` (vLLM's CPU backend): per block and head, the memory is ``2N`` rows of ``head_dim``:
  K of the block's N tokens, then V (see ``cpu_attn.py``: ``view(B, H, 2N, D).chunk(2)``).
* ``kv_last`` (FlashAttention, FlashInfer, Triton): per token and head, ``C = [K | V]``
  (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``).

Both become a strided view ``[B, 2, N, H, D]`` of the same memory (no copy), so a chunk is
gathered or scattered block by block with plain ``copy_``; on CUDA the same calls run with
``non_blocking=True`` on a side stream into pinned host buffers. Canonical chunks are
``[layers, 2, tokens, kv_heads, head_dim]``, independent of the backend, so a cache written
through one backend is read through another.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CONTENT_LAYOUTS = ("cpu", "kv_last")

# Attention backend name (``AttentionBackend.get_name()``) -> content layout. Anything
# else turns the connector off.
BACKEND_CONTENT = {
    "CPU_ATTN": "cpu",
    "FLASH_ATTN": "kv_last",
    "FLASHINFER": "kv_last",
    "TRITON_ATTN": "kv_last",
}


class UnsupportedLayout(Exception):
    """The KV tensor cannot be viewed as blocks of per-token K and V without copying."""


def blocks_view(kv_layer: torch.Tensor, content: str, head_dim: int) -> torch.Tensor:
    """A ``[B, 2, N, H, D]`` view of one layer's paged KV (shares its memory)."""
    if kv_layer.dim() != 4:
        raise UnsupportedLayout(f"expected a 4-D [B, H, N, C] KV tensor, got shape {tuple(kv_layer.shape)}")
    b, h, n, c = kv_layer.shape
    if c != 2 * head_dim:
        raise UnsupportedLayout(f"content size {c} is not 2 * head_dim ({2 * head_dim})")
    try:
        if content == "cpu":
            # Per block and head the memory is [2, N, D]; needs [N, C] contiguous per (block, head).
            if kv_layer.stride(3) != 1 or kv_layer.stride(2) != c:
                raise UnsupportedLayout("CPU KV blocks are not contiguous per head")
            v = torch.as_strided(
                kv_layer, (b, h, 2, n, head_dim),
                (kv_layer.stride(0), kv_layer.stride(1), n * head_dim, head_dim, 1),
                kv_layer.storage_offset())
            return v.permute(0, 2, 3, 1, 4)
        if content == "kv_last":
            return kv_layer.unflatten(3, (2, head_dim)).permute(0, 3, 2, 1, 4)
    except RuntimeError as exc:
        raise UnsupportedLayout(str(exc)) from exc
    raise UnsupportedLayout(f"unknown content layout {content!r}")


def gather_blocks(view: torch.Tensor, block_ids: Sequence[int], out: torch.Tensor,
                  non_blocking: bool = False) -> None:
    """Copy blocks ``block_ids`` of a ``[B, 2, N, H, D]`` view into ``out`` ``[2, len*N, H, D]``.

    One gather and one copy per call: few Python-level operations matter, because the load
    and save paths share the interpreter with vLLM's busy engine loop.
    """
    n = view.shape[2]
    idx = torch.as_tensor(block_ids, dtype=torch.long, device=view.device)
    dst = out.view(2, len(block_ids), n, *out.shape[2:])
    dst.copy_(view.index_select(0, idx).transpose(0, 1), non_blocking=non_blocking)


def scatter_blocks(view: torch.Tensor, block_ids: Sequence[int], src: torch.Tensor,
                   non_blocking: bool = False) -> None:
    """Copy ``src`` ``[2, >=len*N, H, D]`` into blocks ``block_ids`` of a ``[B, 2, N, H, D]`` view."""
    n = view.shape[2]
    nb = len(block_ids)
    s = src.narrow(1, 0, nb * n).reshape(2, nb, n, *src.shape[2:]).transpose(0, 1)
    if s.device != view.device:
        s = s.to(view.device, non_blocking=non_blocking)
    idx = torch.as_tensor(block_ids, dtype=torch.long, device=view.device)
    view.index_copy_(0, idx, s)
