"""AP bit-plane format: packing round trip, nestedness, memory accounting (SPEC section 2, Eq. 3)."""

from __future__ import annotations

import pytest
import torch

from pwcal.quant.kmeans1d import nested_kmeans
from pwformat.ap import dequantize, pack_planes, unpack_codes
from pwformat.cost import block_bytes
from pwformat.layout import words_per_row


@pytest.mark.parametrize(("n", "k"), [(1, 1), (3, 31), (5, 32), (7, 33), (4, 96 + 8), (2, 1408)])
def test_pack_unpack_round_trip_on_ragged_widths(n: int, k: int) -> None:
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    planes = pack_planes(codes)
    assert planes.shape == (8, n, words_per_row(k)) and planes.dtype == torch.int32
    assert torch.equal(unpack_codes(planes, k, 8), codes.long())
    for b in range(1, 9):  # b-bit codes are the top b bits and need only planes 0..b-1
        assert torch.equal(unpack_codes(planes[:b].clone(), k, b), codes.long() >> (8 - b))


def test_plane_bit_layout_is_as_documented() -> None:
    codes = torch.zeros(1, 40, dtype=torch.uint8)
    codes[0, 0] = 0b1000_0000  # MSB -> plane 0, column 0 -> word 0 bit 0
    codes[0, 33] = 0b0000_0001  # LSB -> plane 7, column 33 -> word 1 bit 1
    planes = pack_planes(codes)
    assert planes[0, 0, 0].item() == 1 and planes[7, 0, 1].item() == 2
    assert int(planes.abs().sum()) == 3


def test_lower_then_raise_round_trip_is_exact() -> None:
    torch.manual_seed(0)
    w = torch.randn(16, 100)
    nc = nested_kmeans(w, torch.rand(16, 100) + 0.1, 3)
    planes = pack_planes(nc.codes)
    full = dequantize(planes, nc.luts[8], 100, 8)
    kept = planes[:3].clone()  # lower to 3 bits: planes 3..7 leave the device
    moved = planes[3:].clone()
    low = dequantize(kept, nc.luts[3], 100, 3)
    assert torch.equal(low, nc.luts[3].gather(1, nc.codes.long() >> 5))
    restored = torch.cat([kept, moved])  # raise again
    assert torch.equal(dequantize(restored, nc.luts[8], 100, 8), full)


@pytest.mark.parametrize("seed", [2, 3])
def test_block_bytes_match_tensor_sizes(seed: int) -> None:
    n, k = 24, 70
    nc = nested_kmeans(torch.randn(n, k), torch.ones(n, k), seed)
    planes = pack_planes(nc.codes)
    for b in range(seed, 9):
        actual = planes[:b].numel() * planes.element_size() + nc.luts[b].numel() * nc.luts[b].element_size()
        assert block_bytes(n, k, b, seed) == actual
        lower = sum(nc.luts[x].numel() * 2 for x in range(seed, b))
        assert block_bytes(n, k, b, seed, lower_luts_resident=True) == actual + lower
    with pytest.raises(ValueError):
        block_bytes(n, k, seed - 1, seed)


def test_dequantize_rejects_wrong_lut_width() -> None:
    with pytest.raises(ValueError):
        dequantize(torch.zeros(8, 2, 1, dtype=torch.int32), torch.zeros(2, 8), 5, 4)
