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
for K and V together, or one per plane where their strides differ), so a chunk is
gathered or scattered block by block with plain ``copy_``; on CUDA the same calls run with
``non_blocking=True`` on a side stream into pinned host buffers. Canonical chunks are
``[layers, 2, tokens, kv_heads, head_dim]``, independent of the backend, so a cache written
through one backend is read through another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def block_index(block_ids: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    """Block ids as a long tensor on ``device``: as given if already one (the worker uploads
    a step's ids once, see :class:`kvtier.vllm.device.StepIndex`), else converted here."""
    if isinstance(block_ids, torch.Tensor):
        return block_ids
    return torch.as_tensor(block_ids, dtype=torch.long, device=device)


def gather_blocks(view: LayerView, block_ids: torch.Tensor | Sequence[int], out: torch.Tensor,
                  non_blocking: bool = False) -> None:
    """Copy blocks ``block_ids`` of a layer's views into ``out`` ``[2, len*N, H, D]``.

    One gather and one copy per view: few Python-level operations matter, because the load
    and save paths share the interpreter with vLLM's busy engine loop.
    """
    if isinstance(view, PermutedBlocks):
        idx = block_index(block_ids, view.flat.device)
        nb = idx.numel()
        g = view.flat.index_select(0, idx).index_select(2, view.perm)  # [nb, H, 2*N*D] canonical
        g = g.view(nb, -1, 2, view.n, view.d).permute(2, 0, 3, 1, 4)
        out.view(2, nb, view.n, *out.shape[2:]).copy_(g, non_blocking=non_blocking)
        return
    idx = block_index(block_ids, view[0].device)
    nb = idx.numel()
    plane = 0
    for v in view:
        n, p = v.shape[2], v.shape[1]
        dst = out.narrow(0, plane, p).view(p, nb, n, *out.shape[2:])
        dst.copy_(v.index_select(0, idx).transpose(0, 1), non_blocking=non_blocking)
        plane += p


def scatter_blocks(view: LayerView, block_ids: torch.Tensor | Sequence[int], src: torch.Tensor,
                   non_blocking: bool = False) -> None:
    """Copy ``src`` ``[2, >=len*N, H, D]`` into blocks ``block_ids`` of a layer's views."""
    if isinstance(view, PermutedBlocks):
        idx = block_index(block_ids, view.flat.device)
        nb = idx.numel()
        n, heads = view.n, view.flat.shape[1]
        s = src.narrow(1, 0, nb * n).reshape(2, nb, n, heads, view.d).permute(1, 3, 0, 2, 4)
        s = s.reshape(nb, heads, 2 * n * view.d).to(view.flat.device)
        raw = torch.empty_like(s).index_copy_(2, view.perm, s)
        view.flat.index_copy_(0, idx, raw)
        return
    idx = block_index(block_ids, view[0].device)
    nb = idx.numel()
    plane = 0
    for v in view:
        n, p = v.shape[2], v.shape[1]
        part = src.narrow(0, plane, p).narrow(1, 0, nb * n)
        if part.device != v.device:
            part = _planes_to(part, v.device, non_blocking)
        v.index_copy_(0, idx, part.reshape(p, nb, n, *src.shape[2:]).transpose(0, 1))
        plane += p


def _planes_to(planes: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    """``planes`` ``[P, T, ...]`` copied to ``device``: in one copy if it is contiguous, else
    one per plane. A chunk's planes are contiguous each, but a load that skips leading blocks
    or stops short of the chunk's end leaves gaps between them, and a strided host tensor is
    copied through a new pageable one, whose copy to a GPU waits for the stream (and the side
    stream waits for the forward pass): the model's thread would block once per layer."""
    if planes.is_contiguous():
        return planes.to(device, non_blocking=non_blocking)
    out = torch.empty(planes.shape, dtype=planes.dtype, device=device)
    for k in range(planes.shape[0]):
        out[k].copy_(planes[k], non_blocking=non_blocking)
    return out
