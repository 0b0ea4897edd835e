"""Decode path of the AP MoE for one token (SPEC section 7): word-first GEMV kernels (path ``gemv1``).

What it does: the same math as ``kernels.ap_moe.ap_moe_ref`` for T = 1 (batch-1 decode), as two launches
like ``kernels.ap_moe_gemv`` (gate_up with SiLU-and-mul, then down with split-K and the routing weight),
laid out for the memory pipe rather than for instruction count:
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
  * products are summed in a tile that keeps the gather's layout and reduced over the words once per
    K step (a loop-carried tile accumulator keeps Triton's default layout and converts every product).
Measured on the H200 (``bench/gemv_compare.py``, bench/results/gemv_probe/gemv_compare_h200.txt): at T = 1
1.2-2.3x faster than ``kernels.ap_moe_gemv``; with several tokens it was slower (0.67-1.33x), so T >= 2
keeps that path. Nothing here syncs with the host (tables are read at every call).
What it does not do: validate inputs (``kernels.ap_moe.ap_moe`` does) or take more than one token.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.ap_moe_gemv import _expert_of
from kernels.ap_tile import _plane, lut_rows


@triton.jit
def _bits_to(w, j: tl.constexpr, s: tl.constexpr):
    """Bits j, j+8, j+16, j+24 of uint32 ``w`` moved to bits s, s+8, s+16, s+24 (others 0): one shift, one and."""
    if j >= s:
        return (w >> (j - s)) & (0x01010101 << s)
    else:
        return (w << (s - j)) & (0x01010101 << s)


@triton.jit
def _dot_words(pool_ptr, plane_off_ptr, lut_row, q, rows, kw, KW, K, x_ptr, live):
    """[R] fp32: W[rows, columns of words kw] @ x for one token.

    rows [R] (clamped to valid rows), lut_row [R] pointers to their LUTs, kw [BKW] word ids (>= KW masked),
    x_ptr: the token's activations word-major ([32, KW]: column 32 w + i at i * KW + w); live: > 0 if the
    program works (else nothing is read). For j in 0..7, one shift + one and per plane put the codes of
    columns 32 kw + j + 8 b (b = 0..3) in the 4 bytes of one word; each byte picks the row's LUT entry.
    """
    wmask = (kw < KW)[:, None] & (kw * 0 + live > 0)[:, None]
    word = kw[:, None] + rows[None, :] * KW
    w0 = _plane(pool_ptr, plane_off_ptr, 0, q, word, wmask).to(tl.uint32, bitcast=True)
    w1 = _plane(pool_ptr, plane_off_ptr, 1, q, word, wmask).to(tl.uint32, bitcast=True)
    w2 = _plane(pool_ptr, plane_off_ptr, 2, q, word, wmask).to(tl.uint32, bitcast=True)
    w3 = _plane(pool_ptr, plane_off_ptr, 3, q, word, wmask).to(tl.uint32, bitcast=True)
    w4 = _plane(pool_ptr, plane_off_ptr, 4, q, word, wmask).to(tl.uint32, bitcast=True)
    w5 = _plane(pool_ptr, plane_off_ptr, 5, q, word, wmask).to(tl.uint32, bitcast=True)
    w6 = _plane(pool_ptr, plane_off_ptr, 6, q, word, wmask).to(tl.uint32, bitcast=True)
    w7 = _plane(pool_ptr, plane_off_ptr, 7, q, word, wmask).to(tl.uint32, bitcast=True)
    shift = (8 - q).to(tl.uint32)
    for j in tl.static_range(8):
        c = _bits_to(w0, j, 7) | _bits_to(w1, j, 6) | _bits_to(w2, j, 5) | _bits_to(w3, j, 4)
        c = (c | _bits_to(w4, j, 3) | _bits_to(w5, j, 2) | _bits_to(w6, j, 1) | _bits_to(w7, j, 0)) >> shift
        for b in tl.static_range(4):
            code = ((c >> (8 * b)) & 0xFF).to(tl.int32)
            w = tl.load(lut_row[None, :] + code).to(tl.float32)
            col = kw * 32 + (j + 8 * b)
            xv = tl.load(x_ptr + (j + 8 * b) * KW + kw, mask=(col < K) & (kw * 0 + live > 0), other=0.0).to(tl.float32)
            if j == 0 and b == 0:
                part = w * xv[:, None]
            else:
                part += w * xv[:, None]
    return tl.sum(part, axis=0)


@triton.jit
def _gemv1_gate_up_kernel(
    x_ptr,  # [32, KW_H] the token's activations (bf16/fp16), word-major (``word_major``)
    inter_ptr,  # [k, 32, KW_I] out: silu(gate) * up in x's dtype, word-major, at each expert's first slot
    ids_ptr,  # [k] expert ids of the token
    pool_ptr,  # int32 plane pool
    plane_off_ptr,  # int64 [2E, 8] word offsets of each block's planes
    lut_ptr,  # LUT pool (x's dtype)
    lut_off_ptr,  # int64 [2E] element offset of each block's committed LUT
    bits_ptr,  # int32 [2E] committed bitwidths
    H,  # hidden size = K of gate_up
    I,  # noqa: E741 - expert intermediate size
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,  # next power of 2 >= TOPK
    BLOCK_N: tl.constexpr,  # intermediate columns per program (2 * BLOCK_N gate and up rows)
    BKW: tl.constexpr,  # plane words (32 columns each) per K step
):
    e, lead, _, active, row = _expert_of(ids_ptr, tl.program_id(0), 1, TOPK, 1, K_PAD)
    blk = 2 * e
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # 2 * BLOCK_N rows, gate and up interleaved, clamped so that every load is in bounds (stores are masked)
    r = tl.arange(0, 2 * BLOCK_N)
    rows = tl.minimum(tl.program_id(1) * BLOCK_N + r // 2, I - 1) + (r % 2) * I
    q, lut = lut_rows(lut_ptr, lut_off_ptr, bits_ptr, blk, rows)
    poff = plane_off_ptr + blk * 8
    kwh = (H + 31) // 32
    live = tl.sum(active.to(tl.int32))
    acc = tl.zeros((2 * BLOCK_N,), dtype=tl.float32)
    for kw0 in range(0, tl.where(lead, kwh, 0), BKW):
        acc += _dot_words(pool_ptr, poff, lut, q, rows, kw0 + tl.arange(0, BKW), kwh, H, x_ptr, live)
    g, u = tl.split(tl.reshape(acc, (BLOCK_N, 2)))
    h = g / (1.0 + tl.exp(-g)) * u
    kwi = (I + 31) // 32
    r0 = tl.sum(row)
    tl.store(inter_ptr + r0 * (32 * kwi) + (n % 32) * kwi + n // 32, h.to(inter_ptr.dtype.element_ty),
             mask=(n < I) & (n * 0 + live > 0))


@triton.jit
def _gemv1_down_kernel(
    inter_ptr,  # [k, 32, KW_I] from _gemv1_gate_up_kernel (word-major)
    out_ptr,  # [SPLIT, k, H] fp32: per split, routing-weighted partial expert output of every slot
    ids_ptr,  # [k] expert ids
    w_ptr,  # [k] fp32 routing weights
    pool_ptr,
    plane_off_ptr,
    lut_ptr,
    lut_off_ptr,
    bits_ptr,
    H,  # rows of down
    I,  # noqa: E741 - K of down
    TOPK: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BKW: tl.constexpr,
):
    e, lead, _, active, row = _expert_of(ids_ptr, tl.program_id(0), 1, TOPK, 1, K_PAD)
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
    live = tl.sum(active.to(tl.int32))
    x_ptr = inter_ptr + tl.sum(row) * (32 * kwi)
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for kw0 in range(kw_lo, kw_hi, BKW):
        y += _dot_words(pool_ptr, poff, lut, q, rows, kw0 + tl.arange(0, BKW), kwi, I, x_ptr, live)
    for s in tl.static_range(TOPK):  # every slot of the token that picked e (a token may pick e twice)
        ids_s = tl.load(ids_ptr + s)
        w_s = tl.load(w_ptr + s)
        tl.store(out_ptr + (pid_s * TOPK + s) * H + n, y * w_s, mask=nmask & (n * 0 + ids_s == e) & (n * 0 + live > 0))


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
    """MoE output y [1, H] in x's dtype for one token x [1, H]; ids/weights [1, k] (checked by ``ap_moe``).

    ``cfg``: ``{"gate_up": {BLOCK_N, BLOCK_K, num_warps}, "down": {BLOCK_N, BLOCK_K, num_warps, SPLIT_K}}``
    (BLOCK_K: columns per K step, a multiple of 32; BLOCK_N of gate_up counts gate/up row pairs).
    Raises ``ValueError`` if x has more than one row.
    """
    ex = experts
    t, k = topk_ids.shape
    if t != 1:
        raise ValueError(f"the gemv1 path takes one token, got {t} (use path 'gemv')")
    gu, dn = cfg["gate_up"], cfg["down"]
    split = dn.get("SPLIT_K", 1)
    inter = torch.empty(k, 32 * triton.cdiv(ex.inter, 32), dtype=x.dtype, device=x.device)
    out = torch.empty(split * k, ex.hidden, dtype=torch.float32, device=x.device)
    ids = topk_ids.contiguous().view(-1)
    w = topk_w.contiguous().view(-1).to(torch.float32)
    k_pad = triton.next_power_of_2(k)
    _gemv1_gate_up_kernel[(k, triton.cdiv(ex.inter, gu["BLOCK_N"]))](
        word_major(x), inter, ids, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, ex.hidden,
        ex.inter, TOPK=k, K_PAD=k_pad, BLOCK_N=gu["BLOCK_N"], BKW=gu["BLOCK_K"] // 32,
        num_warps=gu.get("num_warps", 4))
    _gemv1_down_kernel[(k, triton.cdiv(ex.hidden, dn["BLOCK_N"]), split)](
        inter, out, ids, w, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, ex.hidden, ex.inter,
        TOPK=k, K_PAD=k_pad, BLOCK_N=dn["BLOCK_N"], BKW=dn["BLOCK_K"] // 32, num_warps=dn.get("num_warps", 4))
    return out.view(split, k, ex.hidden).sum((0, 1))[None].to(x.dtype)
