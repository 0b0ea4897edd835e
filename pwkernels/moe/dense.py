"""The 16-bit MoE kernels (Triton): table-addressed bf16/fp16 experts, the twin of ``pwkernels.moe.ref.dense_moe_ref``.

What it computes: ``y[t] = sum_j w_tj * down_e(act(gate_e(x_t)) * up_e(x_t))``, e = ids[t, j], reading each block
of ``DenseExperts`` at its table offset (SPEC section 7's path for experts held at 16 bits in the page pool).
Accumulation in fp32, the intermediate [T*k, I] stored in x's dtype, the sum over k rounded once. Three paths,
chosen per call by token count (``DenseMoEConfig``):
  * GEMV (few tokens): one program per (pair, BLOCK_N rows) reads its expert's rows in K steps and reduces them
    against the pair's activations (no ``tl.dot``); the down kernel sums the k pairs of a token itself.
  * grouped GEMM (more tokens): pairs sorted by expert and padded to BLOCK_M per expert (``align_by_expert``, as
    ``pwkernels.moe.mid``), weight tiles straight from the pool into ``tl.dot``;
  * where the experts lie in the pool at one stride (``DenseExperts.stacked``), from
    ``DenseMoEConfig.grouped_mm_from(I)`` tokens: cuBLAS' grouped GEMM (``pwkernels.moe.dense_grouped``), where
    it runs in one launch (bf16 on sm90 / sm100: ``stacked_views`` gives no views elsewhere).
None syncs with the host, so CUDA graphs can capture each. It does not route or add a shared expert (the
caller runs the shared expert as one more ``DenseExperts`` with every token's weight).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pwkernels.moe.activation import check_activation, gate_act
from pwkernels.moe.align import align_by_expert
from pwkernels.moe.dense_grouped import grouped_mm_moe
from pwkernels.moe.experts import DenseExperts
from pwkernels.moe.launch import DenseGemmTile, DenseGemvTile, DenseMoEConfig
from pwkernels.rounding import round_to

DEFAULT_CONFIG = DenseMoEConfig()


@triton.jit
def _gemv_gate_up_kernel(
    x_ptr,  # [T, H] activations, rows stride_xm apart
    inter_ptr,  # [T*k, I] out: act(gate) * up, x's dtype
    ids_ptr,  # [T*k] expert id of each pair (t * k + j)
    pool_ptr,  # 16-bit weight pool
    off_ptr,  # int64 [2E] element offset of each block
    num_experts,  # E (ids are clamped to it)
    stride_xm,  # elements between rows of x
    TOPK: tl.constexpr,  # k
    H: tl.constexpr,  # hidden size = K of gate_up
    I: tl.constexpr,  # noqa: E741 - expert intermediate size
    BLOCK_N: tl.constexpr,  # gate (and up) rows per program
    BLOCK_K: tl.constexpr,  # columns per K step
    GELU: tl.constexpr,  # GELU-tanh gate activation instead of SiLU
):
    pair = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    rows = tl.minimum(n, I - 1).to(tl.int64)  # clamped: loads stay inside the block, the store is masked
    e = tl.minimum(tl.maximum(tl.load(ids_ptr + pair).to(tl.int64), 0), num_experts - 1)
    base = tl.load(off_ptr + 2 * e)
    tok = pair // TOPK
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < H
        xv = tl.load(x_ptr + tok * stride_xm + k, mask=km, other=0.0).to(tl.float32)
        wg = tl.load(pool_ptr + base + rows[:, None] * H + k[None, :], mask=km[None, :], other=0.0)
        wu = tl.load(pool_ptr + base + (rows + I)[:, None] * H + k[None, :], mask=km[None, :], other=0.0)
        acc_g += tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
        acc_u += tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
    h = gate_act(acc_g, GELU) * acc_u
    tl.store(inter_ptr + pair * I + n, round_to(h, inter_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _down_part(inter_ptr, pool_ptr, ids_ptr, off_ptr, num_experts, pair, rows, k_lo,
               I: tl.constexpr, COLS: tl.constexpr, BLOCK_N: tl.constexpr,  # noqa: E741
               BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_N]: rows ``rows`` of pair ``pair``'s expert's down block against its intermediate, over the
    ``COLS`` columns from ``k_lo`` (those past I count 0)."""
    e = tl.minimum(tl.maximum(tl.load(ids_ptr + pair).to(tl.int64), 0), num_experts - 1)
    base = tl.load(off_ptr + 2 * e + 1)
    part = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, COLS, BLOCK_K):
        k = k_lo + k0 + tl.arange(0, BLOCK_K)
        km = k < I
        hv = tl.load(inter_ptr + pair * I + k, mask=km, other=0.0).to(tl.float32)
        wd = tl.load(pool_ptr + base + rows[:, None] * I + k[None, :], mask=km[None, :], other=0.0)
        part += tl.sum(wd.to(tl.float32) * hv[None, :], axis=1)
    return part


