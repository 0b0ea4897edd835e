"""Per-weight building blocks of the decode MoE kernels (Triton; used by ``pwkernels.moe.decode``).

At decode the cost is instructions per weight (SPEC section 7), so a thread keeps whole int32 plane words and
makes the 32 weights of each itself: a bit-matrix transpose of the plane words gives 4-bit codes (q <= 4, from
4 planes) or 8-bit codes (q = 5 from 5 planes, q >= 6 from 8), plane p at bit W - 1 - p of its field, shifted
right by W - q, so q stays a runtime value and one compile serves every bitwidth. A code picks its weight by warp
shuffle from the rows' LUTs held in registers (q <= 5 on 32-word tiles, q <= 4 on 16-word ones) or by a 16-bit
load from its row's LUT (an L1 hit). Tiles are word-first ([words, rows]), so a warp's loads are contiguous.
At one token the code loops are unrolled in Triton's IR; at 2..8 tokens they are loops that LLVM unrolls or
keeps, which keeps compile time in seconds (Triton's coalesce pass grows with the loads in the IR).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pwkernels.moe.bit_transpose import _transpose4, _transpose8
from pwkernels.moe.lut_shuffle import _lut, _shfl
from pwkernels.moe.tile import _plane


@triton.jit
def _pick(v, tok, m: tl.constexpr):
    """Element m of the [T_PAD] tensor ``v`` as a scalar."""
    return tl.sum(tl.where(tok == m, v, 0))


@triton.jit
def _fma(p, w, xp, col_off):
    """p + w [BKW, R] * x [BKW] (one token's activations at pointers xp + col_off: a constant offset once the loops
    are unrolled, so the load needs no address arithmetic; unmasked, the buffers are padded)."""
    return p + w * tl.load(xp + col_off).to(tl.float32)[:, None]


@triton.jit
def _put(out, tok, m: tl.constexpr, p):
    """out [T_PAD, R] with row m replaced by p [BKW, R] summed over the words."""
    return tl.where((tok == m)[:, None], tl.sum(p, axis=0)[None, :], out)


@triton.jit
def _fma_all(p0, p1, p2, p3, p4, p5, p6, p7, w, xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7, off,
             T_PAD: tl.constexpr):
    """Each token's accumulator p_t [BKW, R] plus w * its activations at xp_t + off (tokens < T_PAD)."""
    p0 = _fma(p0, w, xp0, off)
    if T_PAD > 1:
        p1 = _fma(p1, w, xp1, off)
    if T_PAD > 2:
        p2 = _fma(p2, w, xp2, off)
        p3 = _fma(p3, w, xp3, off)
    if T_PAD > 4:
        p4 = _fma(p4, w, xp4, off)
        p5 = _fma(p5, w, xp5, off)
        p6 = _fma(p6, w, xp6, off)
        p7 = _fma(p7, w, xp7, off)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _nibbles_word(o, i: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7, lut_t, xp0, xp1, xp2, xp3, xp4, xp5, xp6,
                  xp7, KWX: tl.constexpr, T_PAD: tl.constexpr, RAW: tl.constexpr):
    """Accumulate the 8 weights whose codes are the nibbles of ``o`` (nibble k: column 4 k + i of each word), by
    warp shuffle on lut_t. The nibble loop is unrolled in Triton's IR at one token and by LLVM at more (see
    ``_dot_words``: compile time)."""
    if T_PAD == 1:
        for k in tl.static_range(8):
            p0, p1, p2, p3, p4, p5, p6, p7 = _nibble(o, k, i, p0, p1, p2, p3, p4, p5, p6, p7, lut_t, xp0, xp1, xp2, xp3,
                                                     xp4, xp5, xp6, xp7, KWX, T_PAD, RAW)
    else:
        for k in range(8):
            p0, p1, p2, p3, p4, p5, p6, p7 = _nibble(o, k, i, p0, p1, p2, p3, p4, p5, p6, p7, lut_t, xp0, xp1, xp2, xp3,
                                                     xp4, xp5, xp6, xp7, KWX, T_PAD, RAW)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _nibble(o, k, i: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7, lut_t, xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7,
            KWX: tl.constexpr, T_PAD: tl.constexpr, RAW: tl.constexpr):
    """Accumulate the weight whose code is nibble k of ``o`` (column 4 k + i of each word)."""
    if RAW:  # the shuffle reads 5 index bits: bit 4 (the next nibble's) picks the LUT's copy in lanes 16..31
        w = _shfl(lut_t, o >> (4 * k))
    else:
        w = tl.gather(lut_t, ((o >> (4 * k)) & 15).to(tl.int32), 0)
    return _fma_all(p0, p1, p2, p3, p4, p5, p6, p7, w, xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7, (4 * k + i) * KWX, T_PAD)


