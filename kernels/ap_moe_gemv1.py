"""Decode path of the AP MoE for 1..8 tokens (SPEC section 7): word-first GEMV kernels (path ``gemv1``).

What it does: the same math as ``kernels.ap_moe.ap_moe_ref`` for T <= 8 (decode; more tokens as chunks of 8, see
``chunks``), as two launches like
``kernels.ap_moe_gemv`` (gate_up with SiLU-and-mul, then down with split-K and the routing weight; the
program of an expert's first (token, slot) pair does the expert's work for all its tokens), laid out for
the memory pipe and for few instructions per weight:
  * **word-major**: a thread keeps whole int32 plane words and makes the 32 weights of each itself with
    a bit-matrix transpose (``_transpose4`` / ``_transpose8``: 4 / 12 delta swaps per 32 codes); q stays a
    runtime value and one compile serves every bitwidth, with one uniform branch per program (one block
    each): q <= 4 builds nibble codes from 4 planes, q = 5 byte codes from 5, q >= 6 byte codes from 8 (plane
    p at the field's bit W - 1 - p, shifted right by W - q);
  * **LUT by warp shuffle** (q <= 5 on 32-word tiles, q <= 4 on 16-word ones): the rows' LUTs sit in
    registers as an fp32 [32 or 16, R] tile, one entry per lane, and ``tl.gather`` along the entries
    becomes one SHFL.IDX per weight (no load, no bf16 convert), because the codes already have the
    gather's layout (words along the lanes). q >= 6 loads each weight from its row's LUT (L1 hit). sm_90
    SASS per weight at T = 1 (down, 32 rows x 32 words): 5.7 / 6.4 / 9.5 (``bench/sass_count.py``; merging
    plane by plane instead of the transpose: 5.9 / 7.2 / 12.4);
  * **word-first tiles** ([BKW words, R rows]): plane loads are contiguous along dim 0, and Triton (3.6,
    the GPU machine's) lays out a load whose contiguity it cannot prove with dim 0 along the lanes too,
    so a warp's LUT loads (q >= 6) read one row's LUT. Rows-first tiles made each warp gather from 16-32
    rows' LUTs (ncu on ``kernels.ap_moe_gemv``: 16 / 32 sectors per gather, ideal 2);
  * **word-major activations** (``word_major``: column 32 w + i at [i, w]), rows padded to whole K steps
    and strided by constexpr word counts: the lanes, one word each, read consecutive activations, unmasked,
    at constant offsets; gate_up writes the intermediate word-major (zeroing its padded columns) for down;
  * one [BKW, R] accumulator per token in the gather's layout, reduced over the words once per K step
    (a [T, BKW, R] product, or a loop-carried tile accumulator, kept Triton's default layout and converted
    every gathered tile through shared memory).
  * **compile time**: at one token the 32 codes of a word are unrolled in Triton's IR (``tl.static_range``); at
    2..8 tokens they are a loop of 8 (nibbles) or 4 (bytes) that LLVM unrolls (T_PAD 2, 4) or keeps (T_PAD 8),
    because Triton's coalesce pass grows with the loads in the IR times its size: unrolled, a T_PAD 4 kernel
    took 73-90 s to compile (72 of 74 s in ``TritonGPUCoalesce``), looped 9 s, with the same SASS per weight
    within 2%; at T_PAD 8 about 10 min against 15 s, for ~10% more SASS per weight (the loop LLVM keeps: 82
    instructions per 4 codes of 8 tokens, vs 18.85 per weight unrolled; gate_up) (``bench/sass_count.py``,
    sm_90, ninth session). ``kernels/warmup.py`` compiles them before serving.
Measured on the H200: ``bench/gemv_compare.py`` (bench/results/gemv_probe/). Nothing here syncs with the
host (tables are read at every call).
Sorted-slots mode (config key ``SLOTS`` = S, thirteenth session): the pairs sorted by expert, S pairs of one expert
per program (``_slots_of``), any number of tokens in one launch; each weight is decoded once per S pairs of its
expert, not once per 8-token chunk for T_PAD token slots of which most are idle (at 16 tokens of Qwen's top-4 of
60, a used expert gets ~1.1 pairs). Shipped since the fourteenth session for Qwen's routed experts at 2..32 tokens
and Mixtral's at 2..16 (``bench/gemv_compare.py --slots``: 3.51x over ``fused`` at 16 Qwen tokens summed over q,
bench/results/gemv_probe/gemv1_slots_s14_h200.txt).
What it does not do: validate inputs (``kernels.ap_moe.ap_moe`` does), or share an expert's weight reads across
chunks of 8 tokens in the token-slot mode (each chunk reads its experts again).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.ap_moe_gemv import _expert_of, store_pairs, token_pad
from kernels.ap_moe_layout import combine, padded_words, word_major
from kernels.ap_tile import _plane
from kernels.bit_transpose import _transpose4, _transpose8
from kernels.lut_shuffle import _lut, _shfl
from kernels.pair_sort import _slots_of, sort_pairs

MAX_TOKENS = 8  # one [BKW, R] accumulator per token


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


@triton.jit
def _gemv1_gate_up_kernel(
    x_ptr,  # [T, 32, KWX] activations (bf16/fp16), word-major and zero-padded (``word_major``)
    inter_ptr,  # [T*k, 32, KWO] out: silu(gate) * up in x's dtype, word-major, at each (token, expert)'s 1st pair
    ids_ptr,  # [T*k] expert ids, row-major [T, k] (SORTED: sorted by expert)
    order_ptr,  # SORTED: [T*k] sorted position -> pair (else unused)
    seg_ptr,  # SORTED: [T*k] sorted position -> first position of its expert's run (else unused)
    pool_ptr,  # int32 plane pool
    plane_off_ptr,  # int64 [2E, 8] word offsets of each block's planes
    lut_ptr,  # LUT pool (x's dtype)
    lut_off_ptr,  # int64 [2E] element offset of each block's committed LUT
    bits_ptr,  # int32 [2E] committed bitwidths
    T,  # tokens
    H,  # hidden size = K of gate_up
    I,  # noqa: E741 - expert intermediate size
    TOPK: tl.constexpr,
    T_PAD: tl.constexpr,  # next power of 2 >= T (<= 8); SORTED: the slots per program
    K_PAD: tl.constexpr,  # next power of 2 >= TOPK
    SORTED: tl.constexpr,  # sorted-slots mode (``_slots_of``)
    BLOCK_N: tl.constexpr,  # intermediate columns per program (2 * BLOCK_N gate and up rows)
    BKW: tl.constexpr,  # plane words (32 columns each) per K step
    LE: tl.constexpr,  # LUT entries held in registers for shuffles: 32 if BKW >= 32 else 16
    RAW: tl.constexpr,  # shuffles by shfl.sync (inline PTX, BKW 16 or 32, CUDA only), else tl.gather
    KWX: tl.constexpr,  # words of an x row (ceil(H / 32) rounded up to a multiple of BKW)
    KWO: tl.constexpr,  # words of an inter row (down's KWX)
    PAD_O: tl.constexpr,  # power of 2 >= 32 * KWO - I: inter columns the first program of a pair zeroes
):
    if SORTED:
        e, lead, active, row, tok = _slots_of(ids_ptr, order_ptr, seg_ptr, tl.program_id(0), T * TOPK, TOPK, T_PAD)
        x_off = tok * (32 * KWX)
    else:
        e, lead, tok, active, row = _expert_of(ids_ptr, tl.program_id(0), T, TOPK, T_PAD, K_PAD)
        x_off = tl.minimum(tok, T - 1) * (32 * KWX)  # padded tokens read the last token's (finite) row
    blk = 2 * e
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # 2 * BLOCK_N rows, gate and up interleaved, clamped so that every load is in bounds (stores are masked)
    r = tl.arange(0, 2 * BLOCK_N)
    rows = tl.minimum(tl.program_id(1) * BLOCK_N + r // 2, I - 1) + (r % 2) * I
    kwh = (H + 31) // 32
    acc = _dot_block(pool_ptr, plane_off_ptr, lut_ptr, lut_off_ptr, bits_ptr, blk, rows, 0, tl.where(lead, kwh, 0),
                     kwh, x_ptr, x_off, KWX, T_PAD, BKW, LE, RAW)
    g, u = tl.split(tl.reshape(acc, (T_PAD, BLOCK_N, 2)))
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(inter_ptr + row[:, None] * (32 * KWO) + ((n % 32) * KWO + n // 32)[None, :],
             h.to(inter_ptr.dtype.element_ty), mask=active[:, None] & (n < I)[None, :])
    if tl.program_id(1) == 0:  # down reads whole padded rows unmasked: columns I .. 32 * KWO - 1 are 0
        c = I + tl.arange(0, PAD_O)
        tl.store(inter_ptr + row[:, None] * (32 * KWO) + ((c % 32) * KWO + c // 32)[None, :],
                 tl.zeros((T_PAD, PAD_O), dtype=inter_ptr.dtype.element_ty),
                 mask=active[:, None] & (c < 32 * KWO)[None, :])


@triton.jit
def _gemv1_down_kernel(
    inter_ptr,  # [T*k, 32, KWX] from _gemv1_gate_up_kernel (word-major, zero-padded)
    out_ptr,  # [SPLIT, T*k, H] fp32: per split, routing-weighted partial expert output of every pair
    ids_ptr,  # [T*k] expert ids (SORTED: sorted by expert)
    order_ptr,  # SORTED: [T*k] sorted position -> pair (else unused)
    seg_ptr,  # SORTED: [T*k] sorted position -> first position of its expert's run (else unused)
    w_ptr,  # [T*k] fp32 routing weights
    pool_ptr,
    plane_off_ptr,
    lut_ptr,
    lut_off_ptr,
    bits_ptr,
    T,
    H,  # rows of down
    I,  # noqa: E741 - K of down
    TOPK: tl.constexpr,
    T_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    SORTED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BKW: tl.constexpr,
    LE: tl.constexpr,
    RAW: tl.constexpr,
    KWX: tl.constexpr,  # words of an inter row (ceil(I / 32) rounded up so that every split's K steps fit)
):
    if SORTED:  # inactive slots hold p's own pair, whose inter row gate_up wrote
        e, lead, active, row, tok = _slots_of(ids_ptr, order_ptr, seg_ptr, tl.program_id(0), T * TOPK, TOPK, T_PAD)
    else:
        e, lead, tok, active, row = _expert_of(ids_ptr, tl.program_id(0), T, TOPK, T_PAD, K_PAD)
        # tokens with no work read the first active token's row (written by gate_up, finite)
        row = tl.where(active, row, tl.min(tl.where(active, row, T * TOPK)))
    pid_s = tl.program_id(2)
    blk = 2 * e + 1
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    rows = tl.minimum(n, H - 1)
    kwi = (I + 31) // 32
    chunk = tl.cdiv(tl.cdiv(kwi, BKW), tl.num_programs(2)) * BKW
    kw_lo = pid_s * chunk
    kw_hi = tl.where(lead, tl.minimum(kwi, kw_lo + chunk), kw_lo)
    y = _dot_block(pool_ptr, plane_off_ptr, lut_ptr, lut_off_ptr, bits_ptr, blk, rows, kw_lo, kw_hi, kwi, inter_ptr,
                   row * (32 * KWX), KWX, T_PAD, BKW, LE, RAW)
    if SORTED:  # one pair per slot
        w_s = tl.load(w_ptr + row)
        tl.store(out_ptr + (pid_s * T * TOPK + row[:, None]) * H + n[None, :], y * w_s[:, None],
                 mask=active[:, None] & nmask[None, :])
    else:
        store_pairs(out_ptr, ids_ptr, w_ptr, y, e, tok, active, n, nmask, pid_s, T, H, TOPK)


def _raw(tile: dict[str, Any], bkw: int, x: torch.Tensor) -> bool:
    """Whether a kernel's shuffles are raw ``shfl.sync`` (``_shfl``): asked for by the tile (``RAW_SHFL: 1``), on a
    32- or 16-word K step (the LUT tile's shape, words along the lanes) and on NVIDIA CUDA: the interpreter runs no
    PTX, and ROCm builds of torch also report ``is_cuda`` but compile for AMD GPUs (there the tile falls back to
    ``tl.gather``)."""
    return bool(tile.get("RAW_SHFL", 0)) and bkw in (16, 32) and x.is_cuda and torch.version.hip is None


def _entries(bkw: int) -> int:
    """LUT entries kept in registers: one per lane of the words dimension (32 words: q <= 5 by shuffle)."""
    return 32 if bkw >= 32 else 16


def gemv1_partials(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: Any,
                   cfg: dict[str, Any], xw: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing-weighted partial outputs [SPLIT, T, k, H] fp32 of T tokens x [T, H] (ids/weights [T, k],
    checked by ``ap_moe``), and the word-major activations [T, 32, KWX] they were computed from (``xw``: reuse
    them, e.g. for the shared expert of the same x, when the gate_up tiles give the same KWX).

    ``cfg``: ``{"gate_up": {BLOCK_N, BLOCK_K, num_warps}, "down": {BLOCK_N, BLOCK_K, num_warps, SPLIT_K}}``
    (BLOCK_K: columns per K step, a multiple of 32; BLOCK_N of gate_up counts gate/up row pairs). The word
    counts of the padded activation rows are compile-time constants, so each (H, I) compiles its own kernels.
    More than 8 tokens run as chunks of 8 (the last one holds the rest), one launch pair each, with their partials
    concatenated along T: an expert used in several chunks is read once per chunk (``chunks``).
    ``cfg["SLOTS"]`` = S > 0 selects the sorted-slots mode instead, for any T in one launch pair: the (token, slot)
    pairs are sorted by expert on the device (``kernels.pair_sort``: one launch, no host sync) and each
    program does S consecutive pairs of one expert (``_slots_of``), so an expert with c tokens is read ceil(c / S)
    times and each weight feeds S token slots, not T_PAD (most routed experts get 1-2 of a batch's tokens).
    S must be 1, 2, 4 or 8. Raises ``ValueError`` for another S.
    """
    ex = experts
    t, k = topk_ids.shape
    slots = check_slots(cfg)
    if t > MAX_TOKENS and not slots:
        return _chunked_partials(x, topk_ids, topk_w, experts, cfg, xw)
    num_pairs = t * k
    gu, dn = cfg["gate_up"], cfg["down"]
    split = dn.get("SPLIT_K", 1)
    bkw_gu, bkw_dn = gu["BLOCK_K"] // 32, dn["BLOCK_K"] // 32
    kwx, kwo = padded_words(ex.hidden, bkw_gu), padded_words(ex.inter, bkw_dn, split)
    if xw is None or xw.shape != (t, 32, kwx):
        xw = word_major(x, kwx)
    inter = torch.empty(num_pairs, 32 * kwo, dtype=x.dtype, device=x.device)
    out = torch.empty(split * num_pairs, ex.hidden, dtype=torch.float32, device=x.device)
    ids = topk_ids.contiguous().view(-1)
    w = topk_w.contiguous().view(-1).to(torch.float32)
    t_pad, k_pad = token_pad(t), triton.next_power_of_2(k)
    order = seg = ids  # unused unless sorted
    if slots:  # pairs sorted by expert on the device (one launch, no host sync): S pairs of one expert per program
        ids, order, seg = sort_pairs(ids)
        t_pad = slots
    _gemv1_gate_up_kernel[(num_pairs, triton.cdiv(ex.inter, gu["BLOCK_N"]))](
        xw, inter, ids, order, seg, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, t, ex.hidden,
        ex.inter, TOPK=k, T_PAD=t_pad, K_PAD=k_pad, SORTED=bool(slots), BLOCK_N=gu["BLOCK_N"], BKW=bkw_gu,
        LE=_entries(bkw_gu),
        RAW=_raw(gu, bkw_gu, x), KWX=kwx, KWO=kwo, PAD_O=triton.next_power_of_2(max(32 * kwo - ex.inter, 1)),
        num_warps=gu.get("num_warps", 4))
    _gemv1_down_kernel[(num_pairs, triton.cdiv(ex.hidden, dn["BLOCK_N"]), split)](
        inter, out, ids, order, seg, w, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, t, ex.hidden,
        ex.inter, TOPK=k, T_PAD=t_pad, K_PAD=k_pad, SORTED=bool(slots), BLOCK_N=dn["BLOCK_N"], BKW=bkw_dn,
        LE=_entries(bkw_dn),
        RAW=_raw(dn, bkw_dn, x), KWX=kwo, num_warps=dn.get("num_warps", 4))
    return out.view(split, t, k, ex.hidden), xw


def chunks(num_tokens: int) -> list[tuple[int, int]]:
    """[start, end) token ranges that the gemv1 path runs one launch pair each: 8 tokens apiece, the rest last (so
    at most one chunk pads to a smaller power of 2, and ``kernels.warmup`` compiles 8 + 1, 2, 4, 8 tokens)."""
    return [(a, min(a + MAX_TOKENS, num_tokens)) for a in range(0, num_tokens, MAX_TOKENS)]


def check_slots(cfg: dict[str, Any]) -> int:
    """``cfg["SLOTS"]`` (0 if absent): 0 (token slots) or 1, 2, 4, 8 (sorted slots, pairs per program), as a plain
    int. Raises ``ValueError`` for anything else (3, 16, -1, "2", 2.0, True, None)."""
    slots = cfg.get("SLOTS", 0)
    if type(slots) is not int or slots not in (0, 1, 2, 4, 8):
        raise ValueError(f"SLOTS must be 0 (token slots), 1, 2, 4 or 8 (pairs per program), got {slots!r}")
    return slots


def launches(num_tokens: int, cfg: dict[str, Any] | None = None) -> list[tuple[int, int]]:
    """(T_PAD, T) of each launch pair the gemv1 kernels of config ``cfg`` make for ``num_tokens`` tokens: T_PAD is
    a constexpr, T the runtime token count passed (Triton specializes on it too: ``kernels.warmup``). In the
    sorted-slots mode one pair (SLOTS, T); else one per chunk of ``chunks``, its tokens padded to a power of 2."""
    slots = check_slots(cfg or {})
    if slots:
        return [(slots, num_tokens)]
    return [(token_pad(b - a), b - a) for a, b in chunks(num_tokens)]


def _chunked_partials(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: Any,
                      cfg: dict[str, Any], xw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gemv1_partials`` of more than 8 tokens, chunk by chunk (``chunks``): partials [SPLIT, T, k, H] fp32 and the
    word-major activations [T, 32, KWX] of all T tokens (built once, or ``xw`` if it is x's for this tile)."""
    kwx = padded_words(experts.hidden, cfg["gate_up"]["BLOCK_K"] // 32)
    if xw is None or xw.shape != (x.shape[0], 32, kwx):  # none, or not x's (e.g. another tile's)
        xw = word_major(x, kwx)
    parts = [gemv1_partials(x[a:b], topk_ids[a:b], topk_w[a:b], experts, cfg, xw[a:b])[0]
             for a, b in chunks(x.shape[0])]
    return torch.cat(parts, dim=1), xw


def gemv1_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: Any,
              cfg: dict[str, Any]) -> torch.Tensor:
    """MoE output y [T, H] in x's dtype for tokens x [T, H] (chunks of 8 beyond 8); ids/weights [T, k] (checked by
    ``ap_moe``);
    ``cfg`` and errors as in ``gemv1_partials``."""
    return combine(gemv1_partials(x, topk_ids, topk_w, experts, cfg)[0], None, x.dtype)
