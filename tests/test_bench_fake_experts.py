"""bench/ap_moe_speed.fake_experts: the synthetic experts every kernel benchmark times (a shadowed loop variable once
made it build the wrong number of bitwidths for any n but the default, which only showed on the GPU)."""

from __future__ import annotations

import pytest
import torch

from bench.ap_moe_speed import fake_experts


@pytest.mark.parametrize("n", [None, 1, 3])
def test_fake_experts_shapes_and_bits(n: int | None) -> None:
    s = {"hidden": 70, "inter": 40, "experts": 8, "topk": 2}
    ex = fake_experts(s, 5, n, "cpu")
    blocks = 2 * (s["topk"] if n is None else n)
    assert ex.bits.tolist() == [5] * blocks
    for b in range(blocks):
        planes, lut, _, k = ex.block(b)
        rows = 2 * s["inter"] if b % 2 == 0 else s["hidden"]
        assert k == (s["hidden"] if b % 2 == 0 else s["inter"])
        assert planes.shape[-2:] == (rows, -(-k // 32)) and lut.shape == (rows, 2**5)
        assert lut.dtype == torch.bfloat16
