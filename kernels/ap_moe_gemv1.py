"""Decode path of the AP MoE for 1..8 tokens (SPEC section 7): word-first GEMV kernels (path ``gemv1``).

What it does: the same math as ``kernels.ap_moe.ap_moe_ref`` for T <= 8 (decode), as two launches like
``kernels.ap_moe_gemv`` (gate_up with SiLU-and-mul, then down with split-K and the routing weight; the
program of an expert's first (token, slot) pair does the expert's work for all its tokens), laid out for
the memory pipe rather than for instruction count:
  * **word-major**: a thread keeps whole int32 plane words and makes the 32 weights of each itself with
    constant shifts (``_bits_to``): codes are built as 8-bit (plane p at bit 7 - p, planes >= q zero) and
    shifted right by 8 - q, so q stays a runtime value and one compile serves every bitwidth;
  * **word-first tiles** ([BKW words, R rows]): plane loads are contiguous along dim 0, and Triton (3.6,
    the GPU machine's) lays out a gather whose contiguity it cannot prove with dim 0 along the lanes too,
    so a warp's LUT gather reads one row's LUT (one or two sectors). Rows-first tiles made each warp
    gather from 16-32 rows' LUTs (ncu on ``kernels.ap_moe_gemv``: 16 / 32 sectors per gather, ideal 2);
  * **word-major activations** (``word_major``: column 32 w + i at [i, w]): the lanes, one word each,
    read consecutive activations instead of elements 64 bytes apart; gate_up writes the intermediate
    word-major for down;
  * one [BKW, R] accumulator per token in the gather's layout, reduced over the words once per K step
    (a [T, BKW, R] product, or a loop-carried tile accumulator, kept Triton's default layout and converted
    every gathered tile through shared memory).
Measured on the H200: ``bench/gemv_compare.py`` (bench/results/gemv_probe/). Nothing here syncs with the
host (tables are read at every call).
What it does not do: validate inputs (``kernels.ap_moe.ap_moe`` does) or take more than 8 tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.ap_moe_gemv import _expert_of
from kernels.ap_tile import _plane, lut_rows

MAX_TOKENS = 8  # one [BKW, R] accumulator per token


@triton.jit
def _bits_to(w, j: tl.constexpr, s: tl.constexpr):
    """Bits j, j+8, j+16, j+24 of uint32 ``w`` moved to bits s, s+8, s+16, s+24 (others 0): one shift, one and."""
    if j >= s:
        return (w >> (j - s)) & (0x01010101 << s)
    else:
        return (w << (s - j)) & (0x01010101 << s)


@triton.jit
def _pick(v, tok, m: tl.constexpr):
    """Element m of the [T_PAD] tensor ``v`` as a scalar."""
    return tl.sum(tl.where(tok == m, v, 0))


@triton.jit
def _fma(p, w, x_ptr, off, xo, cmask, live, FIRST: tl.constexpr):
    """p + w [BKW, R] * x[off + xo] [BKW] (one token's activations; none read unless live > 0)."""
    xv = tl.load(x_ptr + off + xo, mask=cmask & (xo * 0 + live > 0), other=0.0).to(tl.float32)
    if FIRST:
        out = w * xv[:, None]
    else:
        out = p + w * xv[:, None]
    return out


@triton.jit
def _put(out, tok, m: tl.constexpr, p):
    """out [T_PAD, R] with row m replaced by p [BKW, R] summed over the words."""
    return tl.where((tok == m)[:, None], tl.sum(p, axis=0)[None, :], out)


@triton.jit
def _dot_words(pool_ptr, plane_off_ptr, lut_row, q, rows, kw, KW, K, x_ptr, x_off, live, T_PAD: tl.constexpr):
    """[T_PAD, R] fp32: W[rows, columns of words kw] @ x_t for each token t (T_PAD <= 8).

    rows [R] (clamped to valid rows), lut_row [R] pointers to their LUTs, kw [BKW] word ids (>= KW masked);
    token t's activations are word-major ([32, KW]: column 32 w + i at i * KW + w) at x_ptr + x_off[t], read
    only where live[t] > 0 (its row of the result is 0 otherwise). For j in 0..7, one shift + one and per plane
    put the codes of columns 32 kw + j + 8 b (b = 0..3) in the 4 bytes of one word; each byte picks the row's
    LUT entry, and the weights are used for every token (one [BKW, R] accumulator per token, all in the
    gather's layout: a 3-D [T, BKW, R] product made Triton convert every gathered tile).
    """
    tok = tl.arange(0, T_PAD)
    n_live = tl.sum(live)
    wmask = (kw < KW)[:, None] & (kw * 0 + n_live > 0)[:, None]
    word = kw[:, None] + rows[None, :] * KW
    w0 = _plane(pool_ptr, plane_off_ptr, 0, q, word, wmask).to(tl.uint32, bitcast=True)
    w1 = _plane(pool_ptr, plane_off_ptr, 1, q, word, wmask).to(tl.uint32, bitcast=True)
    w2 = _plane(pool_ptr, plane_off_ptr, 2, q, word, wmask).to(tl.uint32, bitcast=True)
    w3 = _plane(pool_ptr, plane_off_ptr, 3, q, word, wmask).to(tl.uint32, bitcast=True)
    w4 = _plane(pool_ptr, plane_off_ptr, 4, q, word, wmask).to(tl.uint32, bitcast=True)
    w5 = _plane(pool_ptr, plane_off_ptr, 5, q, word, wmask).to(tl.uint32, bitcast=True)
    w6 = _plane(pool_ptr, plane_off_ptr, 6, q, word, wmask).to(tl.uint32, bitcast=True)
    w7 = _plane(pool_ptr, plane_off_ptr, 7, q, word, wmask).to(tl.uint32, bitcast=True)
    o0, l0 = _pick(x_off, tok, 0), _pick(live, tok, 0)
    if T_PAD > 1:
        o1, l1 = _pick(x_off, tok, 1), _pick(live, tok, 1)
    if T_PAD > 2:
        o2, l2 = _pick(x_off, tok, 2), _pick(live, tok, 2)
        o3, l3 = _pick(x_off, tok, 3), _pick(live, tok, 3)
    if T_PAD > 4:
        o4, l4 = _pick(x_off, tok, 4), _pick(live, tok, 4)
        o5, l5 = _pick(x_off, tok, 5), _pick(live, tok, 5)
        o6, l6 = _pick(x_off, tok, 6), _pick(live, tok, 6)
        o7, l7 = _pick(x_off, tok, 7), _pick(live, tok, 7)
    shift = (8 - q).to(tl.uint32)
    for j in tl.static_range(8):
        c = _bits_to(w0, j, 7) | _bits_to(w1, j, 6) | _bits_to(w2, j, 5) | _bits_to(w3, j, 4)
        c = (c | _bits_to(w4, j, 3) | _bits_to(w5, j, 2) | _bits_to(w6, j, 1) | _bits_to(w7, j, 0)) >> shift
        for b in tl.static_range(4):
            code = ((c >> (8 * b)) & 0xFF).to(tl.int32)
            w = tl.load(lut_row[None, :] + code).to(tl.float32)
            cm = kw * 32 + (j + 8 * b) < K
            xo = (j + 8 * b) * KW + kw
            if j == 0 and b == 0:
                p0 = _fma(w, w, x_ptr, o0, xo, cm, l0, True)
            else:
                p0 = _fma(p0, w, x_ptr, o0, xo, cm, l0, False)
            if T_PAD > 1:
                if j == 0 and b == 0:
                    p1 = _fma(w, w, x_ptr, o1, xo, cm, l1, True)
                else:
                    p1 = _fma(p1, w, x_ptr, o1, xo, cm, l1, False)
            if T_PAD > 2:
                if j == 0 and b == 0:
                    p2 = _fma(w, w, x_ptr, o2, xo, cm, l2, True)
                    p3 = _fma(w, w, x_ptr, o3, xo, cm, l3, True)
                else:
                    p2 = _fma(p2, w, x_ptr, o2, xo, cm, l2, False)
                    p3 = _fma(p3, w, x_ptr, o3, xo, cm, l3, False)
            if T_PAD > 4:
                if j == 0 and b == 0:
                    p4 = _fma(w, w, x_ptr, o4, xo, cm, l4, True)
                    p5 = _fma(w, w, x_ptr, o5, xo, cm, l5, True)
                    p6 = _fma(w, w, x_ptr, o6, xo, cm, l6, True)
                    p7 = _fma(w, w, x_ptr, o7, xo, cm, l7, True)
                else:
                    p4 = _fma(p4, w, x_ptr, o4, xo, cm, l4, False)
                    p5 = _fma(p5, w, x_ptr, o5, xo, cm, l5, False)
                    p6 = _fma(p6, w, x_ptr, o6, xo, cm, l6, False)
                    p7 = _fma(p7, w, x_ptr, o7, xo, cm, l7, False)
    out = _put(tl.zeros((T_PAD, rows.shape[0]), dtype=tl.float32), tok, 0, p0)
    if T_PAD > 1:
        out = _put(out, tok, 1, p1)
    if T_PAD > 2:
        out = _put(_put(out, tok, 2, p2), tok, 3, p3)
    if T_PAD > 4:
        out = _put(_put(_put(_put(out, tok, 4, p4), tok, 5, p5), tok, 6, p6), tok, 7, p7)
    return out


@triton.jit
def _gemv1_gate_up_kernel(
    x_ptr,  # [T, 32, KW_H] activations (bf16/fp16), word-major (``word_major``)
    inter_ptr,  # [T*k, 32, KW_I] out: silu(gate) * up in x's dtype, word-major, at each (token, expert)'s 1st pair
    ids_ptr,  # [T*k] expert ids, row-major [T, k]
    pool_ptr,  # int32 plane pool
    plane_off_ptr,  # int64 [2E, 8] word offsets of each block's planes
    lut_ptr,  # LUT pool (x's dtype)
    lut_off_ptr,  # int64 [2E] element offset of each block's committed LUT
    bits_ptr,  # int32 [2E] committed bitwidths
    T,  # tokens
    H,  # hidden size = K of gate_up
    I,  # noqa: E741 - expert intermediate size
    TOPK: tl.constexpr,
    T_PAD: tl.constexpr,  # next power of 2 >= T (<= 8)
    K_PAD: tl.constexpr,  # next power of 2 >= TOPK
    BLOCK_N: tl.constexpr,  # intermediate columns per program (2 * BLOCK_N gate and up rows)
    BKW: tl.constexpr,  # plane words (32 columns each) per K step
):
    e, lead, tok, active, row = _expert_of(ids_ptr, tl.program_id(0), T, TOPK, T_PAD, K_PAD)
    blk = 2 * e
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # 2 * BLOCK_N rows, gate and up interleaved, clamped so that every load is in bounds (stores are masked)
    r = tl.arange(0, 2 * BLOCK_N)
    rows = tl.minimum(tl.program_id(1) * BLOCK_N + r // 2, I - 1) + (r % 2) * I
    q, lut = lut_rows(lut_ptr, lut_off_ptr, bits_ptr, blk, rows)
    poff = plane_off_ptr + blk * 8
    kwh = (H + 31) // 32
    live = active.to(tl.int32)
    acc = tl.zeros((T_PAD, 2 * BLOCK_N), dtype=tl.float32)
    for kw0 in range(0, tl.where(lead, kwh, 0), BKW):
        acc += _dot_words(pool_ptr, poff, lut, q, rows, kw0 + tl.arange(0, BKW), kwh, H, x_ptr, tok * (32 * kwh),
                          live, T_PAD)
    g, u = tl.split(tl.reshape(acc, (T_PAD, BLOCK_N, 2)))
    h = g / (1.0 + tl.exp(-g)) * u
    kwi = (I + 31) // 32
    tl.store(inter_ptr + row[:, None] * (32 * kwi) + ((n % 32) * kwi + n // 32)[None, :],
             h.to(inter_ptr.dtype.element_ty), mask=active[:, None] & (n < I)[None, :])


@triton.jit
def _gemv1_down_kernel(
    inter_ptr,  # [T*k, 32, KW_I] from _gemv1_gate_up_kernel (word-major)
    out_ptr,  # [SPLIT, T*k, H] fp32: per split, routing-weighted partial expert output of every pair
    ids_ptr,  # [T*k] expert ids
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
    BLOCK_N: tl.constexpr,
    BKW: tl.constexpr,
):
    e, lead, tok, active, row = _expert_of(ids_ptr, tl.program_id(0), T, TOPK, T_PAD, K_PAD)
    pid_s = tl.program_id(2)
    blk = 2 * e + 1
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    rows = tl.minimum(n, H - 1)
    q, lut = lut_rows(lut_ptr, lut_off_ptr, bits_ptr, blk, rows)
    poff = plane_off_ptr + blk * 8
    kwi = (I + 31) // 32
    chunk = tl.cdiv(tl.cdiv(kwi, BKW), tl.num_programs(2)) * BKW
    kw_lo = pid_s * chunk
    kw_hi = tl.where(lead, tl.minimum(kwi, kw_lo + chunk), kw_lo)
    y = tl.zeros((T_PAD, BLOCK_N), dtype=tl.float32)
    for kw0 in range(kw_lo, kw_hi, BKW):
        y += _dot_words(pool_ptr, poff, lut, q, rows, kw0 + tl.arange(0, BKW), kwi, I, inter_ptr, row * (32 * kwi),
                        active.to(tl.int32), T_PAD)
    num_pairs = T * TOPK
    for s in tl.static_range(TOPK):  # every slot (t, s) that picked e (a token may pick e twice)
        pair = tok * TOPK + s
        ids_s = tl.load(ids_ptr + pair, mask=tok < T, other=-1)
        w_s = tl.load(w_ptr + pair, mask=tok < T, other=0.0)
        tl.store(out_ptr + (pid_s * num_pairs + pair[:, None]) * H + n[None, :], y * w_s[:, None],
                 mask=((ids_s == e) & active)[:, None] & nmask[None, :])


def word_major(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> [T, 32, ceil(K / 32)] (same dtype, zero-padded): column 32 w + i at [t, i, w], the order in
    which the word-first kernels' lanes (one plane word each) read activations."""
    t, kdim = x.shape
    kw = triton.cdiv(kdim, 32)
    if kdim % 32:
        x = torch.nn.functional.pad(x, (0, 32 * kw - kdim))
    return x.reshape(t, kw, 32).transpose(1, 2).contiguous()


def gemv1_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: Any,
              cfg: dict[str, Any]) -> torch.Tensor:
    """MoE output y [T, H] in x's dtype for T <= 8 tokens x [T, H]; ids/weights [T, k] (checked by ``ap_moe``).

    ``cfg``: ``{"gate_up": {BLOCK_N, BLOCK_K, num_warps}, "down": {BLOCK_N, BLOCK_K, num_warps, SPLIT_K}}``
    (BLOCK_K: columns per K step, a multiple of 32; BLOCK_N of gate_up counts gate/up row pairs).
    Raises ``ValueError`` for more than 8 tokens.
    """
    ex = experts
    t, k = topk_ids.shape
    if t > MAX_TOKENS:
        raise ValueError(f"the gemv1 path takes at most {MAX_TOKENS} tokens, got {t} (use path 'gemv')")
    num_pairs = t * k
    gu, dn = cfg["gate_up"], cfg["down"]
    split = dn.get("SPLIT_K", 1)
    inter = torch.empty(num_pairs, 32 * triton.cdiv(ex.inter, 32), dtype=x.dtype, device=x.device)
    out = torch.empty(split * num_pairs, ex.hidden, dtype=torch.float32, device=x.device)
    ids = topk_ids.contiguous().view(-1)
    w = topk_w.contiguous().view(-1).to(torch.float32)
    t_pad, k_pad = triton.next_power_of_2(t), triton.next_power_of_2(k)
    _gemv1_gate_up_kernel[(num_pairs, triton.cdiv(ex.inter, gu["BLOCK_N"]))](
        word_major(x), inter, ids, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, t, ex.hidden,
        ex.inter, TOPK=k, T_PAD=t_pad, K_PAD=k_pad, BLOCK_N=gu["BLOCK_N"], BKW=gu["BLOCK_K"] // 32,
        num_warps=gu.get("num_warps", 4))
    _gemv1_down_kernel[(num_pairs, triton.cdiv(ex.hidden, dn["BLOCK_N"]), split)](
        inter, out, ids, w, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, t, ex.hidden, ex.inter,
        TOPK=k, T_PAD=t_pad, K_PAD=k_pad, BLOCK_N=dn["BLOCK_N"], BKW=dn["BLOCK_K"] // 32,
        num_warps=dn.get("num_warps", 4))
    return out.view(split, t, k, ex.hidden).sum((0, 2)).to(x.dtype)
