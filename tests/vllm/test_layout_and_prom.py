"""Paged-layout conversion for every content layout, and the Prometheus counters."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvtier.vllm.block_rows import BlockRows, gather_blocks, scatter_blocks
from kvtier.vllm.layout import CONTENT_LAYOUTS, UnsupportedLayout, blocks_view

B, H, N, D = 6, 2, 32, 16


def _k_and_v(kv: torch.Tensor, content: str, block: int, head: int, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one token, read the way the attention backend itself reads them."""
    if content == "cpu":  # cpu_attn.py: view(B, H, 2N, D).chunk(2, dim=2), K rows
        k, v = kv.view(B, H, 2 * N, D).chunk(2, dim=2)
        return k[block, head, token], v[block, head, token]
    if content == "cpu_kt":  # the same regions, K stored [D, N] (the 'vec' kernels)
        k, v = kv.reshape(B, H, 2, N * D).unbind(2)
        return k.view(B, H, D, N)[block, head, :, token], v.view(B, H, N, D)[block, head, token]
    k, v = kv.transpose(1, 2).split(D, dim=-1)  # flash_attn.py / triton_attn.py
    return k[block, token, head], v[block, token, head]


@pytest.mark.parametrize("content", CONTENT_LAYOUTS)
def test_blocks_round_trip_through_the_canonical_layout(content: str) -> None:
    kv = torch.randn(B, H, N, 2 * D)
    view = blocks_view(kv, content, D)
    out = torch.empty(2, 2 * N, H, D)  # [k/v, tokens, heads, dim] of blocks 4 then 1
    gather_blocks(view, [4, 1], out)
    for j, block in enumerate((4, 1)):
        for token in (0, 7, N - 1):
            k, v = _k_and_v(kv, content, block, 1, token)
            assert torch.equal(out[0, j * N + token, 1], k)
            assert torch.equal(out[1, j * N + token, 1], v)
    restored = torch.zeros_like(kv)
    scatter_blocks(blocks_view(restored, content, D), [4, 1], out)
    assert torch.equal(restored[4], kv[4]) and torch.equal(restored[1], kv[1])
    assert not restored[[0, 2, 3, 5]].any()  # no other block touched


