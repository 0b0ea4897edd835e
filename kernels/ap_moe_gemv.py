"""Decode path of the AP MoE (SPEC section 7): GEMV-style Triton kernels for a few tokens.

What it does: the same math as ``kernels.ap_moe.ap_moe_ref`` for small T (decode), with no tensor
cores and no routing preprocessing on the host or in extra launches:
  1. ``_gemv_gate_up_kernel``: one program per (pair j, tile of BLOCK_N intermediate columns). The
     program of expert e = ids[j] works only if j is e's first pair (its leader; the others exit
     at once), finds e's tokens from the [T, k] ids itself, and runs over the 2 * BLOCK_N gate and up
     rows (interleaved) BKW plane words at a time; SiLU(gate) * up goes to ``inter`` at the token's
     first pair row for e.
  2. ``_gemv_down_kernel``: same, over the down rows, with split-K (grid axis 2) so that one token
     still fills the GPU; each split writes its routing-weighted partial sum for every pair
     (t, s) with ids[t, s] == e into ``out`` [SPLIT, T*k, H] fp32, and the launcher sums the splits
     and the k slots (a deterministic reduction, no atomics).
Both build weights **word-major** (``_dot_words``): a thread keeps whole plane words and makes the 32
weights of each itself with constant shifts, so nothing changes layout (the [BLOCK_N, BLOCK_K]
tiles of ``kernels.ap_tile.weight_tile`` spread a word's columns over threads: a reshape through
shared memory, ~23 instructions per weight and 236 registers on sm_90); q stays a runtime value
(codes are built as 8-bit, then shifted), so one compile serves every bitwidth and a launch mixes
them. Measured on the H200: bench/results/ap_moe_notes.md. Each of the expert's tokens keeps its
own [rows, BKW] fp32 accumulator (T_PAD of them; tokens not routed to the expert are masked).
Nothing here syncs with the host: values of ``bits``, ``plane_offset`` and ``lut_offset`` are read
by the kernels at every call, so a runtime may change them in place between calls.
What it does not do: validate inputs (``kernels.ap_moe.ap_moe`` does) or handle many tokens well
(registers grow with T_PAD; prefill uses the dequantize + grouped GEMM path).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.ap_tile import lut_rows


@triton.jit
def _expert_of(ids_ptr, j, T, TOPK: tl.constexpr, T_PAD: tl.constexpr, K_PAD: tl.constexpr):
    """(e, lead, tok [T_PAD], active [T_PAD], row [T_PAD]) for pair j.

    e = ids[j]; lead: j is e's first pair (the program does the work); active[t]: lead and token t
    picked e in some slot; row[t]: its first such pair t * TOPK + s (where the gate_up kernel puts
    its intermediate). (Masks are built from tensors, not from the scalar ``lead``: the interpreter
    mistypes scalar-bool & tensor-bool.)
    """
    e = tl.load(ids_ptr + j)
    tok = tl.arange(0, T_PAD)
    slot = tl.arange(0, K_PAD)
    pair = tok[:, None] * TOPK + slot[None, :]
    ids = tl.load(ids_ptr + pair, mask=(tok[:, None] < T) & (slot[None, :] < TOPK), other=-1)
    match = ids == e
    earlier = tl.sum(tl.where(match & (pair < j), 1, 0))
    first = tl.min(tl.where(match, slot[None, :], K_PAD), axis=1)
    return e, earlier == 0, tok, (first < K_PAD) & (tok * 0 + earlier == 0), tok * TOPK + first


@triton.jit
def _bits_to(w, j: tl.constexpr, s: tl.constexpr):
    """Bits j, j+8, j+16, j+24 of uint32 ``w`` moved to bits s, s+8, s+16, s+24 (others 0): one shift, one and."""
    if j >= s:
        return (w >> (j - s)) & (0x01010101 << s)
    else:
        return (w << (s - j)) & (0x01010101 << s)


@triton.jit
def _words(pool_ptr, plane_off_ptr, p: tl.constexpr, q, word, wmask):
    """uint32 words of plane p at ``word`` (0 where p >= q: a masked load moves no bytes)."""
    return tl.load(pool_ptr + tl.load(plane_off_ptr + p) + word, mask=wmask & (word * 0 + p < q),
                   other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _dot_words(pool_ptr, plane_off_ptr, lut_row, q, rows, kw, KW, K, x_ptr, x_row, x_mask, T_PAD: tl.constexpr):
    """[T_PAD, R] fp32: W[rows, columns of words kw] @ x[t, those columns] for each token t, word-major.

    Each thread keeps whole plane words and makes all 32 weights of each word itself (no layout
    change): for j in 0..7, one shift + one and per plane put the codes of columns 32 kw + j + 8 b
    (b = 0..3) in the 4 bytes of one word, built as 8-bit codes (plane p at bit 7 - p, planes >= q
    zero) and shifted right by 8 - q, so q stays a runtime value (one compile for every bitwidth);
    each byte picks the row's LUT entry. rows [R] (clamped to valid rows), lut_row [R] pointers to
    their LUTs, kw [BKW] word ids (>= KW masked), x_row [T_PAD] element offsets of each token's
    activation row, stored word-major ([32, KW]: column 32 w + i at i * KW + w, see ``word_major``),
    x_mask [T_PAD] tokens to read (others contribute 0).
    Tiles are word-first ([BKW, R]): the plane loads are contiguous along dim 0, and Triton (3.6) lays
    a gather of unknown contiguity out with dim 0 along the lanes too, so a warp's LUT gather reads
    one row's LUT (one or two sectors) instead of one LUT per lane (16-32 sectors, measured with ncu
    on the rows-first tiles: bench/results/ap_moe_notes.md). The products are summed in a tile that takes
    the gather's layout and reduced over the words once per call (a loop-carried [.., BKW, R]
    accumulator would keep Triton's default layout, lanes along R, and convert every product to it).
    """
    wmask = (kw < KW)[:, None]
    word = kw[:, None] + rows[None, :] * KW
    w0 = _words(pool_ptr, plane_off_ptr, 0, q, word, wmask)
    w1 = _words(pool_ptr, plane_off_ptr, 1, q, word, wmask)
    w2 = _words(pool_ptr, plane_off_ptr, 2, q, word, wmask)
    w3 = _words(pool_ptr, plane_off_ptr, 3, q, word, wmask)
    w4 = _words(pool_ptr, plane_off_ptr, 4, q, word, wmask)
    w5 = _words(pool_ptr, plane_off_ptr, 5, q, word, wmask)
    w6 = _words(pool_ptr, plane_off_ptr, 6, q, word, wmask)
    w7 = _words(pool_ptr, plane_off_ptr, 7, q, word, wmask)
    shift = (8 - q).to(tl.uint32)
    for j in tl.static_range(8):
        c = _bits_to(w0, j, 7) | _bits_to(w1, j, 6) | _bits_to(w2, j, 5) | _bits_to(w3, j, 4)
        c = (c | _bits_to(w4, j, 3) | _bits_to(w5, j, 2) | _bits_to(w6, j, 1) | _bits_to(w7, j, 0)) >> shift
        for b in tl.static_range(4):
            code = ((c >> (8 * b)) & 0xFF).to(tl.int32)
            w = tl.load(lut_row[None, :] + code).to(tl.float32)
            col = kw * 32 + (j + 8 * b)
            xo = (j + 8 * b) * KW + kw  # activations word-major: a warp's lanes read consecutive elements
            if T_PAD == 1:  # 2-D products: no 3-D layout for Triton to convert the gathered weights to
                live = col * 0 + tl.sum(x_mask.to(tl.int32)) > 0
                xv = tl.load(x_ptr + tl.sum(x_row) + xo, mask=(col < K) & live, other=0.0).to(tl.float32)
                prod = w * xv[:, None]
            else:
                xv = tl.load(x_ptr + x_row[:, None] + xo[None, :], mask=x_mask[:, None] & (col < K)[None, :],
                             other=0.0).to(tl.float32)
                prod = w[None, :, :] * xv[:, :, None]
            if j == 0 and b == 0:
                part = prod
            else:
                part += prod
    if T_PAD == 1:
        out = tl.sum(part, axis=0)[None, :]
    else:
        out = tl.sum(part, axis=1)
    return out


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr,  # [T, 32, KW_H] activations (bf16/fp16), word-major (``word_major``), rows stride_xm apart
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
    stride_xm,
    TOPK: tl.constexpr,
    T_PAD: tl.constexpr,  # next power of 2 >= T
    K_PAD: tl.constexpr,  # next power of 2 >= TOPK
    BLOCK_N: tl.constexpr,  # intermediate columns per program (2 * BLOCK_N gate and up rows)
    BKW: tl.constexpr,  # plane words (32 columns each) per K step
):
    e, lead, tok, active, row = _expert_of(ids_ptr, tl.program_id(0), T, TOPK, T_PAD, K_PAD)
    blk = 2 * e
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    # 2 * BLOCK_N rows, gate and up interleaved, clamped so that every load is in bounds (stores are masked)
    r = tl.arange(0, 2 * BLOCK_N)
    rows = tl.minimum(tl.program_id(1) * BLOCK_N + r // 2, I - 1) + (r % 2) * I
    q, lut = lut_rows(lut_ptr, lut_off_ptr, bits_ptr, blk, rows)
    poff = plane_off_ptr + blk * 8
    kwn = (H + 31) // 32
    acc = tl.zeros((T_PAD, 2 * BLOCK_N), dtype=tl.float32)
    for kw0 in range(0, tl.where(lead, kwn, 0), BKW):
        acc += _dot_words(pool_ptr, poff, lut, q, rows, kw0 + tl.arange(0, BKW), kwn, H, x_ptr, tok * stride_xm,
                          active, T_PAD)
    g, u = tl.split(tl.reshape(acc, (T_PAD, BLOCK_N, 2)))
    h = g / (1.0 + tl.exp(-g)) * u
    kwi = (I + 31) // 32
    tl.store(inter_ptr + row[:, None] * (32 * kwi) + (n % 32) * kwi + n // 32, h.to(inter_ptr.dtype.element_ty),
             mask=active[:, None] & nmask[None, :])


@triton.jit
def _gemv_down_kernel(
    inter_ptr,  # [T*k, 32, KW_I] from _gemv_gate_up_kernel (word-major)
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
    kwn = (I + 31) // 32
    chunk = tl.cdiv(tl.cdiv(kwn, BKW), tl.num_programs(2)) * BKW
    kw_lo = pid_s * chunk
    kw_hi = tl.where(lead, tl.minimum(kwn, kw_lo + chunk), kw_lo)
    y = tl.zeros((T_PAD, BLOCK_N), dtype=tl.float32)
    for kw0 in range(kw_lo, kw_hi, BKW):
        y += _dot_words(pool_ptr, poff, lut, q, rows, kw0 + tl.arange(0, BKW), kwn, I, inter_ptr, row * (32 * kwn),
                        active, T_PAD)
    num_pairs = T * TOPK
    for s in tl.static_range(TOPK):
        pair = tok * TOPK + s
        ids_s = tl.load(ids_ptr + pair, mask=tok < T, other=-1)
        w_s = tl.load(w_ptr + pair, mask=tok < T, other=0.0)
        tl.store(out_ptr + (pid_s * num_pairs + pair[:, None]) * H + n[None, :], y * w_s[:, None],
                 mask=((ids_s == e) & active)[:, None] & nmask[None, :])


def word_major(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] -> [T, 32, ceil(K / 32)] (same dtype, zero-padded): column 32 w + i at [t, i, w], the order in
    which the GEMV's lanes (one plane word each) read activations, so that a warp's loads are contiguous."""
    t, kdim = x.shape
    kw = triton.cdiv(kdim, 32)
    if kdim % 32:
        x = torch.nn.functional.pad(x, (0, 32 * kw - kdim))
    return x.reshape(t, kw, 32).transpose(1, 2).contiguous()


