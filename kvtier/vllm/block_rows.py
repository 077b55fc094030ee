"""Batched copies between a layer's paged KV blocks and canonical chunks.

A step saves or loads many chunks, each of many layers. Copying them chunk by chunk (an
index op, a layout copy and a host copy per chunk and layer: 1,536 device operations for a
16-chunk step of a 32-layer model) measured 17 GB/s on an H100 and, worse, blocked the
model's thread: those operations wait on the side stream behind the forward pass, and once
about a thousand are pending, CUDA blocks the thread that enqueues the next one until the
compute drains. So a batch of chunks is copied layer by layer through a device staging
tensor:

* save: one indexing op per layer gathers every chunk's blocks of that layer into the stage,
  already in canonical order (chunk, then K/V plane, then block), then one host copy per
  chunk moves its piece into its pinned buffer;
* load: one host copy per chunk (or per plane, when a partial chunk leaves a gap between its
  planes) into the stage, then one indexing op per layer puts every block in place.

That is ``1 + chunks`` operations per layer instead of ``3 * chunks``; measured on an H100,
a 16-chunk save ran at 40 GB/s against 17, and did not block with the forward pass queued.

Each copy between device and host memory also has a fixed cost (on an H200, raw 1 MiB copies
ran at 0.91x of the link's rate, 8 MiB ones at 0.99x), so on a GPU a load's stage holds
several layers of each chunk (``RowPlan.layers`` slots) laid out as its host buffer holds
them, and one copy moves a chunk's group of layers at once (saves go one layer at a time:
see ``WorkerSide``). A layer then goes through a scratch area: one gather, then
one ``index_copy_`` into its slot of every chunk (a load: the reverse).

To gather blocks with one op whatever the backend's strides, each strided view part
``[B, P, N, H, D]`` is seen as a table of rows ``[R, N, H, D]`` over the same memory: row
``b * block_step + p * plane_step`` is plane ``p`` of block ``b`` (the steps are the view's
strides over their common divisor, so rows overlap in memory; only the rows of real planes
are ever read or written). A packed CPU layout (:class:`~kvtier.vllm.layout.PermutedBlocks`)
has one row per block, permuted per chunk when it is converted.

A gather or scatter only moves bytes, so the tables and the stage are indexed as 16-byte
elements where their layout allows (:func:`widened`; else 8- or 4-byte ones): PyTorch's
indexing kernels do their work per element, and a bf16 row read as 16-byte elements is an
eighth of the elements. The bytes are the same. On this project's CPU machines, for a
Llama-3-8B layer of 16 chunks, the scatter (``index_copy_``) ran 1.4-1.9x faster with 16-byte
elements than with 8-byte ones and 1.7-2.5x faster than as bf16, and the gather the same
whatever the width; on a GPU, where each element is a thread's load, not yet measured.

The same code runs on the CPU, where the stage is a host tensor and each copy is immediate.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from kvtier.vllm.layout import LayerView, PermutedBlocks, UnsupportedLayout

# What one layer of a batch of chunks may take in the device stage by default: the stage holds
# that in each layer slot and in the scratch (see WorkerSide), and one chunk's every layer at
# least. 8 MiB holds 8 chunks of a Llama-3-8B rank (1 MiB per 256-token chunk and layer).
BATCH_BYTES = 8 << 20
# How large a load's copy from host to device memory should be: each copy has a fixed cost on
# a GPU, so a chunk's layers are copied several at a time, up to about this many bytes (on an
# H200, host-tier loads ran at 0.84x of the link this way, 0.77x one layer per copy).
COPY_BYTES = 8 << 20


class RowPlan(NamedTuple):
    """One batch of chunks as rows of a layer's tables, and where they go in the stage.

    The stage holds ``layers`` slots of every chunk, chunk after chunk: chunk ``c``'s region
    starts at ``layers * (rows of the chunks before it)`` and holds its layers' canonical rows
    one after the other, which is how a pooled host buffer holds them, so that ``layers``
    layers of a chunk move between device and host in one copy. A gather reads a layer's rows
    table after table into a scratch area past the slots, then puts each into its slot with
    one ``index_copy_`` (the slot's stage positions, ``slots``); with one slot and one table
    it reads straight into the stage (``slots`` None, no scratch)."""

    rows: list[torch.Tensor]  # per table: its row ids (long, on the device)
    slots: list[torch.Tensor] | None  # per layer slot: the stage row of each scratch row
    sizes: list[int]  # rows per chunk and layer
    blocks: list[int]  # blocks per chunk
    total: int  # rows per layer, all chunks
    layers: int  # layer slots per chunk
    stage_type: torch.dtype  # the stage's element type for moves between slots (see widened)

    @property
    def stage_rows(self) -> int:
        """Stage rows the batch takes: its slots, and the scratch (if any)."""
        return self.total * (self.layers + (self.slots is not None))


# The element types a table or the stage is indexed as, widest first. PyTorch has no 16-byte
# integer type: complex128 stands in, its values only ever moved, never computed with, so
# every bit pattern (NaN payloads, signalling NaNs) arrives as it left (tested bit for bit).
WIDE_TYPES = (torch.complex128, torch.int64, torch.int32)


def widened(t: torch.Tensor, types: Sequence[torch.dtype] = WIDE_TYPES) -> torch.Tensor:
    """``t``'s memory as the widest of ``types`` its strides and address allow (the last
    dimension contiguous, every other stride and the offset whole elements of the wider type,
    the first byte aligned to it), else ``t``: the same bytes, for copies that never read the
    values."""
    for wide in types:
        if wide.itemsize <= t.element_size():
            break
        # (``view`` checks the offset within the storage, not the address: memory PyTorch did
        # not allocate, e.g. from DLPack, may start anywhere, and a GPU's 16-byte loads fault
        # on a misaligned one)
        if t.data_ptr() % wide.itemsize:
            continue
        try:
            return t.view(wide)
        except RuntimeError:
            continue
    return t


def _as(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (part of the stage) seen with ``like``'s element type (a table's)."""
    return t if t.dtype == like.dtype else t.view(like.dtype)