@triton.jit
def _bytes_word(o, i: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7, lut_t, lut_row, xp0, xp1, xp2, xp3, xp4, xp5,
                xp6, xp7, KWX: tl.constexpr, T_PAD: tl.constexpr, NPL: tl.constexpr, RAW: tl.constexpr):
    """Accumulate the 4 weights whose codes are the bytes of ``o`` (byte k: column 8 k + i of each word): by warp
    shuffle on lut_t (NPL 5, 32-entry tile) or by a 16-bit load at the row's LUT (lut_row [1, R] pointers). The
    byte loop is unrolled in Triton's IR at one token and by LLVM at more (see ``_dot_words``: compile time)."""
    if T_PAD == 1:
        for k in tl.static_range(4):
            p0, p1, p2, p3, p4, p5, p6, p7 = _byte(o, k, i, p0, p1, p2, p3, p4, p5, p6, p7, lut_t, lut_row, xp0, xp1,
                                                   xp2, xp3, xp4, xp5, xp6, xp7, KWX, T_PAD, NPL, RAW)
    else:
        for k in range(4):
            p0, p1, p2, p3, p4, p5, p6, p7 = _byte(o, k, i, p0, p1, p2, p3, p4, p5, p6, p7, lut_t, lut_row, xp0, xp1,
                                                   xp2, xp3, xp4, xp5, xp6, xp7, KWX, T_PAD, NPL, RAW)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _byte(o, k, i: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7, lut_t, lut_row, xp0, xp1, xp2, xp3, xp4, xp5, xp6,
          xp7, KWX: tl.constexpr, T_PAD: tl.constexpr, NPL: tl.constexpr, RAW: tl.constexpr):
    """Accumulate the weight whose code is byte k of ``o`` (column 8 k + i of each word)."""
    if NPL == 5 and RAW and lut_t.shape[0] == 32:  # 5-bit codes: the shuffle's 5 index bits are the code itself
        w = _shfl(lut_t, o >> (8 * k))
    elif NPL == 5 and lut_t.shape[0] == 32:
        w = tl.gather(lut_t, ((o >> (8 * k)) & 0xFF).to(tl.int32), 0)
    else:
        w = tl.load(lut_row + ((o >> (8 * k)) & 0xFF).to(tl.int32)).to(tl.float32)
    return _fma_all(p0, p1, p2, p3, p4, p5, p6, p7, w, xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7, (8 * k + i) * KWX, T_PAD)


