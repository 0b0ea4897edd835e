"""The cost model (pwformat.cost) against the tensors it counts: page rounding, KV blocks, decode-step bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pwformat.ap import pack_planes
from pwformat.cost import (
    MoELayerShape,
    block_bytes,
    block_pages,
    decode_step_bytes,
    expected_distinct_experts,
    kv_block_bytes,
    kv_block_pages,
    kv_page_bytes,
    page_rounded_bytes,
)
from pwrun.runner.kv_store import PooledKVCache


@pytest.mark.parametrize("page_bytes", [64, 100, 4096])
def test_page_rounding_holds_every_plane_and_lut(page_bytes: int) -> None:
    shapes = [(3, 31), (7, 33), (24, 70), (1, 1408)]
    bits = np.array([3, 4, 8])
    plane_pages, lut_pages = block_pages(shapes, list(bits), page_bytes)
    rounded = page_rounded_bytes(shapes, bits, page_bytes)
    for i, (n, k) in enumerate(shapes):
        plane = pack_planes(torch.zeros(n, k, dtype=torch.uint8))[0]
        plane_nbytes = plane.numel() * plane.element_size()
        assert (plane_pages[i] - 1) * page_bytes < plane_nbytes <= plane_pages[i] * page_bytes
        for j, b in enumerate(bits):
            lut_nbytes = torch.zeros(n, 2 ** int(b), dtype=torch.float16).numel() * 2
            assert (lut_pages[i, b] - 1) * page_bytes < lut_nbytes <= lut_pages[i, b] * page_bytes
            assert rounded[i, j] == (b * plane_pages[i] + lut_pages[i, b]) * page_bytes
            assert rounded[i, j] >= block_bytes(n, k, int(b))
    assert lut_pages[:, [0, 1, 2, 5, 6, 7]].sum() == 0


def test_kv_block_bytes_match_the_cache_pages() -> None:
    """A KV block is one pool page per layer for K and one for V; a page is one layer's K (or V) of the block."""
    layers, block, heads, dim = 3, 16, 2, 8
    page = kv_page_bytes(block, heads, dim, 2)
    cache = PooledKVCache(torch.zeros(5 * page, dtype=torch.uint8), layers, 4, block, heads, dim, torch.bfloat16)
    assert cache.pages.shape[0] == 5 and cache.pages[0].numel() * cache.pages[0].element_size() == page
    assert kv_block_bytes(layers, block, heads, dim, 2) == 2 * layers * page == kv_block_pages(layers) * page


def test_expected_distinct_experts_by_simulation() -> None:
    rng = np.random.default_rng(0)
    e, k, batch = 16, 2, 5
    seen = [len({int(x) for _ in range(batch) for x in rng.choice(e, k, replace=False)}) for _ in range(20000)]
    assert expected_distinct_experts(e, k, batch) == pytest.approx(float(np.mean(seen)), rel=0.01)
    assert expected_distinct_experts(e, k, 1) == pytest.approx(k)


def test_decode_step_bytes_counts_each_part() -> None:
    m = MoELayerShape(hidden=8, expert_intermediate=4, num_experts=4, top_k=4, shared_intermediate=0)
    # top_k = E: every expert is read at batch 1; 16-bit: 3 * H * I weights of 2 bytes per expert
    assert decode_step_bytes(0, [m], 1, 0, 0, None) == pytest.approx(4 * 3 * 8 * 4 * 2)
    # 4 bits: half a byte per weight plus a 16-entry fp16 LUT per row of gate_up (2I rows) and down (H rows)
    lut = (2 * 4 + 8) * 16 * 2
    assert decode_step_bytes(0, [m], 1, 0, 0, 4) == pytest.approx(4 * (3 * 8 * 4 / 2 + lut))
    # non-expert weights once, KV per sequence and token
    assert decode_step_bytes(100, [], 3, 7, 5, 4) == 100 + 3 * 7 * 5
    assert math.isclose(decode_step_bytes(0, [m, m], 1, 0, 0, 4), 2 * decode_step_bytes(0, [m], 1, 0, 0, 4))