def gemv_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: Any, cfg: dict[str, Any],
             workspace: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode MoE output y [T, H] in x's dtype; inputs as ``kernels.ap_moe.ap_moe`` (already checked).

    ``cfg``: ``{"gate_up": {BLOCK_N, BLOCK_K, num_warps}, "down": {BLOCK_N, BLOCK_K, num_warps, SPLIT_K}}``
    (BLOCK_K: columns per K step, a multiple of 32). With a ``workspace`` (inter [>=T*k, I], out [>=T*k, H]
    fp32) the down split-K is capped at out.shape[0] // (T*k), and inter is used when I is a multiple of 32
    (the word-major intermediate [T*k, 32, I / 32] then fits in it; otherwise one is allocated).
    """
    ex = experts
    t, k = topk_ids.shape
    num_pairs = t * k
    gu, dn = cfg["gate_up"], cfg["down"]
    split = dn.get("SPLIT_K", 1)
    kwi = triton.cdiv(ex.inter, 32)
    if workspace is None:
        inter = torch.empty(num_pairs, 32 * kwi, dtype=x.dtype, device=x.device)
        out = torch.empty(split * num_pairs, ex.hidden, dtype=torch.float32, device=x.device)
    else:
        inter, out = workspace
        split = max(1, min(split, out.shape[0] // num_pairs))
        if ex.inter % 32:
            inter = torch.empty(num_pairs, 32 * kwi, dtype=x.dtype, device=x.device)
    xw = word_major(x)
    ids = topk_ids.contiguous().view(-1)
    w = topk_w.contiguous().view(-1).to(torch.float32)
    t_pad, k_pad = triton.next_power_of_2(t), triton.next_power_of_2(k)
    _gemv_gate_up_kernel[(num_pairs, triton.cdiv(ex.inter, gu["BLOCK_N"]))](
        xw, inter, ids, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, t, ex.hidden, ex.inter,
        xw.stride(0), TOPK=k, T_PAD=t_pad, K_PAD=k_pad, BLOCK_N=gu["BLOCK_N"], BKW=gu["BLOCK_K"] // 32,
        num_warps=gu.get("num_warps", 4))
    _gemv_down_kernel[(num_pairs, triton.cdiv(ex.hidden, dn["BLOCK_N"]), split)](
        inter, out, ids, w, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, t, ex.hidden, ex.inter,
        TOPK=k, T_PAD=t_pad, K_PAD=k_pad, BLOCK_N=dn["BLOCK_N"], BKW=dn["BLOCK_K"] // 32,
        num_warps=dn.get("num_warps", 4))
    return out[:split * num_pairs].view(split, t, k, ex.hidden).sum((0, 2)).to(x.dtype)