@triton.jit
def _dot_words(pool_ptr, plane_off_ptr, lut_t, lut_blk, rbase, q, rows, kw, KW, x_ptr, x_off, KWX: tl.constexpr,
               T_PAD: tl.constexpr, W: tl.constexpr, NPL: tl.constexpr, RAW: tl.constexpr):
    """[T_PAD, R] fp32: W[rows, columns of words kw] @ x_t for each token t (T_PAD <= 8), codes W bits wide.

    rows [R] (clamped to valid rows), rbase [R] uint32 = rows * 2^q (each row's LUT at lut_blk + rbase), lut_t
    [LE, R] fp32 the same LUTs in registers (``_lut``, for the shuffle paths), kw [BKW] word ids (>= KW: planes
    masked). Token t's activations are word-major ([32, KWX]: column 32 w + i at i * KWX + w) at
    x_ptr + x_off[t], zero past the K columns and up to KWX >= every kw words, so they are read unmasked (x_off
    of a token with no work must point at finite values: its row of the result is discarded).
    NPL planes become W-bit codes by a bit-matrix transpose of the plane words (``_transpose4`` /
    ``_transpose8``): W = 4 (q <= 4, NPL 4): nibble k of output word i holds column 32 kw + 4 k + i; W = 8
    (NPL 5 for q = 5, 8 for q >= 6): byte k of output word i holds column 32 kw + 8 k + i. Plane p sits at
    bit W - 1 - p of its field and each output word is shifted right by W - q (planes >= q are 0, so no
    bits cross fields). A code picks its weight by warp shuffle (``tl.gather`` on lut_t) when lut_t holds
    all 2^q entries (q <= 4, or q = 5 with LE = 32), else by a 16-bit load at its row's LUT (L1 hit). The
    weights are used for every token (one [BKW, R] accumulator per token, all in the gather's layout: a 3-D
    [T, BKW, R] product made Triton convert every gathered tile).
    """
    tok = tl.arange(0, T_PAD)
    wmask = (kw < KW)[:, None] & (rows >= 0)[None, :]
    word = kw[:, None] + rows[None, :] * KW
    w0 = _plane(pool_ptr, plane_off_ptr, 0, q, word, wmask).to(tl.uint32, bitcast=True)
    w1 = _plane(pool_ptr, plane_off_ptr, 1, q, word, wmask).to(tl.uint32, bitcast=True)
    w2 = _plane(pool_ptr, plane_off_ptr, 2, q, word, wmask).to(tl.uint32, bitcast=True)
    w3 = _plane(pool_ptr, plane_off_ptr, 3, q, word, wmask).to(tl.uint32, bitcast=True)
    if NPL > 4:
        w4 = _plane(pool_ptr, plane_off_ptr, 4, q, word, wmask).to(tl.uint32, bitcast=True)
    if NPL > 5:
        w5 = _plane(pool_ptr, plane_off_ptr, 5, q, word, wmask).to(tl.uint32, bitcast=True)
        w6 = _plane(pool_ptr, plane_off_ptr, 6, q, word, wmask).to(tl.uint32, bitcast=True)
        w7 = _plane(pool_ptr, plane_off_ptr, 7, q, word, wmask).to(tl.uint32, bitcast=True)
    zero = tl.zeros((kw.shape[0], rows.shape[0]), dtype=tl.float32)
    p0, p1, p2, p3, p4, p5, p6, p7 = zero, zero, zero, zero, zero, zero, zero, zero  # one accumulator per token
    xp0 = x_ptr + _pick(x_off, tok, 0) + kw
    xp1, xp2, xp3, xp4, xp5, xp6, xp7 = xp0, xp0, xp0, xp0, xp0, xp0, xp0  # tokens >= T_PAD: never read
    if T_PAD > 1:
        xp1 = x_ptr + _pick(x_off, tok, 1) + kw
    if T_PAD > 2:
        xp2 = x_ptr + _pick(x_off, tok, 2) + kw
        xp3 = x_ptr + _pick(x_off, tok, 3) + kw
    if T_PAD > 4:
        xp4 = x_ptr + _pick(x_off, tok, 4) + kw
        xp5 = x_ptr + _pick(x_off, tok, 5) + kw
        xp6 = x_ptr + _pick(x_off, tok, 6) + kw
        xp7 = x_ptr + _pick(x_off, tok, 7) + kw
    lut_row = lut_blk + rbase[None, :]  # [1, R] pointers to each row's LUT
    if W == 4:  # nibble codes by a 4 x 4 bit-matrix transpose per nibble lane (``_transpose4``)
        o = _transpose4(w3, w2, w1, w0)
        shift = (4 - q).to(tl.uint32)
        for i in tl.static_range(4):
            p0, p1, p2, p3, p4, p5, p6, p7 = _nibbles_word(o[i] >> shift, i, p0, p1, p2, p3, p4, p5, p6, p7, lut_t,
                                                           xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7, KWX, T_PAD, RAW)
    else:  # byte codes by an 8 x 8 bit-matrix transpose per byte lane (``_transpose8``)
        z = tl.zeros_like(w0)
        if NPL == 5:
            o = _transpose8(z, z, z, w4, w3, w2, w1, w0)
        else:
            o = _transpose8(w7, w6, w5, w4, w3, w2, w1, w0)
        shift = (8 - q).to(tl.uint32)
        for i in tl.static_range(8):
            p0, p1, p2, p3, p4, p5, p6, p7 = _bytes_word(o[i] >> shift, i, p0, p1, p2, p3, p4, p5, p6, p7, lut_t,
                                                         lut_row, xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7, KWX, T_PAD,
                                                         NPL, RAW)
    out = _put(tl.zeros((T_PAD, rows.shape[0]), dtype=tl.float32), tok, 0, p0)
    if T_PAD > 1:
        out = _put(out, tok, 1, p1)
    if T_PAD > 2:
        out = _put(_put(out, tok, 2, p2), tok, 3, p3)
    if T_PAD > 4:
        out = _put(_put(_put(_put(out, tok, 4, p4), tok, 5, p5), tok, 6, p6), tok, 7, p7)
    return out


