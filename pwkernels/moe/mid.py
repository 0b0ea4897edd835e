"""Mid-size MoE path (Triton): dequantized weight tiles fed to tensor cores, for tens of tokens (SPEC section 7).

Per tile of BLOCK_M (token, slot) pairs of one expert (pairs sorted by expert, each expert's segment padded to
BLOCK_M, as fused MoE kernels do) and BLOCK_N rows, a [BLOCK_N, BLOCK_K] weight tile is dequantized once in
registers (``pwkernels.moe.tile.weight_tile``) and multiplied on tensor cores (``tl.dot``): act(gate) * up ->
``inter`` [T*k, I] in x's dtype, then down times the routing weight -> [T*k, H] fp32, summed over k by the
launcher (deterministic, no atomics). The pair sort (``pwkernels.moe.align``) needs no host sync.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pwkernels.moe.activation import check_activation, gate_act
from pwkernels.moe.align import align_by_expert
from pwkernels.moe.experts import APExperts
from pwkernels.moe.launch import MidConfig
from pwkernels.moe.tile import lut_rows, weight_tile


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H] activations (bf16/fp16), rows stride_xm apart
    inter_ptr,  # [T*k, I] out: act(gate) * up, x's dtype
    sorted_ptr,  # [num_tiles * BLOCK_M] int32 pair ids (t * k + j), padded with T*k
    tile_expert_ptr,  # [num_tiles] int32 expert of each tile (num_experts: spare tile, no work)
    pool_ptr,  # int32 plane pool
    plane_off_ptr,  # int64 [2E, 8] word offsets of each block's planes
    lut_ptr,  # LUT pool (x's dtype)
    lut_off_ptr,  # int64 [2E] element offset of each block's committed LUT
    bits_ptr,  # int32 [2E] committed bitwidths
    num_pairs,  # T * k
    num_experts,  # E
    stride_xm,  # elements between rows of x
    TOPK: tl.constexpr,  # k
    H: tl.constexpr,  # hidden size = K of gate_up
    I: tl.constexpr,  # noqa: E741 - expert intermediate size
    BLOCK_M: tl.constexpr,  # pairs per tile
    BLOCK_N: tl.constexpr,  # intermediate columns per tile
    BLOCK_K: tl.constexpr,  # K step, a multiple of 32
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong, fp32 is exact
    GELU: tl.constexpr,  # GELU-tanh gate activation instead of SiLU (``pwkernels.moe.activation``)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    blk = 2 * tl.minimum(tl.load(tile_expert_ptr + pid_m), num_experts - 1)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pmask = pairs < num_pairs
    tok = pairs // TOPK
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    q, lut_g = lut_rows(lut_ptr, lut_off_ptr, bits_ptr, blk, n)
    lut_u = lut_g + I * (1 << q)
    poff = plane_off_ptr + blk * 8
    KW: tl.constexpr = (H + 31) // 32
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.where(tl.max(pmask.to(tl.int32)) > 0, H, 0), BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + tok[:, None] * stride_xm + cols[None, :], mask=pmask[:, None] & (cols[None, :] < H),
                     other=0.0)
        wg = weight_tile(pool_ptr, poff, lut_g, q, n, nmask, k0, H, KW, BLOCK_N, BLOCK_K)
        wu = weight_tile(pool_ptr, poff, lut_u, q, n + I, nmask, k0, H, KW, BLOCK_N, BLOCK_K)
        if DOT_FP32:
            xt, wg, wu = xt.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g += tl.dot(xt, tl.trans(wg))
        acc_u += tl.dot(xt, tl.trans(wu))
    h = gate_act(acc_g, GELU) * acc_u
    tl.store(inter_ptr + pairs[:, None] * I + n[None, :], h.to(inter_ptr.dtype.element_ty),
             mask=pmask[:, None] & nmask[None, :])


@triton.jit
def _down_kernel(
    inter_ptr,  # [T*k, I] from _gate_up_kernel
    out_ptr,  # [T*k, H] fp32 out: routing-weighted expert output per pair
    w_ptr,  # [T*k] fp32 routing weights
    sorted_ptr,  # [num_tiles * BLOCK_M] int32 pair ids, as in _gate_up_kernel
    tile_expert_ptr,  # [num_tiles] int32 expert of each tile
    pool_ptr,  # int32 plane pool
    plane_off_ptr,  # int64 [2E, 8] word offsets
    lut_ptr,  # LUT pool
    lut_off_ptr,  # int64 [2E] LUT offsets
    bits_ptr,  # int32 [2E] committed bitwidths
    num_pairs,  # T * k
    num_experts,  # E
    H: tl.constexpr,  # rows of down
    I: tl.constexpr,  # noqa: E741 - K of down
    BLOCK_M: tl.constexpr,  # pairs per tile
    BLOCK_N: tl.constexpr,  # output columns per tile
    BLOCK_K: tl.constexpr,  # K step, a multiple of 32
    DOT_FP32: tl.constexpr,  # interpreter only (see _gate_up_kernel)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    blk = 2 * tl.minimum(tl.load(tile_expert_ptr + pid_m), num_experts - 1) + 1
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pmask = pairs < num_pairs
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    q, lut = lut_rows(lut_ptr, lut_off_ptr, bits_ptr, blk, n)
    poff = plane_off_ptr + blk * 8
    KW: tl.constexpr = (I + 31) // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.where(tl.max(pmask.to(tl.int32)) > 0, I, 0), BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ht = tl.load(inter_ptr + pairs[:, None] * I + cols[None, :], mask=pmask[:, None] & (cols[None, :] < I),
                     other=0.0)
        wd = weight_tile(pool_ptr, poff, lut, q, n, nmask, k0, I, KW, BLOCK_N, BLOCK_K)
        if DOT_FP32:
            ht, wd = ht.to(tl.float32), wd.to(tl.float32)
        acc += tl.dot(ht, tl.trans(wd))
    wt = tl.load(w_ptr + pairs, mask=pmask, other=0.0)
    tl.store(out_ptr + pairs[:, None] * H + n[None, :], acc * wt[:, None], mask=pmask[:, None] & nmask[None, :])


def mid_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: APExperts,
            cfg: MidConfig, activation: str = "silu") -> torch.Tensor:
    """MoE output y [T, H] in x's dtype; x [T, H], ids / weights [T, k] as checked by ``pwkernels.moe.dispatch``.

    ``cfg``: the tile; ``activation``: ``silu`` or ``gelu_tanh``. Raises ``ValueError`` if x's rows are not
    contiguous.
    """
    gelu = check_activation(activation)
    ex = experts
    if x.stride(1) != 1:
        raise ValueError(f"x must be contiguous along the hidden dim, got strides {x.stride()}")
    t, k = topk_ids.shape
    num_pairs = t * k
    bm, bn, bk = cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K
    sorted_pairs, tile_expert = align_by_expert(topk_ids, ex.num_experts, bm)
    inter = torch.empty(num_pairs, ex.inter, dtype=x.dtype, device=x.device)
    out_pairs = torch.empty(num_pairs, ex.hidden, dtype=torch.float32, device=x.device)
    tiles = tile_expert.numel()
    warps = cfg.num_warps
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    _gate_up_kernel[(tiles, triton.cdiv(ex.inter, bn))](
        x, inter, sorted_pairs, tile_expert, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits,
        num_pairs, ex.num_experts, x.stride(0), TOPK=k, H=ex.hidden, I=ex.inter, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, DOT_FP32=interp, GELU=gelu, num_warps=warps)
    _down_kernel[(tiles, triton.cdiv(ex.hidden, bn))](
        inter, out_pairs, topk_w.flatten().float().contiguous(), sorted_pairs, tile_expert, ex.pool,
        ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, num_pairs, ex.num_experts, H=ex.hidden, I=ex.inter,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_FP32=interp, num_warps=warps)
    return out_pairs.view(t, k, ex.hidden).sum(1).to(x.dtype)
