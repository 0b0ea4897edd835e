"""One Triton building block shared by every AP MoE kernel: a dequantized weight tile.

``weight_tile`` reads the int32 plane words of BLOCK_N rows x BLOCK_K columns of one linear block
(planes addressed through its ``plane_offset`` row, format of ``pwrun.ap.format``), turns them into
q-bit codes in registers and looks each code up in its row's LUT. It does not multiply or store:
the GEMV, GEMM and dequantize kernels in ``kernels/ap_moe*.py`` do.

Why two ways to build codes (SPEC section 7: at decode the cost is instructions per weight):
  * ``SPREAD = 0``: per weight and plane, shift the word by the column, mask one bit, append it
    (about 3 integer ops per weight per plane);
  * ``SPREAD = 1``: per 4 columns and plane, one multiply spreads a nibble of the plane word into
    the 4 bytes of a code word (``nib * 0x204081`` puts bit i at bit 8i: the 16 partial products
    land on distinct bits, so there are no carries), then one and-or merges it into the codes; the
    codes are read back one byte each (about 1 op per weight per plane plus 2 per weight).
Which one is faster is measured, not assumed (``kernels/configs/ap_moe.json``; on the H200 the
spread variant won every tuning point). All 8 plane loads are issued before the first is used.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _plane(pool_ptr, plane_off_ptr, p: tl.constexpr, q, word, wmask):
    """Words of plane p (0 where p >= q: a masked load moves no bytes)."""
    return tl.load(pool_ptr + tl.load(plane_off_ptr + p) + word, mask=wmask & (word * 0 + p < q), other=0)


@triton.jit
def _merge(code, words, c, SPREAD: tl.constexpr):
    """Put the bits of one plane's words at bit c of every code."""
    if SPREAD:
        n4 = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF
        return code | ((n4 * (0x204081 << c)) & (0x01010101 << c))
    else:
        return code | (((words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1) << c)


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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # multiple of 32
    SPREAD: tl.constexpr,
):
    """[BLOCK_N, BLOCK_K] weights in the LUT's dtype; 0 outside the block.

    The loads of all 8 planes are issued before any of them is used (those at p >= q are masked
    off): one memory latency per tile instead of q in a row, which is what bounded the first
    version (a runtime loop over planes, load then use).
    """
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
    if SPREAD:
        code = _merge(tl.zeros((BLOCK_N, BKW, 8), dtype=tl.int32), w0, q - 1, SPREAD)
    else:
        code = _merge(tl.zeros((BLOCK_N, BKW, 32), dtype=tl.int32), w0, q - 1, SPREAD)
    if q > 1:
        code = _merge(code, w1, q - 2, SPREAD)
    if q > 2:
        code = _merge(code, w2, q - 3, SPREAD)
    if q > 3:
        code = _merge(code, w3, q - 4, SPREAD)
    if q > 4:
        code = _merge(code, w4, q - 5, SPREAD)
    if q > 5:
        code = _merge(code, w5, q - 6, SPREAD)
    if q > 6:
        code = _merge(code, w6, q - 7, SPREAD)
    if q > 7:
        code = _merge(code, w7, 0, SPREAD)
    if SPREAD:
        byte = tl.arange(0, 4) * 8
        idx = tl.reshape((code[:, :, :, None] >> byte[None, None, None, :]) & 0xFF, (BLOCK_N, BLOCK_K))
    else:
        idx = tl.reshape(code, (BLOCK_N, BLOCK_K))
    cols = k0 + tl.arange(0, BLOCK_K)
    return tl.load(lut_row_ptr[:, None] + idx, mask=row_mask[:, None] & (cols[None, :] < K), other=0.0)


@triton.jit
def lut_rows(lut_ptr, lut_off_ptr, bits_ptr, blk, row):
    """(q, [BLOCK_N] pointers to the LUT rows ``row`` of block ``blk``)."""
    q = tl.load(bits_ptr + blk)
    return q, lut_ptr + tl.load(lut_off_ptr + blk) + row * (1 << q)