@triton.jit
def _dot_block(pool_ptr, plane_off_ptr, lut_ptr, lut_off_ptr, bits_ptr, blk, rows, kw_lo, kw_hi, KW, x_ptr, x_off,
               KWX: tl.constexpr, T_PAD: tl.constexpr, BKW: tl.constexpr, LE: tl.constexpr, RAW: tl.constexpr):
    """[T_PAD, R] fp32: rows ``rows`` [R] of linear block ``blk`` times each token's activations over plane
    words kw_lo .. kw_hi - 1 (K steps of BKW words; KW = words per plane row), at the block's committed q.
    One uniform branch per program (one block each): nibble codes + shuffle (q <= 4), 5-plane byte codes +
    shuffle (q = 5), 8-plane byte codes + LUT loads (q >= 6); see ``_dot_words``."""
    q = tl.load(bits_ptr + blk)
    lut = lut_ptr + tl.load(lut_off_ptr + blk)
    rbase = (rows * (1 << q)).to(tl.uint32)
    lut_t = _lut(lut, rbase, q, LE)
    poff = plane_off_ptr + blk * 8
    acc = tl.zeros((T_PAD, rows.shape[0]), dtype=tl.float32)
    if q <= 4:
        for kw0 in range(kw_lo, kw_hi, BKW):
            acc += _dot_words(pool_ptr, poff, lut_t, lut, rbase, q, rows, kw0 + tl.arange(0, BKW), KW, x_ptr,
                              x_off, KWX, T_PAD, 4, 4, RAW)
    elif q == 5:
        for kw0 in range(kw_lo, kw_hi, BKW):
            acc += _dot_words(pool_ptr, poff, lut_t, lut, rbase, q, rows, kw0 + tl.arange(0, BKW), KW, x_ptr,
                              x_off, KWX, T_PAD, 8, 5, RAW)
    else:
        for kw0 in range(kw_lo, kw_hi, BKW):
            acc += _dot_words(pool_ptr, poff, lut_t, lut, rbase, q, rows, kw0 + tl.arange(0, BKW), KW, x_ptr,
                              x_off, KWX, T_PAD, 8, 8, RAW)
    return acc
