"""A dequantized weight tile in registers (Triton), shared by the mid-size and prefill MoE kernels.

``weight_tile`` reads the int32 plane words of BLOCK_N rows x BLOCK_K columns of one linear block (planes
addressed through its ``plane_offset`` row), turns them into q-bit codes and looks each code up in its row's
LUT; it does not multiply or store. Codes are built 4 columns at a time per plane: one multiply spreads a
nibble of the plane word into the 4 bytes of a code word (``nib * 0x204081`` puts bit i at bit 8i; the partial
products land on distinct bits, so there are no carries), then one and-or merges it in (about 1 op per weight
per plane plus 2 per weight). All 8 plane loads are issued before the first is used: one memory latency per
tile instead of q in a row.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _plane(pool_ptr, plane_off_ptr, p: tl.constexpr, q, word, wmask):
    """Words of plane p (0 where p >= q: a masked load moves no bytes)."""
    return tl.load(pool_ptr + tl.load(plane_off_ptr + p) + word, mask=wmask & (word * 0 + p < q), other=0)


@triton.jit
def _merge(code, words, c):
    """Put the bits of one plane's words at bit c of every code byte ([rows, words, 8] code words)."""
    n4 = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
    return code | ((n4 * (0x204081 << c)) & (0x01010101 << c))


@triton.jit
def weight_tile(
    pool_ptr,  # int32 plane pool
    plane_off_ptr,  # int64 [8] word offsets of this block's planes (row of plane_offset)
    lut_row_ptr,  # [BLOCK_N] pointers to each row's LUT (2^q entries, fp16/bf16)
    q,  # committed bitwidth of the block (runtime: one launch mixes bitwidths)
    row,  # [BLOCK_N] int32 row ids inside the block
    row_mask,  # [BLOCK_N] rows that exist
    k0,  # first column of the tile (multiple of 32)
    K,  # columns of the block
    KW,  # int32 words per plane row = ceil(K / 32)
    BLOCK_N: tl.constexpr,  # rows of the tile
    BLOCK_K: tl.constexpr,  # columns of the tile, a multiple of 32
):
    """[BLOCK_N, BLOCK_K] weights in the LUT's dtype; 0 outside the block."""
    BKW: tl.constexpr = BLOCK_K // 32
    kw = k0 // 32 + tl.arange(0, BKW)
    wmask = row_mask[:, None] & (kw[None, :] < KW)
    word = row[:, None] * KW + kw[None, :]
    w0 = _plane(pool_ptr, plane_off_ptr, 0, q, word, wmask)
    w1 = _plane(pool_ptr, plane_off_ptr, 1, q, word, wmask)
    w2 = _plane(pool_ptr, plane_off_ptr, 2, q, word, wmask)
    w3 = _plane(pool_ptr, plane_off_ptr, 3, q, word, wmask)
    w4 = _plane(pool_ptr, plane_off_ptr, 4, q, word, wmask)
    w5 = _plane(pool_ptr, plane_off_ptr, 5, q, word, wmask)
    w6 = _plane(pool_ptr, plane_off_ptr, 6, q, word, wmask)
    w7 = _plane(pool_ptr, plane_off_ptr, 7, q, word, wmask)
    code = _merge(tl.zeros((BLOCK_N, BKW, 8), dtype=tl.int32), w0, q - 1)
    if q > 1:
        code = _merge(code, w1, q - 2)
    if q > 2:
        code = _merge(code, w2, q - 3)
    if q > 3:
        code = _merge(code, w3, q - 4)
    if q > 4:
        code = _merge(code, w4, q - 5)
    if q > 5:
        code = _merge(code, w5, q - 6)
    if q > 6:
        code = _merge(code, w6, q - 7)
    if q > 7:
        code = _merge(code, w7, 0)
    byte = tl.arange(0, 4) * 8
    idx = tl.reshape((code[:, :, :, None] >> byte[None, None, None, :]) & 0xFF, (BLOCK_N, BLOCK_K))
    cols = k0 + tl.arange(0, BLOCK_K)
    return tl.load(lut_row_ptr[:, None] + idx, mask=row_mask[:, None] & (cols[None, :] < K), other=0.0)


@triton.jit
def lut_rows(lut_ptr, lut_off_ptr, bits_ptr, blk, row):
    """(q, [BLOCK_N] pointers to the LUT rows ``row`` of block ``blk``)."""
    q = tl.load(bits_ptr + blk)
    return q, lut_ptr + tl.load(lut_off_ptr + blk) + row * (1 << q)
