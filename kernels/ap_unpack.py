"""Word-major unpacking of AP bit-planes: the building blocks of the decode GEMV and the dequantize kernel.

Why not ``kernels.ap_tile.weight_tile`` (issue #4): that one builds a [BLOCK_N, BLOCK_K] tile in natural
column order, which makes Triton spread the 32 columns of one plane word over several threads
(broadcast + reshape): the compiled loop moved every word through shared memory (16 barriers per
tile) and spent ~28 instructions per weight at q = 4 (SASS of the sm_90 build), plus 16 barriers per tile.

Here every tensor is a tile of *words* [BLOCK_N rows, BKW words]: a thread keeps its words and
produces all 32 weights of each word itself, in a static loop, so no layout conversion is needed:
  * ``code_bytes(w0..w7, j, Q)``: one shift and one and-or per plane give the Q-bit codes of 4
    columns at once, those of columns j, j+8, j+16, j+24 of every word, one per byte (bit j of a
    plane word is column 32 kw + j; plane 0 is the code's most significant bit). Q and j are
    compile-time constants, so every shift is an immediate;
  * ``lut_value``: the byte picks the row's LUT entry with one 32-bit-offset load from a
    per-row pointer (L1-resident: a row's LUT is 2^Q entries), converted to fp32.
Weights therefore come out per (j, byte) as [BLOCK_N, BKW] tiles whose columns are
``32 * kw + j + 8 * byte``: the *permuted column order* ``perm_col(c) = (c % 32) * KW + c // 32`` puts
each such tile at contiguous addresses. Consumers multiply by activations stored in that order
(``permute_cols`` below, the PyTorch twin of what the kernels read) or store weights in it.
The bitwidth is a compile-time constant here; kernels branch once per program on the block's
runtime q (one launch still mixes bitwidths).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def permute_cols(x: torch.Tensor, k: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] -> [..., 32 * ceil(K/32)] in permuted column order (zeros for the padding columns).

    Column c of x lands at (c % 32) * KW + c // 32, KW = ceil(K / 32): the order in which the
    kernels of this module produce weights (see module docstring).
    """
    kw = -(-k // 32)
    xp = F.pad(x, (0, 32 * kw - k)) if 32 * kw != k else x
    out = xp.unflatten(-1, (kw, 32)).transpose(-1, -2)
    return out.to(dtype or x.dtype).flatten(-2)


def unpermute_cols(w: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of ``permute_cols``: [..., 32 * KW] permuted -> [..., K] natural order."""
    kw = -(-k // 32)
    return w.unflatten(-1, (32, kw)).transpose(-1, -2).flatten(-2)[..., :k]


@triton.jit
def _plane(pool_ptr, plane_off_ptr, p: tl.constexpr, word, wmask, MASKED: tl.constexpr):
    if MASKED:
        w = tl.load(pool_ptr + tl.load(plane_off_ptr + p) + word, mask=wmask, other=0)
    else:
        w = tl.load(pool_ptr + tl.load(plane_off_ptr + p) + word)
    return w.to(tl.uint32, bitcast=True)


@triton.jit
def load_planes(pool_ptr, plane_off_ptr, word, wmask, Q: tl.constexpr, MASKED: tl.constexpr):
    """The 8 plane-word tiles (uint32, shape of ``word``) of a block; planes >= Q are zeros, not loaded.

    pool_ptr: int32 plane pool; plane_off_ptr: int64 [8] word offsets of the block's planes (64-bit
    scalar bases; ``word`` int32 offsets relative to them); wmask (if MASKED): words that exist (0 elsewhere).
    """
    z = tl.zeros(word.shape, dtype=tl.uint32)
    w0 = _plane(pool_ptr, plane_off_ptr, 0, word, wmask, MASKED)
    w1, w2, w3, w4, w5, w6, w7 = z, z, z, z, z, z, z
    if Q > 1:
        w1 = _plane(pool_ptr, plane_off_ptr, 1, word, wmask, MASKED)
    if Q > 2:
        w2 = _plane(pool_ptr, plane_off_ptr, 2, word, wmask, MASKED)
    if Q > 3:
        w3 = _plane(pool_ptr, plane_off_ptr, 3, word, wmask, MASKED)
    if Q > 4:
        w4 = _plane(pool_ptr, plane_off_ptr, 4, word, wmask, MASKED)
    if Q > 5:
        w5 = _plane(pool_ptr, plane_off_ptr, 5, word, wmask, MASKED)
    if Q > 6:
        w6 = _plane(pool_ptr, plane_off_ptr, 6, word, wmask, MASKED)
    if Q > 7:
        w7 = _plane(pool_ptr, plane_off_ptr, 7, word, wmask, MASKED)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _bit(w, j: tl.constexpr, s: tl.constexpr):
    """Bits j, j+8, j+16, j+24 of w moved to bits s, s+8, s+16, s+24 (others 0)."""
    if j >= s:
        return (w >> (j - s)) & (0x01010101 << s)
    else:
        return (w << (s - j)) & (0x01010101 << s)


@triton.jit
def code_bytes(w0, w1, w2, w3, w4, w5, w6, w7, j: tl.constexpr, Q: tl.constexpr):
    """uint32 tile: byte b holds the Q-bit code of column 32 * kw + j + 8 * b (j in 0..7)."""
    c = _bit(w0, j, Q - 1)
    if Q > 1:
        c = c | _bit(w1, j, Q - 2)
    if Q > 2:
        c = c | _bit(w2, j, Q - 3)
    if Q > 3:
        c = c | _bit(w3, j, Q - 4)
    if Q > 4:
        c = c | _bit(w4, j, Q - 5)
    if Q > 5:
        c = c | _bit(w5, j, Q - 6)
    if Q > 6:
        c = c | _bit(w6, j, Q - 7)
    if Q > 7:
        c = c | _bit(w7, j, 0)
    return c


@triton.jit
def lut_value(lut_row, c, b: tl.constexpr):
    """fp32 [BLOCK_N, BKW]: LUT entries of the codes in byte b of ``c``; lut_row [BLOCK_N] row pointers.

    No mask: every row pointer is valid (callers clamp rows) and every byte is a code < 2^Q.
    (Measured in the sm_90 SASS: ~7 instructions per weight from code to FMA; an int32 offset from one
    block pointer instead of row pointers compiled to more, not fewer.)
    """
    return tl.load(lut_row[:, None] + ((c >> (8 * b)) & 0xFF)).to(tl.float32)