@triton.jit
def _gemv_down_kernel(
    inter_ptr,  # [T*k, I] from _gemv_gate_up_kernel
    y_ptr,  # [T, H] out, x's dtype
    ids_ptr,  # [T*k] expert ids
    w_ptr,  # [T*k] fp32 routing weights
    pool_ptr,  # 16-bit weight pool
    off_ptr,  # int64 [2E] element offsets
    num_experts,  # E
    TOPK: tl.constexpr,  # k: the pairs of a token, summed here (deterministic, one rounding)
    H: tl.constexpr,  # rows of down
    I: tl.constexpr,  # noqa: E741 - K of down
    BLOCK_N: tl.constexpr,  # output columns per program
    BLOCK_K: tl.constexpr,  # K step
):
    tok = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    rows = tl.minimum(n, H - 1).to(tl.int64)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pair = tok * TOPK + j
        part = _down_part(inter_ptr, pool_ptr, ids_ptr, off_ptr, num_experts, pair, rows, 0, I, I, BLOCK_N, BLOCK_K)
        acc += part * tl.load(w_ptr + pair)
    tl.store(y_ptr + tok * H + n, round_to(acc, y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _gemv_down_split_kernel(
    inter_ptr,  # [T*k, I] from _gemv_gate_up_kernel
    part_ptr,  # [T*k*SPLIT, H] fp32 out: routing weight * this program's share of down(inter) of its pair
    ids_ptr,  # [T*k] expert ids
    w_ptr,  # [T*k] fp32 routing weights
    pool_ptr,  # 16-bit weight pool
    off_ptr,  # int64 [2E] element offsets
    num_experts,  # E
    H: tl.constexpr,  # rows of down
    I: tl.constexpr,  # noqa: E741 - K of down
    SPLIT: tl.constexpr,  # K chunks per pair
    CHUNK: tl.constexpr,  # columns per chunk, a multiple of BLOCK_K
    BLOCK_N: tl.constexpr,  # output columns per program
    BLOCK_K: tl.constexpr,  # K step
):
    row = tl.program_id(0)  # pair * SPLIT + chunk
    pair = row // SPLIT
    k_lo = (row % SPLIT) * CHUNK
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    rows = tl.minimum(n, H - 1).to(tl.int64)
    part = _down_part(inter_ptr, pool_ptr, ids_ptr, off_ptr, num_experts, pair, rows, k_lo, I, CHUNK, BLOCK_N,
                      BLOCK_K)
    tl.store(part_ptr + row.to(tl.int64) * H + n, part * tl.load(w_ptr + pair), mask=nmask)


@triton.jit
def _sum_parts_kernel(
    part_ptr,  # [T * PARTS, H] fp32
    y_ptr,  # [T, H] out, y's dtype
    H: tl.constexpr,  # columns
    PARTS: tl.constexpr,  # rows of part per token, summed in order
    BLOCK: tl.constexpr,  # columns per program
):
    tok = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    nmask = n < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in tl.static_range(PARTS):
        acc += tl.load(part_ptr + (tok * PARTS + r) * H + n, mask=nmask, other=0.0)
    tl.store(y_ptr + tok * H + n, round_to(acc, y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _gemm_gate_up_kernel(
    x_ptr,  # [T, H] activations, rows stride_xm apart
    inter_ptr,  # [T*k, I] out: act(gate) * up, x's dtype
    sorted_ptr,  # [num_tiles * BLOCK_M] int32 pair ids sorted by expert, padded with T*k
    tile_expert_ptr,  # [num_tiles] int32 expert of each tile (num_experts: spare tile, no work)
    pool_ptr,  # 16-bit weight pool
    off_ptr,  # int64 [2E] element offsets
    num_pairs,  # T * k
    num_experts,  # E
    stride_xm,  # elements between rows of x
    TOPK: tl.constexpr,  # k
    H: tl.constexpr,  # hidden size = K of gate_up
    I: tl.constexpr,  # noqa: E741 - expert intermediate size
    BLOCK_M: tl.constexpr,  # pairs per tile
    BLOCK_N: tl.constexpr,  # intermediate columns per tile
    BLOCK_K: tl.constexpr,  # K step
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong, fp32 is exact
    GELU: tl.constexpr,  # GELU-tanh gate activation instead of SiLU
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.minimum(tl.load(tile_expert_ptr + pid_m), num_experts - 1)
    base = tl.load(off_ptr + 2 * e)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pmask = pairs < num_pairs
    tok = pairs // TOPK
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    rows = tl.minimum(n, I - 1).to(tl.int64)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.where(tl.max(pmask.to(tl.int32)) > 0, H, 0), BLOCK_K):  # spare tiles read nothing
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < H
        xt = tl.load(x_ptr + tok[:, None] * stride_xm + k[None, :], mask=pmask[:, None] & km[None, :], other=0.0)
        wg = tl.load(pool_ptr + base + rows[:, None] * H + k[None, :], mask=km[None, :], other=0.0)
        wu = tl.load(pool_ptr + base + (rows + I)[:, None] * H + k[None, :], mask=km[None, :], other=0.0)
        if DOT_FP32:
            xt, wg, wu = xt.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g += tl.dot(xt, tl.trans(wg))
        acc_u += tl.dot(xt, tl.trans(wu))
    h = gate_act(acc_g, GELU) * acc_u
    tl.store(inter_ptr + pairs[:, None] * I + n[None, :], round_to(h, inter_ptr.dtype.element_ty),
             mask=pmask[:, None] & nmask[None, :])


@triton.jit
def _gemm_down_kernel(
    inter_ptr,  # [T*k, I] from _gemm_gate_up_kernel
    out_ptr,  # [T*k, H] fp32 out: routing-weighted expert output per pair
    w_ptr,  # [T*k] fp32 routing weights
    sorted_ptr,  # [num_tiles * BLOCK_M] int32 pair ids, as in _gemm_gate_up_kernel
    tile_expert_ptr,  # [num_tiles] int32 expert of each tile
    pool_ptr,  # 16-bit weight pool
    off_ptr,  # int64 [2E] element offsets
    num_pairs,  # T * k
    num_experts,  # E
    H: tl.constexpr,  # rows of down
    I: tl.constexpr,  # noqa: E741 - K of down
    BLOCK_M: tl.constexpr,  # pairs per tile
    BLOCK_N: tl.constexpr,  # output columns per tile
    BLOCK_K: tl.constexpr,  # K step
    DOT_FP32: tl.constexpr,  # interpreter only (see _gemm_gate_up_kernel)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.minimum(tl.load(tile_expert_ptr + pid_m), num_experts - 1)
    base = tl.load(off_ptr + 2 * e + 1)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pmask = pairs < num_pairs
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    rows = tl.minimum(n, H - 1).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.where(tl.max(pmask.to(tl.int32)) > 0, I, 0), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < I
        ht = tl.load(inter_ptr + pairs[:, None] * I + k[None, :], mask=pmask[:, None] & km[None, :], other=0.0)
        wd = tl.load(pool_ptr + base + rows[:, None] * I + k[None, :], mask=km[None, :], other=0.0)
        if DOT_FP32:
            ht, wd = ht.to(tl.float32), wd.to(tl.float32)
        acc += tl.dot(ht, tl.trans(wd))
    wt = tl.load(w_ptr + pairs, mask=pmask, other=0.0)
    tl.store(out_ptr + pairs[:, None] * H + n[None, :], acc * wt[:, None], mask=pmask[:, None] & nmask[None, :])


def check_dense_inputs(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, ex: DenseExperts) -> None:
    """Shapes, dtypes, strides and devices (no host sync). Raises ``ValueError`` on the first violation."""
    if x.dim() != 2 or x.shape[1] != ex.hidden:
        raise ValueError(f"x must be [T, {ex.hidden}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16) or ex.pool.dtype != x.dtype:
        raise ValueError(f"x and the weight pool must share one 16-bit dtype, got {x.dtype}, {ex.pool.dtype}")
    if x.stride(1) != 1 or ex.pool.dim() != 1 or ex.pool.stride(0) != 1:
        raise ValueError("x must be contiguous along the hidden dim and the pool a contiguous 1-D tensor")
    if topk_ids.dtype not in (torch.int32, torch.int64) or ex.offset.dtype != torch.int64:
        raise ValueError(f"topk_ids must be int32 or int64 and offsets int64, got {topk_ids.dtype}, "
                         f"{ex.offset.dtype}")
    if topk_ids.shape != topk_w.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids and topk_w must both be [T, k] with T = {x.shape[0]}")
    if any(t.device != x.device for t in (ex.pool, ex.offset, topk_ids, topk_w)):
        raise ValueError("all tensors must be on x's device")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("dense_moe runs on a CUDA device (or in Triton's interpreter: TRITON_INTERPRET=1); "
                         "use pwkernels.moe.ref.dense_moe_ref elsewhere")


def dense_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: DenseExperts,
              config: DenseMoEConfig | DenseGemvTile | DenseGemmTile | None = None,
              activation: str = "silu") -> torch.Tensor:
    """MoE output y [T, H] in x's dtype: x [T, H] bf16/fp16, topk_ids [T, k] int32/int64 in [0, E) (not checked:
    that would sync; an id outside reads expert 0 or E-1), topk_w [T, k] float, ``experts`` in x's dtype.

    ``config``: a ``DenseMoEConfig`` (path by T; default ``DEFAULT_CONFIG``) or one path's tile. ``activation``:
    ``silu`` or ``gelu_tanh``. Raises ``ValueError`` on bad input (``check_dense_inputs``)."""
    gelu = check_activation(activation)
    check_dense_inputs(x, topk_ids, topk_w, experts)
    t, k = topk_ids.shape
    cfg = config if config is not None else DEFAULT_CONFIG
    tile = cfg.pick(t) if isinstance(cfg, DenseMoEConfig) else cfg
    ex = experts
    if t == 0 or k == 0:
        return torch.zeros_like(x)
    ids = topk_ids.reshape(-1)
    w = topk_w.reshape(-1).float().contiguous()
    inter = torch.empty(t * k, ex.inter, dtype=x.dtype, device=x.device)
    if isinstance(cfg, DenseMoEConfig) and ex.stacked is not None and t >= cfg.grouped_mm_from(ex.inter):
        return grouped_mm_moe(x, topk_ids, topk_w, *ex.stacked, activation)
    if isinstance(tile, DenseGemvTile):
        bn, bk = tile.BLOCK_N, min(tile.BLOCK_K, triton.next_power_of_2(max(ex.hidden, ex.inter)))
        _gemv_gate_up_kernel[(t * k, triton.cdiv(ex.inter, bn))](
            x, inter, ids, ex.pool, ex.offset, ex.num_experts, x.stride(0), TOPK=k, H=ex.hidden, I=ex.inter,
            BLOCK_N=bn, BLOCK_K=bk, GELU=gelu, num_warps=tile.num_warps)
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        if tile.DOWN_SPLIT:
            _gemv_down_split(inter, y, ids, w, ex, k, tile)
            return y
        _gemv_down_kernel[(t, triton.cdiv(ex.hidden, bn))](
            inter, y, ids, w, ex.pool, ex.offset, ex.num_experts, TOPK=k, H=ex.hidden, I=ex.inter, BLOCK_N=bn,
            BLOCK_K=bk, num_warps=tile.num_warps)
        return y
    if not isinstance(tile, DenseGemmTile):
        raise ValueError(f"config must be a DenseMoEConfig, DenseGemvTile or DenseGemmTile, got {config!r}")
    bm, bn, bk = tile.BLOCK_M, tile.BLOCK_N, tile.BLOCK_K
    sorted_pairs, tile_expert = align_by_expert(topk_ids, ex.num_experts, bm)
    out_pairs = torch.empty(t * k, ex.hidden, dtype=torch.float32, device=x.device)
    tiles = tile_expert.numel()
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    _gemm_gate_up_kernel[(tiles, triton.cdiv(ex.inter, bn))](
        x, inter, sorted_pairs, tile_expert, ex.pool, ex.offset, t * k, ex.num_experts, x.stride(0), TOPK=k,
        H=ex.hidden, I=ex.inter, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_FP32=interp, GELU=gelu,
        num_warps=tile.num_warps)
    _gemm_down_kernel[(tiles, triton.cdiv(ex.hidden, bn))](
        inter, out_pairs, w, sorted_pairs, tile_expert, ex.pool, ex.offset, t * k, ex.num_experts, H=ex.hidden,
        I=ex.inter, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_FP32=interp, num_warps=tile.num_warps)
    return out_pairs.view(t, k, ex.hidden).sum(1).to(x.dtype)


def _gemv_down_split(inter: torch.Tensor, y: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, ex: DenseExperts,
                     k: int, tile: DenseGemvTile) -> None:
    """y = sum over each token's k pairs of w * down(inter): one program per (pair, K chunk, BLOCK_N rows) writes
    fp32 partials, a second launch sums a token's k * DOWN_SPLIT of them in order and rounds once."""
    t, split = y.shape[0], tile.DOWN_SPLIT
    bk = min(tile.BLOCK_K, triton.next_power_of_2(ex.inter))
    chunk = triton.cdiv(triton.cdiv(ex.inter, split), bk) * bk
    part = torch.empty(t * k * split, ex.hidden, dtype=torch.float32, device=y.device)
    _gemv_down_split_kernel[(t * k * split, triton.cdiv(ex.hidden, tile.BLOCK_N))](
        inter, part, ids, w, ex.pool, ex.offset, ex.num_experts, H=ex.hidden, I=ex.inter, SPLIT=split,
        CHUNK=chunk, BLOCK_N=tile.BLOCK_N, BLOCK_K=bk, num_warps=tile.num_warps)
    block = min(1024, triton.next_power_of_2(ex.hidden))
    _sum_parts_kernel[(t, triton.cdiv(ex.hidden, block))](part, y, H=ex.hidden, PARTS=k * split, BLOCK=block,
                                                          num_warps=4)
