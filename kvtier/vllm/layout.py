"""Conversion between vLLM's paged KV blocks and kvtier's canonical chunk layout.

vLLM hands connectors one tensor per attention layer, a standardized ``[B, H, N, C]`` view
(blocks, kv heads, tokens in a block, content). What ``C`` holds depends on the attention
backend:

* ``cpu`` (vLLM's CPU backend): per block and head, the memory is a K region then a V region
  of ``N * head_dim`` each (``cpu_attn.py``: ``view(B, H, 2N, D).chunk(2)``). V is stored row
  by row (``[N, D]``); how K is stored depends on the kernel ISA the backend picked: its
  portable ``vec`` kernels store it transposed (``[D, N]``, layout ``cpu_kt``), others may store
  rows (``cpu``) or a packed form. :func:`probe_cpu_layout` finds out at start-up by writing
  known values through vLLM's own cache-write op; a layout it does not recognise turns the
  connector off.
* ``kv_last`` (FlashAttention, FlashInfer, Triton): per token and head, ``C = [K | V]``
  (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``).

Each becomes strided views ``[B, P, N, H, D]`` of the same memory (no copy; one view with P=2
for K and V together, or one per plane where their strides differ), through which
:mod:`kvtier.vllm.block_rows` gathers and scatters many chunks' blocks at once (on CUDA on a
side stream, to and from pinned host buffers). Canonical chunks are
``[layers, 2, tokens, kv_heads, head_dim]``, independent of the backend, so a cache written
through one backend is read through another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

CONTENT_LAYOUTS = ("cpu", "cpu_kt", "kv_last")


class PermutedBlocks(NamedTuple):
    """A CPU kernel layout with no strided form (e.g. the AMX kernels' packed K and V): each
    (block, head) region of ``2 * N * D`` elements, and where each canonical element is."""

    flat: torch.Tensor  # [B, H, 2 * N * D] view of the layer's KV
    perm: torch.Tensor  # long [2 * N * D]: canonical (k/v, token, dim) -> offset in the region
    n: int
    d: int


# Strided views [B, P, N, H, D] covering the K/V planes in order, or a permuted region.
LayerView = tuple[torch.Tensor, ...] | PermutedBlocks
# A content layout name, or the permutation a probe found (see probe_cpu_layout).
Content = str | torch.Tensor

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


def blocks_view(kv_layer: torch.Tensor, content: Content, head_dim: int) -> LayerView:
    """Views ``[B, P, N, H, D]`` of one layer's paged KV (sharing its memory), K plane first."""
    if kv_layer.dim() != 4:
        raise UnsupportedLayout(f"expected a 4-D [B, H, N, C] KV tensor, got shape {tuple(kv_layer.shape)}")
    b, h, n, c = kv_layer.shape
    if c != 2 * head_dim:
        raise UnsupportedLayout(f"content size {c} is not 2 * head_dim ({2 * head_dim})")
    try:
        permuted = isinstance(content, torch.Tensor)
        if permuted or content in ("cpu", "cpu_kt"):
            # Per block and head the memory is one region of N * C elements (K's, then V's).
            if kv_layer.stride(3) != 1 or kv_layer.stride(2) != c or (permuted and content.numel() != n * c):
                raise UnsupportedLayout("CPU KV blocks are not contiguous per head")
            sb, sh, off = kv_layer.stride(0), kv_layer.stride(1), kv_layer.storage_offset()
            if permuted:
                flat = torch.as_strided(kv_layer, (b, h, n * c), (sb, sh, 1), off)
                return PermutedBlocks(flat, content.to(kv_layer.device), n, head_dim)
            if content == "cpu":
                v = torch.as_strided(kv_layer, (b, h, 2, n, head_dim), (sb, sh, n * head_dim, head_dim, 1), off)
                return (v.permute(0, 2, 3, 1, 4),)
            k = torch.as_strided(kv_layer, (b, h, n, head_dim), (sb, sh, 1, n), off)
            v = torch.as_strided(kv_layer, (b, h, n, head_dim), (sb, sh, head_dim, 1), off + n * head_dim)
            return (k.permute(0, 2, 1, 3).unsqueeze(1), v.permute(0, 2, 1, 3).unsqueeze(1))
        if content == "kv_last":
            return (kv_layer.unflatten(3, (2, head_dim)).permute(0, 3, 2, 1, 4),)
    except RuntimeError as exc:
        raise UnsupportedLayout(str(exc)) from exc
    raise UnsupportedLayout(f"unknown content layout {content!r}")


def probe_cpu_layout(write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None],
                     block_size: int, head_dim: int, dtype: torch.dtype) -> Content | None:
    """Where ``write`` (vLLM's cache-write op for the backend's kernel ISA:
    ``write(key, value, key_cache, value_cache, slot_mapping)``) puts each K and V element of a
    block: ``"cpu"`` (rows), ``"cpu_kt"`` (K transposed), another permutation of the block's
    region as a tensor, or None when the write is not a plain placement of the values (a
    scaled or padded form kvtier cannot invert).

    Four writes into a scratch block: K, then V, holding each element's token index + 1, then
    its dim index + 1 (small integers, exact in every float dtype), the other plane zero.
    """
    n, d = block_size, head_dim
    if max(n, d) > 256:  # bf16 holds integers exactly only up to 256
        return None
    t_idx = torch.arange(1, n + 1, dtype=torch.float32)[:, None].expand(n, d)
    d_idx = torch.arange(1, d + 1, dtype=torch.float32)[None, :].expand(n, d)
    zero = torch.zeros(n, d)
    seen = []
    for k_val, v_val in ((t_idx, zero), (d_idx, zero), (zero, t_idx), (zero, d_idx)):
        cache = torch.zeros(1, 1, n, 2 * d, dtype=dtype)
        key_cache, value_cache = cache.view(1, 1, 2 * n, d).chunk(2, dim=2)
        write(k_val.to(dtype).reshape(n, 1, d).contiguous(), v_val.to(dtype).reshape(n, 1, d).contiguous(),
              key_cache, value_cache, torch.arange(n, dtype=torch.long))
        seen.append(cache.reshape(-1).float().round().long())
    k_t, k_d, v_t, v_d = seen
    in_k, in_v = (k_t > 0) & (k_d > 0), (v_t > 0) & (v_d > 0)
    if bool((in_k & in_v).any()) or int(in_k.sum()) != n * d or int(in_v.sum()) != n * d:
        return None
    plane = in_v.long()
    t = torch.where(in_k, k_t, v_t) - 1
    dd = torch.where(in_k, k_d, v_d) - 1
    if bool(((t < 0) | (t >= n) | (dd < 0) | (dd >= d)).any()):
        return None
    canonical = plane * n * d + t * d + dd  # canonical index of what each raw offset holds
    perm = torch.full((2 * n * d,), -1, dtype=torch.long)
    perm[canonical] = torch.arange(2 * n * d)
    if bool((perm < 0).any()):
        return None  # some element written twice, another never
    rows = torch.arange(2 * n * d)
    if torch.equal(perm, rows):
        return "cpu"
    k_cols = (torch.arange(d)[None, :] * n + torch.arange(n)[:, None]).reshape(-1)  # (t, d) at d*N + t
    if torch.equal(perm[: n * d], k_cols) and torch.equal(perm[n * d :], rows[n * d :]):
        return "cpu_kt"
    return perm
