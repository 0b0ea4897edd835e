"""pwkernels.moe.experts.random_experts: the random experts the warm-up compiles the decode kernels with (and the MoE
kernel suite times) have the asked count, shapes and bitwidth, for counts other than a layer's top-k too."""

from __future__ import annotations

import pytest
import torch

from pwkernels.moe.experts import random_experts


@pytest.mark.parametrize("n", [1, 2, 3])
def test_random_experts_shapes_and_bits(n: int) -> None:
    hidden, inter = 70, 40
    ex = random_experts(hidden, inter, n, 5, torch.bfloat16, "cpu")
    assert ex.bits.tolist() == [5] * (2 * n)
    for b in range(2 * n):
        planes, lut, _, k = ex.block(b)
        rows = 2 * inter if b % 2 == 0 else hidden
        assert k == (hidden if b % 2 == 0 else inter)
        assert planes.shape[-2:] == (rows, -(-k // 32)) and lut.shape == (rows, 2**5)
        assert lut.dtype == torch.bfloat16
