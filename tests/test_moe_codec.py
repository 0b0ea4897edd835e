"""The kernels' reference codec (``kernels.moe.codec``) against the runtime's AP format, bit for bit, on odd shapes:
the MoE kernels are tested against the same packing and dequantization the artifacts use."""

from __future__ import annotations

import pytest
import torch

from kernels.moe.codec import dequantize, pack_planes
from pwformat import ap as ap_format


@pytest.mark.parametrize(("n", "k"), [(1, 1), (7, 70), (3, 96), (5, 33)])
def test_codec_matches_the_runtime_format(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * k)
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    planes = pack_planes(codes)
    assert torch.equal(planes, ap_format.pack_planes(codes))
    for bits in range(1, 9):
        lut = torch.randn(n, 2**bits, generator=g).half()
        got = dequantize(planes[:bits], lut, k, bits)
        assert torch.equal(got, ap_format.dequantize(planes, lut, k, bits))
        assert torch.equal(got, lut.gather(1, (codes.long() >> (8 - bits))))  # the top b bits pick the entry
    with pytest.raises(ValueError, match="need 3 planes"):
        dequantize(planes[:2], torch.zeros(n, 8), k, 3)
