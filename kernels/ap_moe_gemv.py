"""Decode path of the AP MoE (SPEC section 7): GEMV-style Triton kernels for a few tokens.

What it does: the same math as ``kernels.ap_moe.ap_moe_ref`` for small T (decode), with no tensor
cores and no routing preprocessing on the host or in extra launches:
  1. ``_gemv_gate_up_kernel``: one program per (pair j, tile of BLOCK_N intermediate columns). The
     program of expert e = ids[j] works only if j is e's first pair (its leader; the others exit
     at once), finds e's tokens from the [T, k] ids itself, dequantizes each [2 * BLOCK_N, BLOCK_K]
     tile of gate and up rows (interleaved) once in registers (``kernels.ap_tile.weight_tile``) and
     uses it for every token of e; SiLU(gate) * up goes to ``inter`` at the token's first pair row for e.
  2. ``_gemv_down_kernel``: same, over the down rows, with split-K (grid axis 2) so that one token
     still fills the GPU; each split writes its routing-weighted partial sum for every pair
     (t, s) with ids[t, s] == e into ``out`` [SPLIT, T*k, H] fp32, and the launcher sums the splits
     and the k slots (a deterministic reduction, no atomics).
With one token (T_PAD = 1) the K loop keeps a [BLOCK_N, BLOCK_K] fp32 accumulator and reduces once
at the end; with more, it loops over the expert's tokens and reduces each product per K tile.
Nothing here syncs with the host: values of ``bits``, ``plane_offset`` and ``lut_offset`` are read
by the kernels at every call, so a runtime may change them in place between calls.
What it does not do: validate inputs (``kernels.ap_moe.ap_moe`` does) or handle many tokens well
(each program loops over its expert's tokens; prefill uses the dequantize + grouped GEMM path).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels.ap_tile import lut_rows, weight_tile


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
def store_pairs(out_ptr, ids_ptr, w_ptr, y, e, tok, active, n, nmask, pid_s, T, H, TOPK: tl.constexpr):
    """Write y [T_PAD, BLOCK_N] (expert e's down rows n for each token) times the routing weight into every
    (token, slot) pair that picked e (a token may pick e twice) of split ``pid_s`` of out [SPLIT, T*k, H]."""
    num_pairs = T * TOPK
    for s in tl.static_range(TOPK):
        pair = tok * TOPK + s
        ids_s = tl.load(ids_ptr + pair, mask=tok < T, other=-1)
        w_s = tl.load(w_ptr + pair, mask=tok < T, other=0.0)
        tl.store(out_ptr + (pid_s * num_pairs + pair[:, None]) * H + n[None, :], y * w_s[:, None],
                 mask=((ids_s == e) & active)[:, None] & nmask[None, :])


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr,  # [T, H] activations (bf16/fp16), rows stride_xm apart
    inter_ptr,  # [T*k, I] out: silu(gate) * up in x's dtype, at each (token, expert)'s first pair row
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
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPREAD: tl.constexpr,  # code-building variant of weight_tile
):
    e, lead, tok, active, row = _expert_of(ids_ptr, tl.program_id(0), T, TOPK, T_PAD, K_PAD)
    blk = 2 * e
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    # one tile of 2 * BLOCK_N rows, gate and up rows interleaved, so that all their plane loads are in flight at once
    r = tl.arange(0, 2 * BLOCK_N)
    n2 = tl.program_id(1) * BLOCK_N + r // 2
    rmask = n2 < I
    rows = n2 + (r % 2) * I
    q, lut = lut_rows(lut_ptr, lut_off_ptr, bits_ptr, blk, rows)
    poff = plane_off_ptr + blk * 8
    kw = (H + 31) // 32
    k_end = tl.where(lead, H, 0)
    if T_PAD == 1:
        acc = tl.zeros((2 * BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            xk = tl.load(x_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
            w = weight_tile(pool_ptr, poff, lut, q, rows, rmask, k0, H, kw, 2 * BLOCK_N, BLOCK_K, SPREAD)
            acc += w.to(tl.float32) * xk[None, :]
        gu = tl.reshape(tl.sum(acc, axis=1), (1, BLOCK_N, 2))
    else:
        act = active.to(tl.int32)
        count = tl.sum(act)
        rank = tl.cumsum(act, 0) - act
        gu2 = tl.zeros((T_PAD, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_end, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            w = weight_tile(pool_ptr, poff, lut, q, rows, rmask, k0, H, kw, 2 * BLOCK_N, BLOCK_K, SPREAD).to(tl.float32)
            for m in range(0, count):
                t = tl.sum(tl.where(active & (rank == m), tok, 0))
                xk = tl.load(x_ptr + t * stride_xm + cols, mask=cols < H, other=0.0).to(tl.float32)
                gu2 = tl.where((tok == t)[:, None], gu2 + tl.sum(w * xk[None, :], axis=1)[None, :], gu2)
        gu = tl.reshape(gu2, (T_PAD, BLOCK_N, 2))
    g, u = tl.split(gu)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(inter_ptr + row[:, None] * I + n[None, :], h.to(inter_ptr.dtype.element_ty),
             mask=active[:, None] & nmask[None, :])


@triton.jit
def _gemv_down_kernel(
    inter_ptr,  # [T*k, I] from _gemv_gate_up_kernel
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
    BLOCK_K: tl.constexpr,
    SPREAD: tl.constexpr,
):
    e, lead, tok, active, row = _expert_of(ids_ptr, tl.program_id(0), T, TOPK, T_PAD, K_PAD)
    pid_s = tl.program_id(2)
    blk = 2 * e + 1
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    q, lut = lut_rows(lut_ptr, lut_off_ptr, bits_ptr, blk, n)
    poff = plane_off_ptr + blk * 8
    kw = (I + 31) // 32
    chunk = tl.cdiv(tl.cdiv(I, BLOCK_K), tl.num_programs(2)) * BLOCK_K
    k_lo = pid_s * chunk
    k_hi = tl.where(lead, tl.minimum(I, k_lo + chunk), k_lo)
    if T_PAD == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        r0 = tl.sum(row)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            hk = tl.load(inter_ptr + r0 * I + cols, mask=cols < I, other=0.0).to(tl.float32)
            wd = weight_tile(pool_ptr, poff, lut, q, n, nmask, k0, I, kw, BLOCK_N, BLOCK_K, SPREAD)
            acc += wd.to(tl.float32) * hk[None, :]
        y = tl.sum(acc, axis=1)[None, :]
    else:
        act = active.to(tl.int32)
        count = tl.sum(act)
        rank = tl.cumsum(act, 0) - act
        y = tl.zeros((T_PAD, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            wd = weight_tile(pool_ptr, poff, lut, q, n, nmask, k0, I, kw, BLOCK_N, BLOCK_K, SPREAD).to(tl.float32)
            for m in range(0, count):
                sel = active & (rank == m)
                t = tl.sum(tl.where(sel, tok, 0))
                r = tl.sum(tl.where(sel, row, 0))
                hk = tl.load(inter_ptr + r * I + cols, mask=cols < I, other=0.0).to(tl.float32)
                y = tl.where((tok == t)[:, None], y + tl.sum(wd * hk[None, :], axis=1)[None, :], y)
    store_pairs(out_ptr, ids_ptr, w_ptr, y, e, tok, active, n, nmask, pid_s, T, H, TOPK)


def token_pad(num_tokens: int) -> int:
    """T_PAD, the token count the gemv kernels are compiled for at ``num_tokens`` tokens (one specialization per
    power of 2; ``kernels.warmup`` compiles from this rule)."""
    return triton.next_power_of_2(num_tokens)

def gemv_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: Any, cfg: dict[str, Any],
             workspace: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode MoE output y [T, H] in x's dtype; inputs as ``kernels.ap_moe.ap_moe`` (already checked).

    ``cfg``: ``{"gate_up": {BLOCK_N, BLOCK_K, num_warps}, "down": {BLOCK_N, BLOCK_K, num_warps, SPLIT_K},
    "SPREAD": 0|1}``. With a ``workspace`` (inter [>=T*k, I], out [>=T*k, H] fp32) the down split-K is
    capped at out.shape[0] // (T*k) so that nothing is allocated.
    """
    ex = experts
    t, k = topk_ids.shape
    num_pairs = t * k
    gu, dn = cfg["gate_up"], cfg["down"]
    split = dn.get("SPLIT_K", 1)
    if workspace is None:
        inter = torch.empty(num_pairs, ex.inter, dtype=x.dtype, device=x.device)
        out = torch.empty(split * num_pairs, ex.hidden, dtype=torch.float32, device=x.device)
    else:
        inter, out = workspace
        split = max(1, min(split, out.shape[0] // num_pairs))
    ids = topk_ids.contiguous().view(-1)
    w = topk_w.contiguous().view(-1).to(torch.float32)
    t_pad, k_pad = token_pad(t), triton.next_power_of_2(k)
    spread = cfg.get("SPREAD", 1)
    _gemv_gate_up_kernel[(num_pairs, triton.cdiv(ex.inter, gu["BLOCK_N"]))](
        x, inter, ids, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, t, ex.hidden, ex.inter,
        x.stride(0), TOPK=k, T_PAD=t_pad, K_PAD=k_pad, BLOCK_N=gu["BLOCK_N"], BLOCK_K=gu["BLOCK_K"], SPREAD=spread,
        num_warps=gu.get("num_warps", 4))
    _gemv_down_kernel[(num_pairs, triton.cdiv(ex.hidden, dn["BLOCK_N"]), split)](
        inter, out, ids, w, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, t, ex.hidden, ex.inter,
        TOPK=k, T_PAD=t_pad, K_PAD=k_pad, BLOCK_N=dn["BLOCK_N"], BLOCK_K=dn["BLOCK_K"], SPREAD=spread,
        num_warps=dn.get("num_warps", 4))
    return out[:split * num_pairs].view(split, t, k, ex.hidden).sum((0, 2)).to(x.dtype)