def layer_groups(layers: int, per_copy: int, first: int | None = None) -> list[range]:
    """Layers ``0..layers`` in groups of ``per_copy`` (the first of ``first`` layers, if given:
    a load whose forward pass waits layer by layer starts with a small group)."""
    out, at = [], 0
    size = first or per_copy
    while at < layers:
        out.append(range(at, min(layers, at + size)))
        at += size
        size = per_copy
    return out


class BlockRows:
    """How a layout's blocks map to rows (built once per worker from a layer's view; every
    layer must share it) and the copies through the stage."""

    def __init__(self, view: LayerView) -> None:
        # a packed layout's permutation (the same for every layer): applied per chunk
        self._packed = view if isinstance(view, PermutedBlocks) else None
        self.permuted = self._packed is not None
        sample = view.flat if isinstance(view, PermutedBlocks) else view[0]
        self.dtype, self.device = sample.dtype, sample.device  # (the stage's)
        if isinstance(view, PermutedBlocks):
            self.block_size = view.n
            self.row_shape = tuple(view.flat.shape[1:])
            self._parts: list[tuple[int, int, int, int]] = [(1, 0, 1, 0)]
            self.planes = 2
            return
        self._parts = []  # per view part: block_step, plane_step, planes, first plane
        plane = 0
        for v in view:
            b, p = v.shape[:2]
            sb, sp = v.stride(0), v.stride(1) if p > 1 else 0
            unit = math.gcd(sb, sp) if sp else sb
            self._parts.append((sb // unit, sp // unit, p, plane))
            plane += p
        self.planes = plane
        self.row_shape = tuple(view[0].shape[2:])
        self.block_size = view[0].shape[2]

    @functools.cached_property
    def stage_type(self) -> torch.dtype:
        """The stage's element type for moves between its slots: it is contiguous, so only
        its rows' last dimension decides (decided once, not per copy)."""
        return widened(torch.empty((1, *self.row_shape), dtype=self.dtype, device="meta")).dtype

    def tables(self, view: LayerView) -> list[torch.Tensor]:
        """One layer's view as row tables (views of its memory, :func:`widened`; built once
        per layer)."""
        if isinstance(view, PermutedBlocks):
            return [widened(view.flat)]
        out = []
        for v, (block_step, plane_step, planes, _) in zip(view, self._parts, strict=True):
            unit = v.stride(0) // block_step
            if unit * block_step != v.stride(0) or (planes > 1 and v.stride(1) != plane_step * unit):
                raise UnsupportedLayout("the KV cache's layers do not share one layout")
            rows = (v.shape[0] - 1) * block_step + (planes - 1) * plane_step + 1
            out.append(widened(torch.as_strided(v, (rows, *v.shape[2:]), (unit, *v.stride()[2:]),
                                                v.storage_offset())))
        return out

    # -- planning (host side: lists uploaded once per step) -----------------------------
    def rows_per_chunk(self, blocks: int) -> int:
        return blocks if self.permuted else blocks * self.planes

    def layers_per_copy(self, layer_bytes: int, layers: int, copy_bytes: int) -> int:
        """Layer slots per chunk: enough that a copy of a chunk's layers is about
        ``copy_bytes`` (``layer_bytes``: one layer of a whole chunk); one for a packed layout,
        whose layers are converted one by one on their way to host memory."""
        if self.permuted:
            return 1
        return max(1, min(layers, -(-copy_bytes // max(1, layer_bytes))))

    def scratch(self, layers: int) -> bool:
        """Whether a batch with ``layers`` slots goes through the scratch area."""
        return layers > 1 or len(self._parts) > 1

    def batches(self, block_lists: Sequence[Sequence[int]], stage_rows: int, layers: int = 1) -> list[list[int]]:
        """Split chunks (their block ids) into batches whose rows, with ``layers`` slots,
        fit the stage: indices (a batch holds one chunk at least)."""
        per_row = layers + self.scratch(layers)
        out: list[list[int]] = []
        used = 0
        for i, ids in enumerate(block_lists):
            need = self.rows_per_chunk(len(ids)) * per_row
            if not out or used + need > stage_rows:
                out.append([])
                used = 0
            out[-1].append(i)
            used += need
        return out

    def id_lists(self, block_lists: Sequence[Sequence[int]],
                 layers: int = 1) -> tuple[list[Sequence[int]], list[int]]:
        """The lists to upload for one batch with ``layers`` slots: each table's row ids,
        then (through the scratch) each slot's stage rows; and the rows per chunk.

        The row ids in plain Python, not numpy: a save plans on the model's thread while
        kvtier's writer thread works, and a numpy operation on 500 elements or more lets go
        of the GIL, which the writer then holds a while. Built with whole-array numpy
        operations, a 16-chunk save's 512 ids took 24 µs against 43 µs with the store
        idle, but 0.15 ms against 0.06 ms among a running store's writes (this project's
        2-core VMs; see docs/benchmarks.md)."""
        sizes = [self.rows_per_chunk(len(ids)) for ids in block_lists]
        lists: list[Sequence[int]] = []
        slotted = self.scratch(layers)
        # per scratch row (through the scratch only): its stage row in slot 0, and the
        # distance between its slots (its chunk's rows per layer)
        slot0: list[int] = []
        step: list[int] = []
        for block_step, plane_step, planes, first in self._parts:
            rows, base = [], 0
            for ids, size in zip(block_lists, sizes, strict=True):
                nb = len(ids)
                for p in range(planes):
                    rows.extend(b * block_step + p * plane_step for b in ids)
                    if slotted:
                        start = base * layers + (first + p) * nb
                        slot0.extend(range(start, start + nb))
                if slotted:
                    step.extend([size] * (planes * nb))
                base += size
            lists.append(rows)
        if slotted:  # (numpy: a step's slot lists are thousands of ids)
            at, apart = np.asarray(slot0, dtype=np.int64), np.asarray(step, dtype=np.int64)
            lists.extend(at + slot * apart for slot in range(layers))
        return lists, sizes

    def plan(self, block_lists: Sequence[Sequence[int]], uploaded: list[torch.Tensor], sizes: list[int],
             layers: int = 1) -> RowPlan:
        tables = len(self._parts)
        slots = list(uploaded[tables:]) if self.scratch(layers) else None
        return RowPlan(list(uploaded[:tables]), slots, sizes, [len(ids) for ids in block_lists], sum(sizes), layers,
                       self.stage_type)

    # -- copies (enqueued on the caller's stream) ---------------------------------------
    @staticmethod
    def gather(tables: list[torch.Tensor], plan: RowPlan, stage: torch.Tensor, slot: int = 0) -> None:
        """Every chunk of ``plan`` from one layer's tables into layer slot ``slot`` of the
        stage (the batch's part of it, which starts at row 0)."""
        if plan.slots is None:
            torch.index_select(tables[0], 0, plan.rows[0], out=_as(stage.narrow(0, 0, plan.total), tables[0]))
            return
        scratch = stage.narrow(0, plan.layers * plan.total, plan.total)
        at = 0
        for table, rows in zip(tables, plan.rows, strict=True):
            torch.index_select(table, 0, rows, out=_as(scratch.narrow(0, at, rows.shape[0]), table))
            at += rows.shape[0]
        slots = stage.narrow(0, 0, plan.layers * plan.total).view(plan.stage_type)
        slots.index_copy_(0, plan.slots[slot], scratch.view(plan.stage_type))

    @staticmethod
    def scatter(tables: list[torch.Tensor], plan: RowPlan, stage: torch.Tensor, slot: int = 0) -> None:
        """Layer slot ``slot`` of the stage into one layer's tables (the inverse of
        :meth:`gather`)."""
        if plan.slots is None:
            tables[0].index_copy_(0, plan.rows[0], _as(stage.narrow(0, 0, plan.total), tables[0]))
            return
        scratch = stage.narrow(0, plan.layers * plan.total, plan.total)
        slots = stage.narrow(0, 0, plan.layers * plan.total).view(plan.stage_type)
        torch.index_select(slots, 0, plan.slots[slot], out=scratch.view(plan.stage_type))
        at = 0
        for table, rows in zip(tables, plan.rows, strict=True):
            table.index_copy_(0, rows, _as(scratch.narrow(0, at, rows.shape[0]), table))
            at += rows.shape[0]

    def regions(self, stage: torch.Tensor, plan: RowPlan, count: int = 1) -> list[torch.Tensor]:
        """Each chunk's first ``count`` layer slots of the stage, as
        :meth:`to_chunk` and :meth:`from_chunk` take them (made once per batch and group).
        A strided layout's are the chunk's canonical layers ``[count, 2, blocks*N, H, D]``
        already; a packed layout's (one slot) its rows ``[blocks, H, 2*N*D]``."""
        out, at = [], 0
        for size, blocks in zip(plan.sizes, plan.blocks, strict=True):
            region = stage.narrow(0, at, count * size)
            out.append(region if self.permuted else
                       region.view(count, self.planes, blocks * self.block_size, *self.row_shape[1:]))
            at += size * plan.layers
        return out

    def to_chunk(self, region: torch.Tensor, blocks: int, out: torch.Tensor, non_blocking: bool) -> None:
        """A chunk's stage region (see :meth:`regions`) into its canonical layers ``out``
        ``[count, 2, blocks*N, H, D]`` (a pooled buffer's, contiguous): one copy."""
        if self._packed is not None:
            n, d = self._packed.n, self._packed.d
            heads = region.shape[1]
            canon = region.index_select(2, self._packed.perm).view(blocks, heads, 2, n, d).permute(2, 0, 3, 1, 4)
            out.view(2, blocks, n, heads, d).copy_(canon, non_blocking=non_blocking)
            return
        out.copy_(region, non_blocking=non_blocking)

    def from_chunk(self, src: torch.Tensor, blocks: int, region: torch.Tensor, non_blocking: bool) -> None:
        """Canonical layers ``src`` ``[count, 2, >=blocks*N, H, D]`` (host) into a chunk's stage
        region. A strided host source would be copied through a new pageable tensor, whose
        copy to a GPU waits for the stream: a source with gaps (a load that skips leading
        blocks or stops short) goes layer by layer and plane by plane, each piece straight
        from the buffer."""
        tokens = blocks * self.block_size
        if src.shape[2] != tokens:
            src = src.narrow(2, 0, tokens)
        if self._packed is not None:
            n, d = self._packed.n, self._packed.d
            heads = region.shape[1]
            s = src.reshape(2, blocks, n, heads, d).permute(1, 3, 0, 2, 4).reshape(blocks, heads, 2 * n * d)
            region.index_copy_(2, self._packed.perm, s.to(region.device, non_blocking=non_blocking))
            return
        if src.is_contiguous():
            region.copy_(src, non_blocking=non_blocking)
            return
        for layer, part in zip(src, region, strict=True):
            for k in range(layer.shape[0]):
                part[k].copy_(layer[k], non_blocking=non_blocking)


def gather_blocks(view: LayerView, block_ids: Sequence[int], out: torch.Tensor) -> None:
    """Copy blocks ``block_ids`` of a layer's view into ``out`` ``[2, len*N, H, D]``: one chunk
    through the batched path, with a stage of its own (tools and tests; the worker batches)."""
    rows, stage, plan = _one_chunk(view, block_ids)
    BlockRows.gather(rows.tables(view), plan, stage)
    rows.to_chunk(rows.regions(stage, plan)[0], len(block_ids), out.unsqueeze(0), non_blocking=False)


def scatter_blocks(view: LayerView, block_ids: Sequence[int], src: torch.Tensor) -> None:
    """Copy ``src`` ``[2, >=len*N, H, D]`` into blocks ``block_ids`` of a layer's view."""
    rows, stage, plan = _one_chunk(view, block_ids)
    rows.from_chunk(src.unsqueeze(0), len(block_ids), rows.regions(stage, plan)[0], non_blocking=False)
    BlockRows.scatter(rows.tables(view), plan, stage)


def _one_chunk(view: LayerView, block_ids: Sequence[int]) -> tuple[BlockRows, torch.Tensor, RowPlan]:
    rows = BlockRows(view)
    lists, sizes = rows.id_lists([list(block_ids)])
    plan = rows.plan([block_ids], [torch.tensor(ids, dtype=torch.long, device=rows.device) for ids in lists], sizes)
    return rows, torch.empty((plan.stage_rows, *rows.row_shape), dtype=rows.dtype, device=rows.device), plan
