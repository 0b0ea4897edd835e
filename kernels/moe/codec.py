"""Reference packing and dequantization of the Any-Precision bit-plane layout (SPEC section 2), for tests.

Plane p (p = 0 the MSB) of a block [N, K] holds bit 7 - p of every 8-bit parent code as int32 words
[N, ceil(K / 32)]: column k in word k // 32 at bit k % 32. b-bit codes are the top b bits, read from
planes 0..b-1 only; ``W_b[r, k] = lut_b[r, code_b[r, k]]``. The kernels of this package read that layout;
these pure-PyTorch functions are the kernels' slow twins (the runtime's codec lives in the format package).
"""

from __future__ import annotations

import torch

PARENT_BITS = 8


def pack_planes(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] uint8 (8-bit parent codes) -> planes [8, N, ceil(K / 32)] int32."""
    n, k = codes.shape
    kw = -(-k // 32)
    padded = torch.zeros(n, kw * 32, dtype=torch.int64, device=codes.device)
    padded[:, :k] = codes.to(torch.int64)
    shifts = torch.arange(32, device=codes.device, dtype=torch.int64)
    out = torch.empty(PARENT_BITS, n, kw, dtype=torch.int32, device=codes.device)
    for p in range(PARENT_BITS):
        words = (((padded >> (PARENT_BITS - 1 - p)) & 1).view(n, kw, 32) << shifts).sum(-1)  # < 2^32
        out[p] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return out


def dequantize(planes: torch.Tensor, lut: torch.Tensor, k: int, bits: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense W_b [N, K] (``dtype``, default the LUT's) from planes [>=b, N, Kw] int32 and lut_b [N, 2^b].

    Raises ``ValueError`` if there are fewer than b planes or the LUT width is not 2^b.
    """
    if planes.shape[0] < bits or lut.shape[-1] != 2**bits:
        raise ValueError(f"{bits}-bit weights need {bits} planes and {2**bits} LUT entries per row, got "
                         f"{planes.shape[0]} and {lut.shape[-1]}")
    n, kw = planes.shape[1], planes.shape[2]
    shifts = torch.arange(32, device=planes.device, dtype=torch.int64)
    code = torch.zeros(n, kw * 32, dtype=torch.int64, device=planes.device)
    for p in range(bits):
        words = planes[p].to(torch.int64) & 0xFFFFFFFF
        code |= ((words[:, :, None] >> shifts) & 1).view(n, kw * 32) << (bits - 1 - p)
    w = lut.gather(1, code[:, :k])
    return w if dtype is None else w.to(dtype)
