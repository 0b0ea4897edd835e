"""The Any-Precision bit-plane format of one expert linear block (SPEC section 2).

Packing (format version 1)
--------------------------
A block W [N, K] (N rows = out features, K = in features) has 8-bit parent codes
``code8 [N, K]`` in 0..255, nested: the b-bit code is the top b bits, ``code_b = code8 >> (8 - b)``.

* ``planes``: int32 [8, N, Kw] with ``Kw = ceil(K / 32)``. Plane p (p = 0 is the MSB) holds bit
  ``7 - p`` of every code. Within a row, column k lives in word ``k // 32`` at bit ``k % 32``
  (bit 0 = least significant); the padding columns of the last word are 0. Each plane
  ``planes[p]`` is one contiguous [N, Kw] tensor, so a runtime can place, move and drop planes
  independently: b-bit codes need planes 0..b-1 only.
* ``lut{b}``: float16 [N, 2^b] for every b from the seed to 8: ``W_b[r, k] = lut_b[r, code_b[r, k]]``.

Lowering b stops reading planes b..7 and switches LUT; nothing is re-packed. This is a plain
layout (not the original AP kernel's in-word bit shuffle); the kernels read int32 words and
unpack 32 codes per word.

Constants (``PARENT_BITS``, ``FORMAT_VERSION``, ...) are in ``pwformat.layout``; the bytes a block
takes (SPEC Eq. 3 ``M^b``) in ``pwformat.cost``.
"""

from __future__ import annotations

import torch

from pwformat.layout import PARENT_BITS, words_per_row

LUT_DTYPE = torch.float16


def pack_planes(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] uint8 (8-bit parent codes) -> planes [8, N, Kw] int32 (layout above)."""
    n, k = codes.shape
    kw = words_per_row(k)
    padded = torch.zeros(n, kw * 32, dtype=torch.int64, device=codes.device)
    padded[:, :k] = codes.to(torch.int64)
    shifts = torch.arange(32, device=codes.device, dtype=torch.int64)
    out = torch.empty(PARENT_BITS, n, kw, dtype=torch.int32, device=codes.device)
    for p in range(PARENT_BITS):
        bits = (padded >> (PARENT_BITS - 1 - p)) & 1  # [N, Kw*32]
        words = (bits.view(n, kw, 32) << shifts).sum(-1)  # < 2^32
        out[p] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return out


def unpack_codes(planes: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    """b-bit codes [N, K] int64 from the first ``bits`` planes of planes [>=bits, N, Kw] int32.

    Only planes 0..bits-1 are read, so the others may be absent (a runtime that dropped them
    passes a shorter tensor).
    """
    if planes.shape[0] < bits:
        raise ValueError(f"{bits}-bit codes need {bits} planes, got {planes.shape[0]}")
    n, kw = planes.shape[1], planes.shape[2]
    shifts = torch.arange(32, device=planes.device, dtype=torch.int64)
    code = torch.zeros(n, kw * 32, dtype=torch.int64, device=planes.device)
    for p in range(bits):
        words = planes[p].to(torch.int64) & 0xFFFFFFFF
        code |= ((words[:, :, None] >> shifts) & 1).view(n, kw * 32) << (bits - 1 - p)
    return code[:, :k]


def dequantize(planes: torch.Tensor, lut: torch.Tensor, k: int, bits: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference dequantization: dense W_b [N, K] from planes [>=b, N, Kw] int32 and lut_b [N, 2^b].

    Returns ``dtype`` (default: the LUT's dtype). Raises ``ValueError`` if the LUT width is not 2^b.
    """
    if lut.shape[-1] != 2**bits:
        raise ValueError(f"a {bits}-bit LUT has {2**bits} entries per row, got {lut.shape[-1]}")
    w = lut.gather(1, unpack_codes(planes, k, bits))
    return w if dtype is None else w.to(dtype)
