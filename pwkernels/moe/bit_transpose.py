"""Bit-matrix transposes of int32 plane words in registers (Triton), for the word-first AP decode kernels.

What it does: ``_transpose4`` / ``_transpose8`` turn the 4 / 8 plane words of 32 columns (``pwformat.ap``:
one bit of each column per plane word) into words of 4-bit / 8-bit codes, by delta swaps (Hacker's Delight 7-3).
``pwkernels.moe.decode_dot`` builds its codes with them (SPEC section 7: at decode the cost is instructions per
weight; 4 / 12 swaps per 32 codes instead of 2 ops per plane per 4 codes when merging plane by plane).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _swap(a, b, s: tl.constexpr, m: tl.constexpr):
    """One delta swap of a bit-matrix transpose: bit c + s of every byte of a trades places with bit c of the same
    byte of b, for the bits c with c & s == 0 (``m`` marks them)."""
    t = ((a >> s) ^ b) & m
    return a ^ (t << s), b ^ t


@triton.jit
def _transpose8(a0, a1, a2, a3, a4, a5, a6, a7):
    """Transpose the 8 x 8 bit matrix in each byte lane k (0..3) of 8 uint32 words: bit c of byte k of a_r comes
    out as bit r of byte k of word c. With a_r = plane 7 - r, byte k of output word i is the 8-bit code
    (plane p at bit 7 - p) of column 8 k + i: 12 delta swaps (about 5 integer ops each) per 32 codes, where
    merging plane by plane costs 2 ops per plane per 4 codes (Hacker's Delight 7-3)."""
    a0, a4 = _swap(a0, a4, 4, 0x0F0F0F0F)
    a1, a5 = _swap(a1, a5, 4, 0x0F0F0F0F)
    a2, a6 = _swap(a2, a6, 4, 0x0F0F0F0F)
    a3, a7 = _swap(a3, a7, 4, 0x0F0F0F0F)
    a0, a2 = _swap(a0, a2, 2, 0x33333333)
    a1, a3 = _swap(a1, a3, 2, 0x33333333)
    a4, a6 = _swap(a4, a6, 2, 0x33333333)
    a5, a7 = _swap(a5, a7, 2, 0x33333333)
    a0, a1 = _swap(a0, a1, 1, 0x55555555)
    a2, a3 = _swap(a2, a3, 1, 0x55555555)
    a4, a5 = _swap(a4, a5, 1, 0x55555555)
    a6, a7 = _swap(a6, a7, 1, 0x55555555)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _transpose4(a0, a1, a2, a3):
    """Transpose the 4 x 4 bit matrix in each nibble lane k (0..7) of 4 uint32 words: bit c of nibble k of a_r comes
    out as bit r of nibble k of word c. With a_r = plane 3 - r, nibble k of output word i is the 4-bit code
    (plane p at bit 3 - p) of column 4 k + i (4 delta swaps per 32 codes)."""
    a0, a2 = _swap(a0, a2, 2, 0x33333333)
    a1, a3 = _swap(a1, a3, 2, 0x33333333)
    a0, a1 = _swap(a0, a1, 1, 0x55555555)
    a2, a3 = _swap(a2, a3, 1, 0x55555555)
    return a0, a1, a2, a3
