"""Decode path of the AP MoE (SPEC section 7): GEMV-style Triton kernels for a few tokens.

What it does: the same math as ``kernels.ap_moe.ap_moe_ref`` for small T (decode), with no tensor
cores and no routing preprocessing on the host or in extra launches:
  1. ``_gemv_gate_up_kernel``: one program per (pair j, tile of BLOCK_N intermediate columns). The
     program of expert e = ids[j] works only if j is e's first pair (its leader; the others exit
     at once), finds e's tokens from the [T, k] ids itself, and runs over [2 * BLOCK_N rows, BKW words]
     tiles of gate and up rows (interleaved, so all their plane loads are in flight at once). Fused:
     unpack + LUT lookup + FMA for every token of e (each weight is looked up once for all of them),
     then SiLU(gate) * up, stored to ``inter`` at the token's first pair row for e.
  2. ``_gemv_down_kernel``: same over the down rows, with split-K (grid axis 2) so that one token
     still fills the GPU; each split writes its routing-weighted partial sum for every pair
     (t, s) with ids[t, s] == e into ``out`` [SPLIT, T*k, H] fp32, and the launcher sums the splits
     and the k slots (a deterministic reduction, no atomics).
Why this shape (issue #4: the first version ran at 6-8% of the bandwidth floor, bound by instructions
per weight, ~28 at q = 4 in its sm_90 SASS plus shared-memory round trips): weights are unpacked word-major
(``kernels.ap_unpack``): each thread keeps its plane words and makes their 32 weights itself, 4 codes
per shift + and-or per plane, q a compile-time constant (one branch per program on the block's
runtime q, so a launch still mixes q 1..8), H and I compile-time too, so the activation offsets
are immediates and masks are compiled in only for ragged shapes. The sm_90 SASS of the q = 4 loop
is ~10 instructions per weight (code bytes ~2, LUT address ~3, LUT load, bf16->fp32, FMA, and one
activation load per word-row per thread). Activations are read in permuted column order (the
launcher permutes x, 2 KB at T = 1; the gate_up kernel writes ``inter`` permuted), since a thread's
weights of one step are columns 32 kw + i of its words, contiguous in that order.
Nothing here syncs with the host: values of ``bits``, ``plane_offset`` and ``lut_offset`` are read
by the kernels at every call, so a runtime may change them in place between calls.
What it does not do: validate inputs (``kernels.ap_moe.ap_moe`` does) or handle many tokens well
(each program does T_PAD FMAs per weight; prefill uses the dequantize + grouped GEMM path).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.ap_unpack import code_bytes, load_planes, lut_value, permute_cols


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
def _tile_dot(acc, pool_ptr, poff, lut_row, word_row, xp_ptr, x_off, x_ok, kw_lo, kw_hi, K: tl.constexpr,
              BKW: tl.constexpr, Q: tl.constexpr):
    """acc [T_PAD, R, BKW] fp32 += weight words [kw_lo, kw_hi) of R rows times each token's activations.

    lut_row [R]: LUT row pointers; word_row [R] int32: row * KW (rows clamped in range, so loads need no
    row mask); xp_ptr: activations in permuted column order (``kernels.ap_unpack.permute_cols``), token t's
    row at element x_off[t] (x_ok[t] False: read as 0; only looked at when T_PAD > 1). Q: the block's
    bitwidth (compile-time). Masks are compiled in only where needed: a K step past kw_hi (KW not a
    multiple of BKW) and columns >= K (pad bits of the last word, whose code 0 still has a LUT value).
    """
    KW: tl.constexpr = (K + 31) // 32
    MASK_K: tl.constexpr = KW % BKW != 0
    K_TAIL: tl.constexpr = K % 32 != 0
    MASK_T: tl.constexpr = acc.shape[0] > 1
    for kw0 in range(kw_lo, kw_hi, BKW):
        kw = kw0 + tl.arange(0, BKW)
        word = word_row[:, None] + kw[None, :]
        if MASK_K:
            kok = kw < kw_hi
            w0, w1, w2, w3, w4, w5, w6, w7 = load_planes(pool_ptr, poff, word, kok[None, :], Q, True)
        else:
            kok = kw >= 0
            w0, w1, w2, w3, w4, w5, w6, w7 = load_planes(pool_ptr, poff, word, None, Q, False)
        xb = xp_ptr + x_off[:, None] + kw[None, :]
        for j in tl.static_range(8):
            c = code_bytes(w0, w1, w2, w3, w4, w5, w6, w7, j, Q)
            for b in tl.static_range(4):
                v = lut_value(lut_row, c, b)
                if MASK_K or K_TAIL or MASK_T:
                    xm = x_ok[:, None] & kok[None, :]
                    if K_TAIL:
                        xm = xm & (kw * 32 + (j + 8 * b) < K)[None, :]
                    xv = tl.load(xb + (j + 8 * b) * KW, mask=xm, other=0.0).to(tl.float32)
                else:
                    xv = tl.load(xb + (j + 8 * b) * KW).to(tl.float32)
                acc += v[None, :, :] * xv[:, None, :]
    return acc


@triton.jit
def _rows_dot(pool_ptr, plane_off_ptr, lut_ptr, lut_off_ptr, bits_ptr, blk, rows, xp_ptr, x_off, x_ok,
              kw_lo, kw_hi, K: tl.constexpr, T_PAD: tl.constexpr, R: tl.constexpr, BKW: tl.constexpr):
    """[T_PAD, R] fp32: rows ``rows`` (in range) of block ``blk``, words [kw_lo, kw_hi), times each token's x.

    Branches once on the block's runtime bitwidth q into a loop compiled for that q.
    """
    q = tl.load(bits_ptr + blk)
    lut_base = lut_ptr + tl.load(lut_off_ptr + blk)
    poff = plane_off_ptr + blk * 8
    acc = tl.zeros((T_PAD, R, BKW), dtype=tl.float32)
    for Q in tl.static_range(1, 9):
        if q == Q:
            acc = _tile_dot(acc, pool_ptr, poff, lut_base + rows * (1 << Q), rows * ((K + 31) // 32), xp_ptr, x_off,
                            x_ok, kw_lo, kw_hi, K, BKW, Q)
    return tl.sum(acc, axis=2)


@triton.jit
def _gemv_gate_up_kernel(
    xp_ptr,  # [T, 32 * KWH] fp32 activations in permuted column order (KWH = ceil(H / 32))
    inter_ptr,  # [T*k, >= 32 * KWI] out: silu(gate) * up, x's dtype, permuted column order, rows stride_im apart
    ids_ptr,  # [T*k] expert ids, row-major [T, k]
    pool_ptr,  # int32 plane pool
    plane_off_ptr,  # int64 [2E, 8] word offsets of each block's planes
    lut_ptr,  # LUT pool (x's dtype)
    lut_off_ptr,  # int64 [2E] element offset of each block's committed LUT
    bits_ptr,  # int32 [2E] committed bitwidths
    T,  # tokens
    H: tl.constexpr,  # hidden size = K of gate_up
    I: tl.constexpr,  # noqa: E741 - expert intermediate size
    stride_im,
    TOPK: tl.constexpr,
    T_PAD: tl.constexpr,  # next power of 2 >= T
    K_PAD: tl.constexpr,  # next power of 2 >= TOPK
    BLOCK_N: tl.constexpr,  # gate (and as many up) rows per program
    BKW: tl.constexpr,  # plane words (32 columns each) per K step
):
    e, lead, tok, active, row = _expert_of(ids_ptr, tl.program_id(0), T, TOPK, T_PAD, K_PAD)
    # gate and up rows interleaved in one tile, so that all their plane loads are in flight at once
    r = tl.arange(0, 2 * BLOCK_N)
    n2 = tl.program_id(1) * BLOCK_N + r // 2
    rows = tl.minimum(n2, I - 1) + (r % 2) * I
    kwh = (H + 31) // 32
    gu = _rows_dot(pool_ptr, plane_off_ptr, lut_ptr, lut_off_ptr, bits_ptr, 2 * e, rows, xp_ptr, tok * 32 * kwh,
                   active, 0, tl.where(lead, kwh, 0), H, T_PAD, 2 * BLOCK_N, BKW)
    g, u = tl.split(tl.reshape(gu, (T_PAD, BLOCK_N, 2)))
    h = g / (1.0 + tl.exp(-g)) * u
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col = (n % 32) * ((I + 31) // 32) + n // 32
    tl.store(inter_ptr + row[:, None] * stride_im + col[None, :], h.to(inter_ptr.dtype.element_ty),
             mask=active[:, None] & (n < I)[None, :])


@triton.jit
def _gemv_down_kernel(
    inter_ptr,  # [T*k, >= 32 * KWI] from _gemv_gate_up_kernel (permuted column order)
    out_ptr,  # [SPLIT, T*k, H] fp32: per split, routing-weighted partial expert output of every pair
    ids_ptr,  # [T*k] expert ids
    w_ptr,  # [T*k] fp32 routing weights
    pool_ptr,
    plane_off_ptr,
    lut_ptr,
    lut_off_ptr,
    bits_ptr,
    T,
    H: tl.constexpr,  # rows of down
    I: tl.constexpr,  # noqa: E741 - K of down
    stride_im,
    TOPK: tl.constexpr,
    T_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BKW: tl.constexpr,
):
    e, lead, tok, active, row = _expert_of(ids_ptr, tl.program_id(0), T, TOPK, T_PAD, K_PAD)
    pid_s = tl.program_id(2)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    kwi = (I + 31) // 32
    chunk = tl.cdiv(tl.cdiv(kwi, BKW), tl.num_programs(2)) * BKW  # words per split, whole K steps
    kw_lo = pid_s * chunk
    kw_hi = tl.where(lead, tl.minimum(kwi, kw_lo + chunk), kw_lo)
    y = _rows_dot(pool_ptr, plane_off_ptr, lut_ptr, lut_off_ptr, bits_ptr, 2 * e + 1, tl.minimum(n, H - 1),
                  inter_ptr, row * stride_im, active, kw_lo, kw_hi, I, T_PAD, BLOCK_N, BKW)
    num_pairs = T * TOPK
    for s in tl.static_range(TOPK):
        pair = tok * TOPK + s
        ids_s = tl.load(ids_ptr + pair, mask=tok < T, other=-1)
        w_s = tl.load(w_ptr + pair, mask=tok < T, other=0.0)
        tl.store(out_ptr + (pid_s * num_pairs + pair[:, None]) * H + n[None, :], y * w_s[:, None],
                 mask=((ids_s == e) & active)[:, None] & nmask[None, :])


def gemv_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: Any, cfg: dict[str, Any],
             workspace: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode MoE output y [T, H] in x's dtype; inputs as ``kernels.ap_moe.ap_moe`` (already checked).

    ``cfg``: ``{"gate_up": {BLOCK_N, BLOCK_K, num_warps}, "down": {BLOCK_N, BLOCK_K, num_warps, SPLIT_K}}``
    (BLOCK_K: columns per K step, a multiple of 32). With a ``workspace`` (inter [>=T*k, I], out [>=T*k, H]
    fp32) the down split-K is capped at out.shape[0] // (T*k) so that nothing is allocated (the
    intermediate goes to ``inter`` in permuted column order when I is a multiple of 32, else to a new buffer).
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
        if inter.shape[1] < 32 * kwi or inter.stride(1) != 1:
            inter = torch.empty(num_pairs, 32 * kwi, dtype=x.dtype, device=x.device)
    xp = permute_cols(x, ex.hidden, torch.float32).contiguous()
    ids = topk_ids.contiguous().view(-1)
    w = topk_w.contiguous().view(-1).to(torch.float32)
    t_pad, k_pad = triton.next_power_of_2(t), triton.next_power_of_2(k)
    _gemv_gate_up_kernel[(num_pairs, triton.cdiv(ex.inter, gu["BLOCK_N"]))](
        xp, inter, ids, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, t, ex.hidden, ex.inter,
        inter.stride(0), TOPK=k, T_PAD=t_pad, K_PAD=k_pad, BLOCK_N=gu["BLOCK_N"], BKW=gu["BLOCK_K"] // 32,
num_warps=gu.get("num_warps", 4))
    _gemv_down_kernel[(num_pairs, triton.cdiv(ex.hidden, dn["BLOCK_N"]), split)](
        inter, out, ids, w, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, t, ex.hidden, ex.inter,
        inter.stride(0), TOPK=k, T_PAD=t_pad, K_PAD=k_pad, BLOCK_N=dn["BLOCK_N"], BKW=dn["BLOCK_K"] // 32,
num_warps=dn.get("num_warps", 4))
    return out[:split * num_pairs].view(split, t, k, ex.hidden).sum((0, 2)).to(x.dtype)
