"""Paged-layout conversion for every content layout, and the Prometheus counters."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from kvtier.vllm.layout import (
    BACKEND_CONTENT,
    UnsupportedLayout,
    blocks_view,
    gather_blocks,
    scatter_blocks,
)

B, H, N, D = 6, 2, 32, 16


def _k_and_v(kv: torch.Tensor, content: str, block: int, head: int, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one token, read the way the attention backend itself reads them."""
    if content == "cpu":  # cpu_attn.py: view(B, H, 2N, D).chunk(2, dim=2)
        k, v = kv.view(B, H, 2 * N, D).chunk(2, dim=2)
        return k[block, head, token], v[block, head, token]
    k, v = kv.transpose(1, 2).split(D, dim=-1)  # flash_attn.py / triton_attn.py
    return k[block, token, head], v[block, token, head]


@pytest.mark.parametrize("content", sorted(set(BACKEND_CONTENT.values())))
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