def test_a_partial_chunk_goes_to_the_device_plane_by_plane(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load that skips leading blocks leaves gaps between the K and V planes of the source:
    it is copied one contiguous plane at a time (on a GPU, each straight from the pinned
    buffer; tests/gpu checks the host does not wait), and lands whole."""
    chunk = torch.randn(2, 4 * N, H, D)  # a pooled chunk's [k/v, tokens, heads, dim]
    part = chunk.narrow(1, N, 2 * N)  # skip one block, stop one short
    assert not part.is_contiguous() and all(part[k].is_contiguous() for k in range(2))
    kv = torch.zeros(B, H, N, 2 * D)
    view = blocks_view(kv, "kv_last", D)
    sources = []
    copy = torch.Tensor.copy_

    def watched(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        sources.append(src.is_contiguous())
        return copy(dst, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", watched)
    scatter_blocks(view, [5, 2], part)
    monkeypatch.undo()
    assert sources == [True, True]  # two planes, each contiguous: no strided host copy
    out = torch.empty(2, 2 * N, H, D)
    gather_blocks(view, [5, 2], out)
    assert torch.equal(out, part)


@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("content", CONTENT_LAYOUTS)
def test_a_batch_of_chunks_is_copied_with_one_gather_per_layer(content: str, layers: int) -> None:
    """Several chunks of different lengths, in one batch, ``layers`` layers at a time: each
    layer's gather fills its slot of every chunk, each chunk's region is its canonical
    layers one after the other (what one copy moves to its host buffer), and the inverse
    puts every block of every layer back; a stage too small for all of them splits the
    batch."""
    kvs = [torch.randn(B, H, N, 2 * D) for _ in range(layers)]
    views = [blocks_view(kv, content, D) for kv in kvs]
    rows = BlockRows(views[0])
    slots = layers if not rows.permuted else 1
    chunks = [[4, 1], [3], [0, 5, 2]]
    lists, sizes = rows.id_lists(chunks, slots)
    plan = rows.plan(chunks, [torch.tensor(ids) for ids in lists], sizes, slots)
    assert (plan.slots is None) == (not rows.scratch(slots))
    stage = torch.full((plan.stage_rows, *rows.row_shape), float("nan"))
    for slot in range(slots):
        BlockRows.gather(rows.tables(views[slot]), plan, stage, slot)
    for ids, region in zip(chunks, rows.regions(stage, plan, slots), strict=True):
        want = torch.empty(slots, 2, len(ids) * N, H, D)
        for slot in range(slots):
            gather_blocks(views[slot], ids, want[slot])
        got = torch.empty_like(want)
        rows.to_chunk(region, len(ids), got, non_blocking=False)
        assert torch.equal(got, want)
    restored = [torch.zeros_like(kv) for kv in kvs]
    for slot in range(slots):
        BlockRows.scatter(rows.tables(blocks_view(restored[slot], content, D)), plan, stage, slot)
        assert torch.equal(restored[slot], kvs[slot])
    per_chunk = rows.rows_per_chunk(2) * (slots + rows.scratch(slots))
    assert rows.batches(chunks, 2 * per_chunk, slots) == [[0, 1], [2]]
    assert rows.batches(chunks, 1, slots) == [[0], [1], [2]]  # (the stage always holds a whole chunk)


@pytest.mark.parametrize(("content", "dtype", "dim", "offset", "wide"), [
    ("kv_last", torch.bfloat16, 8, 0, [torch.complex128]),  # 16-byte runs
    ("kv_last", torch.float32, 8, 0, [torch.complex128]),
    ("kv_last", torch.bfloat16, 4, 0, [torch.int64]),  # 8-byte runs
    ("kv_last", torch.bfloat16, 12, 0, [torch.int64]),  # 24-byte runs: 8-byte elements
    ("kv_last", torch.bfloat16, 6, 0, [torch.int32]),  # 12-byte runs: 4-byte elements
    ("kv_last", torch.bfloat16, 3, 0, [torch.bfloat16]),  # 6-byte runs: as they are
    ("kv_last", torch.bfloat16, 8, 1, [torch.bfloat16]),  # a layer 2 bytes into its buffer
    ("kv_last", torch.bfloat16, 8, 4, [torch.int64]),  # 8 bytes into it: 16-byte elements would straddle
    ("cpu", torch.bfloat16, 8, 0, [torch.complex128]),
    ("cpu_kt", torch.bfloat16, 8, 0, [torch.bfloat16, torch.complex128]),  # K is [D, N]: its dim not contiguous
])
@pytest.mark.parametrize("layers", [1, 3])
def test_blocks_move_as_wide_elements_where_the_layout_allows_and_stay_bit_exact(
        content: str, dtype: torch.dtype, dim: int, offset: int, wide: list[torch.dtype], layers: int) -> None:
    """Gathers and scatters index 16-byte (else 8- or 4-byte) elements where the strides
    allow (an eighth of the elements to index for bf16), and the element type they had
    elsewhere. Either way every bit comes back: arbitrary bit patterns (NaNs with payloads,
    negative zeros; and, read as the complex128 that stands in for 16-byte elements,
    signalling NaNs, which an arithmetic move would quieten) through a batch of chunks,
    straight and through the scratch."""
    def layer() -> torch.Tensor:
        count = B * H * N * 2 * dim
        bits = torch.randint(-2**15, 2**15, (-(-(count + offset) * dtype.itemsize // 8) * 4,), dtype=torch.int16)
        # negative zeros (in bf16 and in float32 alike: 0x0000 then 0x8000), then every third
        # 8-byte word a float64 signalling NaN (exponent all ones, quiet bit 0): both halves
        # of a complex128 get some
        bits.view(torch.int32)[2::7] = -2**31
        words = bits.view(torch.int64)
        words[::3] = 0x7FF0_0000_0000_0001 + torch.arange(words[::3].numel()) * 7
        return bits.view(dtype)[offset : offset + count].view(B, H, N, 2 * dim)

    kvs = [layer() for _ in range(layers)]
    views = [blocks_view(kv, content, dim) for kv in kvs]
    rows = BlockRows(views[0])
    assert [t.dtype for t in rows.tables(views[0])] == wide
    chunks = [[4, 1], [3], [0, 5, 2]]
    lists, sizes = rows.id_lists(chunks, layers)
    plan = rows.plan(chunks, [torch.tensor(ids) for ids in lists], sizes, layers)
    stage = torch.zeros((plan.stage_rows, *rows.row_shape), dtype=dtype)
    restored = [torch.zeros_like(kv) for kv in kvs]
    for slot in range(layers):
        BlockRows.gather(rows.tables(views[slot]), plan, stage, slot)
    for slot in range(layers):
        BlockRows.scatter(rows.tables(blocks_view(restored[slot], content, dim)), plan, stage, slot)
    for kv, back in zip(kvs, restored, strict=True):  # (every block is in a chunk)
        assert torch.equal(back.view(torch.int16), kv.view(torch.int16))
    one = torch.empty(2, 2 * N, H, dim, dtype=dtype)  # and one chunk, as tools copy it
    gather_blocks(views[0], [4, 1], one)
    again = torch.zeros_like(kvs[0])
    scatter_blocks(blocks_view(again, content, dim), [4, 1], one)
    assert torch.equal(again[[4, 1]].view(torch.int16), kvs[0][[4, 1]].view(torch.int16))
    assert not again[[0, 2, 3, 5]].view(torch.int16).any()


def test_memory_at_an_address_misaligned_for_wide_elements_is_indexed_narrower() -> None:
    """A KV cache PyTorch did not allocate (DLPack, a foreign buffer) may start 8 bytes off a
    16-byte boundary with its storage offset 0, which ``Tensor.view`` accepts: it is indexed as
    8-byte elements (a GPU's 16-byte loads would fault), and still moves bit for bit."""
    raw = np.zeros(B * H * N * 2 * D * 2 + 64, dtype=np.uint8)
    start = (8 - raw.ctypes.data % 16) % 16
    kv = torch.from_numpy(raw[start : start + B * H * N * 2 * D * 2]).view(torch.bfloat16).view(B, H, N, 2 * D)
    assert kv.data_ptr() % 16 == 8 and kv.storage_offset() == 0
    kv.view(torch.int16).copy_(torch.randint(-2**15, 2**15, kv.shape, dtype=torch.int16))
    view = blocks_view(kv, "kv_last", D)
    rows = BlockRows(view)
    assert [t.dtype for t in rows.tables(view)] == [torch.int64]
    one = torch.empty(2, 2 * N, H, D, dtype=torch.bfloat16)
    gather_blocks(view, [4, 1], one)
    again = torch.zeros_like(kv)
    scatter_blocks(blocks_view(again, "kv_last", D), [4, 1], one)
    assert torch.equal(again[[4, 1]].view(torch.int16), kv[[4, 1]].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_layout_is_probed_and_read_right(dtype: torch.dtype) -> None:
    """vLLM's own CPU cache-write op, with the kernel ISA vLLM picks on this machine: the
    probed layout reads back exactly the K and V that were written. (kvtier used to assume
    K rows for every ISA: self-consistent within the CPU backend, but the stored "canonical"
    K was transposed or packed, wrong for any other backend and for offline warm-up.)"""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from kvtier.vllm.layout import probe_cpu_layout

    isa = _get_attn_isa(dtype, N, 2 * D)

    def write(key, value, key_cache, value_cache, slots):  # noqa: ANN001
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    content = probe_cpu_layout(write, N, 2 * D, dtype)
    assert content is not None, isa  # 'vec' kernels: "cpu_kt"; 'amx' (bf16 here): a permutation
    heads, dim, blocks = 2, 2 * D, 3
    kv = torch.zeros(blocks, heads, N, 2 * dim, dtype=dtype)
    key_cache, value_cache = kv.view(blocks, heads, 2 * N, dim).chunk(2, dim=2)
    k, v = torch.randn(2, N, heads, dim).to(dtype)
    write(k, v, key_cache, value_cache, torch.arange(N, 2 * N))  # tokens of block 1
    out = torch.empty(2, N, heads, dim, dtype=dtype)
    gather_blocks(blocks_view(kv, content, dim), [1], out)
    assert torch.equal(out[0], k) and torch.equal(out[1], v)


def _packed(key, value, key_cache, value_cache, slots):  # noqa: ANN001
    """A kernel layout with no strided form: K as [D/2, N, 2] pairs, V as [N/2, D, 2]."""
    n, _, d = key.shape
    key_cache[0, 0].reshape(-1).copy_(key[:, 0].reshape(n, d // 2, 2).transpose(0, 1).reshape(-1))
    value_cache[0, 0].reshape(-1).copy_(value[:, 0].reshape(n // 2, 2, d).transpose(1, 2).reshape(-1))


def test_packed_cpu_layout_is_read_through_its_permutation() -> None:
    from kvtier.vllm.layout import probe_cpu_layout

    perm = probe_cpu_layout(_packed, N, D, torch.bfloat16)
    assert isinstance(perm, torch.Tensor)
    kv = torch.zeros(B, H, N, 2 * D, dtype=torch.bfloat16)
    k, v = torch.randn(2, N, 1, D).to(torch.bfloat16)
    for head in range(H):  # _packed writes block 0, head 0 of the caches it is given
        key_cache, value_cache = kv[3:4, head:head + 1].view(1, 1, 2 * N, D).chunk(2, dim=2)
        _packed(k, v, key_cache, value_cache, None)
    out = torch.empty(2, N, H, D, dtype=torch.bfloat16)
    gather_blocks(blocks_view(kv, perm, D), [3], out)
    assert torch.equal(out[0, :, 1], k[:, 0]) and torch.equal(out[1, :, 1], v[:, 0])
    restored = torch.zeros_like(kv)
    scatter_blocks(blocks_view(restored, perm, D), [3], out)
    assert torch.equal(restored, kv)


def test_cpu_write_kvtier_cannot_invert_is_refused() -> None:
    """A kernel that scales (quantizes) what it writes: no layout, the connector turns off."""
    from kvtier.vllm.layout import probe_cpu_layout

    def scaled(key, value, key_cache, value_cache, slots):  # noqa: ANN001
        key_cache[0, 0].copy_(key[:, 0] * 0.5)
        value_cache[0, 0].copy_(value[:, 0])

    assert probe_cpu_layout(scaled, N, D, torch.float32) is None


def test_layout_that_does_not_fit_is_refused() -> None:
    with pytest.raises(UnsupportedLayout):
        blocks_view(torch.zeros(B, H, N, 3 * D), "kv_last", D)
    with pytest.raises(UnsupportedLayout):
        blocks_view(torch.zeros(B, H, N, 2 * D), "mla", D)


def test_prometheus_counters_follow_stats() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvtier.vllm.stats import KVTierPromMetrics

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = KVTierPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"], {0: ["0"]})
    prom.observe({"load_tokens": 576, "store_corrupt_records": 2})
    prom.observe({"load_tokens": 64})
    assert reg.get_sample_value("vllm:kvtier_load_tokens_total", {"engine": "0"}) == 640
    assert reg.get_sample_value("vllm:kvtier_store_corrupt_records_total", {"engine": "0"}) == 2


def test_every_counter_in_the_log_line_is_a_prometheus_counter() -> None:
    """The log line shows every store counter (as store_<name>) and the worker's save_*
    counts; Prometheus must export the same names (vllm.md says so)."""
    import dataclasses

    from kvtier.metrics import Counters
    from kvtier.vllm.stats import PROM_COUNTERS

    store = {"store_" + f.name for f in dataclasses.fields(Counters) if not f.name.startswith("_")}
    worker = {"load_tokens", "load_requests", "load_failed_blocks", "load_seconds", "save_chunks",
              "save_tokens", "save_skipped_chunks", "save_dropped_chunks", "save_unsafe_chunks",
              "save_layers_after_forward"}
    assert store | worker <= set(PROM_COUNTERS), sorted((store | worker) - set(PROM_COUNTERS))
