"""Fused mixed-precision MoE over Any-Precision bit-planes (Triton), with its PyTorch reference twin.

What it computes (SPEC section 7): for hidden states x [T, H], top-k expert ids / weights [T, k],
``y[t] = sum_j w_tj * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with e = ids[t, j], where every
expert linear block (expert e, unit gate_up / down) is read straight from its bit-planes and its
LUT at its own committed bitwidth q (2..8): one launch handles any mix of bitwidths.

Memory layout (addressed through tables, never assumed contiguous, so the runtime can place and
move every plane independently):
  * ``pool``  int32 [P]: all bit-planes. Plane p of block i is an [N_i, Kw_i] int32 array
    (Kw = ceil(K/32), format of ``pwrun.ap.format``) starting at word ``plane_offset[i, p]``.
  * ``lut_pool`` fp16/bf16 [L]: the LUT of block i at its committed bitwidth, an [N_i, 2^q_i]
    array starting at element ``lut_offset[i]``.
  * ``bits`` int32 [num_blocks]: committed q_i. Block ids: gate_up of expert e = 2e, down = 2e+1.
    Planes q_i..7 of block i are never read.

Four paths, chosen per call by T and shape from data (``kernels/configs/ap_moe.json``):
  * ``gemv1`` (decode, 1..8 tokens; more in chunks of 8, or any number with ``SLOTS``: pairs sorted by expert):
    ``kernels/ap_moe_gemv1.py``, word-first GEMV kernels laid out so that a warp's LUT gathers and activation loads
    are contiguous; no host sync.
  * ``gemv`` (decode, few tokens): ``kernels/ap_moe_gemv.py``, GEMV kernels without tensor cores
    or routing preprocessing: gate_up + SiLU*up fused, down with split-K; no host sync.
  * ``fused`` (medium T): ``_gate_up_kernel`` / ``_down_kernel`` here: per tile of BLOCK_M
    (token, slot) pairs of one expert (pairs sorted by expert, each expert's segment padded to
    BLOCK_M, as fused MoE kernels do) and BLOCK_N rows, a [BLOCK_N, BLOCK_K] tile is dequantized
    once in registers and fed to tensor cores (``tl.dot``); SiLU(gate) * up -> ``inter`` [T*k, I],
    then down times the routing weight -> ``out_pairs`` [T*k, H] fp32, summed over k by the
    launcher (deterministic, no atomics).
  * ``dequant`` (prefill): ``_dequant_kernel`` writes every used expert densely once, then
    ``torch._grouped_mm`` runs both units on tensor cores.
All but ``gemv1`` build weights with ``kernels.ap_tile.weight_tile`` (codes from plane words in
registers, then the row's LUT). Accumulation is fp32; the intermediate is stored in x's dtype.
The shared expert runs through the same kernels as an always-selected expert (k = 1, weight =
its sigmoid gate or 1): see ``ap_moe_shared``; ``ap_moe_block`` runs a layer's routed and shared experts
and, on the ``gemv1`` path, sums both sets of partial outputs in one launch (word-major activations
built once).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.ap_moe_gemv import gemv_moe
from kernels.ap_moe_gemv1 import gemv1_moe, gemv1_partials
from kernels.ap_moe_layout import combine
from kernels.ap_tile import lut_rows, weight_tile
from kernels.config_buckets import pick_bucket
from kernels.moe_prefill import gather_sum, silu_mul
from pwrun.ap.format import dequantize

CONFIGS = json.loads((Path(__file__).parent / "configs" / "ap_moe.json").read_text())


# ----------------------------------------------------------------------------------------------
# Reference (pure PyTorch): dequantize through the AP reference, then dense matmuls
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class APExperts:
    """Table-addressed AP weights of E experts (see module docstring for the layout).

    ``inter``: expert intermediate size I (gate_up is [2I, H], down is [H, I]); ``hidden``: H.
    """

    pool: torch.Tensor  # int32 [P]
    plane_offset: torch.Tensor  # int64 [2E, 8] word offsets
    lut_pool: torch.Tensor  # fp16/bf16 [L]
    lut_offset: torch.Tensor  # int64 [2E]
    bits: torch.Tensor  # int32 [2E]
    hidden: int
    inter: int

    @property
    def num_experts(self) -> int:
        return self.bits.numel() // 2

    def block(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(planes [q, N, Kw], lut [N, 2^q], N, K) of block i, gathered through the tables."""
        n, k = (2 * self.inter, self.hidden) if i % 2 == 0 else (self.hidden, self.inter)
        kw = -(-k // 32)
        q = int(self.bits[i])
        offs = self.plane_offset[i, :q].tolist()
        planes = torch.stack([self.pool[o:o + n * kw].view(n, kw) for o in offs])
        lo = int(self.lut_offset[i])
        return planes, self.lut_pool[lo:lo + n * 2**q].view(n, 2**q), n, k


def ap_moe_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: APExperts) -> torch.Tensor:
    """Reference MoE output y [T, H] (x's dtype) from x [T, H], topk_ids/topk_w [T, k]."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        pg, lg, _, kg = experts.block(2 * e)
        pd_, ld, _, kd = experts.block(2 * e + 1)
        gate_up = dequantize(pg, lg, kg, pg.shape[0], torch.float32)
        down = dequantize(pd_, ld, kd, pd_.shape[0], torch.float32)
        g, u = (x[rows].float() @ gate_up.T).chunk(2, dim=-1)
        h = (F.silu(g) * u).to(x.dtype).float()  # the kernel stores the intermediate in x's dtype
        out.index_add_(0, rows, (h @ down.T) * topk_w[rows, slot, None].float())
    return out.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernels (medium T: dequantized tiles into tensor cores; prefill: dequantize once)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H] activations (bf16/fp16)
    inter_ptr,  # [T*k, I] output: silu(gate) * up, x's dtype
    sorted_ptr,  # [num_tiles * BLOCK_M] int32 pair ids (t * k + j), padded with T*k
    tile_expert_ptr,  # [num_tiles] int32 expert of each tile (num_experts: spare tile, no work)
    pool_ptr,  # int32 plane pool
    plane_off_ptr,  # int64 [2E, 8] word offsets of each block's planes
    lut_ptr,  # LUT pool (x's dtype)
    lut_off_ptr,  # int64 [2E] element offset of each block's committed LUT
    bits_ptr,  # int32 [2E] committed bitwidths
    num_pairs,  # T * k
    num_experts,
    TOPK: tl.constexpr,
    H: tl.constexpr,  # K of gate_up
    I: tl.constexpr,  # noqa: E741 - expert intermediate size
    stride_xm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPREAD: tl.constexpr,  # code-building variant of weight_tile
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong (Triton 3.9), fp32 is exact
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
        wg = weight_tile(pool_ptr, poff, lut_g, q, n, nmask, k0, H, KW, BLOCK_N, BLOCK_K, SPREAD)
        wu = weight_tile(pool_ptr, poff, lut_u, q, n + I, nmask, k0, H, KW, BLOCK_N, BLOCK_K, SPREAD)
        if DOT_FP32:
            xt, wg, wu = xt.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        acc_g += tl.dot(xt, tl.trans(wg))
        acc_u += tl.dot(xt, tl.trans(wu))
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(inter_ptr + pairs[:, None] * I + n[None, :], h.to(inter_ptr.dtype.element_ty),
             mask=pmask[:, None] & nmask[None, :])


@triton.jit
def _down_kernel(
    inter_ptr,  # [T*k, I] from _gate_up_kernel
    out_ptr,  # [T*k, H] fp32: routing-weighted expert outputs per pair
    w_ptr,  # [T*k] fp32 routing weights
    sorted_ptr,
    tile_expert_ptr,
    pool_ptr,
    plane_off_ptr,
    lut_ptr,
    lut_off_ptr,
    bits_ptr,
    num_pairs,
    num_experts,
    H: tl.constexpr,
    I: tl.constexpr,  # noqa: E741 - K of down
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPREAD: tl.constexpr,
    DOT_FP32: tl.constexpr,
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
        wd = weight_tile(pool_ptr, poff, lut, q, n, nmask, k0, I, KW, BLOCK_N, BLOCK_K, SPREAD)
        if DOT_FP32:
            ht, wd = ht.to(tl.float32), wd.to(tl.float32)
        acc += tl.dot(ht, tl.trans(wd))
    wt = tl.load(w_ptr + pairs, mask=pmask, other=0.0)
    tl.store(out_ptr + pairs[:, None] * H + n[None, :], acc * wt[:, None], mask=pmask[:, None] & nmask[None, :])


@triton.jit
def _dequant_kernel(
    out_ptr,  # [num_blocks_listed, N, K] dense weights (x's dtype)
    blocks_ptr,  # int32 [num_blocks_listed] block ids to dequantize
    live_ptr,  # int32 [num_blocks_listed]: 0 = skip this block (its output is left unwritten)
    pool_ptr,
    plane_off_ptr,
    lut_ptr,
    lut_off_ptr,
    bits_ptr,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPREAD: tl.constexpr,
):
    j = tl.program_id(0)
    if tl.load(live_ptr + j) != 0:
        blk = tl.load(blocks_ptr + j)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(2) * BLOCK_K
        q, lut = lut_rows(lut_ptr, lut_off_ptr, bits_ptr, blk, n)
        KW: tl.constexpr = (K + 31) // 32
        w = weight_tile(pool_ptr, plane_off_ptr + blk * 8, lut, q, n, n < N, k0, K, KW, BLOCK_N, BLOCK_K, SPREAD)
        cols = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + j.to(tl.int64) * N * K + n[:, None] * K + cols[None, :], w,
                 mask=(n[:, None] < N) & (cols[None, :] < K))


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------
def shape_buckets(hidden: int | None = None, inter: int | None = None,
                  configs: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The token buckets (``{"min_tokens": T, "config": ...}``) of experts ``hidden`` x ``inter`` in
    ``configs/ap_moe.json`` (or ``configs``, the same layout): the shape's own if tuned, else the default ones.
    Read-only (shared)."""
    table = CONFIGS if configs is None else configs
    return table["by_shape"].get(f"{hidden}x{inter}", table["default"])


def pick_config(num_tokens: int, hidden: int | None = None, inter: int | None = None,
                configs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Config for ``num_tokens`` tokens among ``shape_buckets(hidden, inter, configs)``: the largest
    ``min_tokens`` <= T wins. Read-only (shared)."""
    return pick_bucket(shape_buckets(hidden, inter, configs), num_tokens, "min_tokens") or {}


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair ids sorted by expert, each expert's segment padded to ``block_m`` with T*k; tile -> expert.

    Returns ``sorted_pairs`` [num_tiles * block_m] int32 and ``tile_expert`` [num_tiles] int32, where
    num_tiles = min(E, T*k) + T*k // block_m is an upper bound known without a host sync: experts
    that receive no token get no tile, and the spare tiles at the end have expert ``num_experts``
    and only padding.
    """
    flat = topk_ids.flatten().to(torch.int64)
    num_pairs, dev = flat.numel(), flat.device
    sorted_ids, order = torch.sort(flat, stable=True)
    bounds = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, device=dev))
    tiles = (bounds[1:] - bounds[:-1] + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    max_tiles = min(num_experts, num_pairs) + num_pairs // block_m
    tile_expert = torch.searchsorted(tile_end, torch.arange(max_tiles, device=dev), right=True)
    rank = torch.arange(num_pairs, device=dev) - bounds[sorted_ids]
    sorted_pairs = torch.full((max_tiles * block_m,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs[(tile_end - tiles)[sorted_ids] * block_m + rank] = order.to(torch.int32)
    return sorted_pairs, tile_expert.to(torch.int32)


def _check(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, ex: APExperts, sync: bool) -> None:
    """Shapes, dtypes, devices; with ``sync`` also the value ranges of ids and bits (host syncs)."""
    if x.dim() != 2 or x.shape[1] != ex.hidden:
        raise ValueError(f"x must be [T, {ex.hidden}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float16 or bfloat16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along the hidden dim")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.shape != topk_w.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids and topk_w must both be [T, k] with T = {x.shape[0]}")
    if ex.lut_pool.dtype != x.dtype:
        raise ValueError(f"LUT dtype {ex.lut_pool.dtype} must equal the activation dtype {x.dtype}")
    if ex.pool.dtype != torch.int32 or ex.plane_offset.shape != (2 * ex.num_experts, 8):
        raise ValueError("pool must be int32 and plane_offset [2E, 8]")
    if ex.bits.dtype != torch.int32:
        raise ValueError("bits must be int32 in 1..8")
    for t in (ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, topk_ids, topk_w):
        if t.device != x.device:
            raise ValueError("all tensors must be on x's device")
    if not sync:
        return
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= ex.num_experts):
        raise ValueError(f"expert ids must be in [0, {ex.num_experts})")
    if int(ex.bits.min()) < 1 or int(ex.bits.max()) > 8:
        raise ValueError("bits must be int32 in 1..8")


def ap_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: APExperts,
           config: dict[str, Any] | None = None, workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
           check: bool = True) -> torch.Tensor:
    """Triton MoE output y [T, H] in x's dtype (see module docstring). Raises ``ValueError`` on bad input.

    x [T, H] bf16/fp16; topk_ids [T, k] integer; topk_w [T, k] float. ``config``: one entry of
    ``configs/ap_moe.json`` (default: picked by T and shape). ``workspace``: optional preallocated
    (inter [>=T*k, I] x.dtype, out_pairs [>=T*k, H] fp32) buffers, so that a step allocates nothing
    on the decode and medium paths. ``check=False`` skips the value checks that sync with the host
    (ids in range, bits in 1..8): on the decode path (``gemv``) a call then never syncs.
    """
    _check(x, topk_ids, topk_w, experts, sync=check)
    t, k = topk_ids.shape
    ex = experts
    num_pairs = t * k
    if num_pairs == 0:
        return torch.zeros_like(x)
    cfg = config or pick_config(t, ex.hidden, ex.inter)
    path = cfg.get("path") or ("dequant" if num_pairs >= cfg.get("dequant_min_pairs", 1 << 62) else "fused")
    if workspace is not None:
        inter, out_pairs = workspace
        if inter.shape[0] < num_pairs or inter.shape[1:] != (ex.inter,) or out_pairs.shape[1:] != (ex.hidden,) \
                or out_pairs.shape[0] < num_pairs or inter.dtype != x.dtype or out_pairs.dtype != torch.float32:
            raise ValueError("workspace must be (inter [>=T*k, I] in x's dtype, out_pairs [>=T*k, H] float32)")
    if path == "gemv1":  # any T (chunks of 8, or sorted slots); allocates its small buffers itself
        return gemv1_moe(x, topk_ids, topk_w, ex, cfg)
    if path == "gemv":
        return gemv_moe(x, topk_ids, topk_w, ex, cfg, workspace)
    if path == "dequant":
        return _ap_moe_dequant(x, topk_ids, topk_w, ex, cfg)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    sorted_pairs, tile_expert = align_by_expert(topk_ids, ex.num_experts, bm)
    if workspace is None:
        inter = torch.empty(num_pairs, ex.inter, dtype=x.dtype, device=x.device)
        out_pairs = torch.empty(num_pairs, ex.hidden, dtype=torch.float32, device=x.device)
    tiles = tile_expert.numel()
    warps, spread = cfg.get("num_warps", 4), cfg.get("SPREAD", 0)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    _gate_up_kernel[(tiles, triton.cdiv(ex.inter, bn))](
        x, inter, sorted_pairs, tile_expert, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits,
        num_pairs, ex.num_experts, TOPK=k, H=ex.hidden, I=ex.inter, stride_xm=x.stride(0), BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, SPREAD=spread, DOT_FP32=interp, num_warps=warps)
    _down_kernel[(tiles, triton.cdiv(ex.hidden, bn))](
        inter, out_pairs, topk_w.flatten().float().contiguous(), sorted_pairs, tile_expert, ex.pool,
        ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, num_pairs, ex.num_experts, H=ex.hidden, I=ex.inter,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPREAD=spread, DOT_FP32=interp, num_warps=warps)
    return out_pairs[:num_pairs].view(t, k, ex.hidden).sum(1).to(x.dtype)


def dequant_blocks(experts: APExperts, blocks: torch.Tensor, unit: str, dtype: torch.dtype,
                   live: torch.Tensor | None = None, config: dict[str, Any] | None = None) -> torch.Tensor:
    """Dense weights [len(blocks), N, K] of the listed blocks (all gate_up or all down), via Triton.

    ``live`` [len(blocks)] bool/int: blocks to skip (0) are left unwritten (no host sync to drop them).
    ``config``: BLOCK_N, BLOCK_K (multiple of 32), num_warps, SPREAD of the dequantize kernel.
    """
    ex = experts
    cfg = config or {}
    n, kk = (2 * ex.inter, ex.hidden) if unit == "gate_up" else (ex.hidden, ex.inter)
    out = torch.empty(blocks.numel(), n, kk, dtype=dtype, device=ex.pool.device)
    live_i = torch.ones(blocks.numel(), dtype=torch.int32, device=out.device) if live is None else live.to(torch.int32)
    bn, bk = cfg.get("BLOCK_N", 32), cfg.get("BLOCK_K", 128)
    _dequant_kernel[(blocks.numel(), triton.cdiv(n, bn), triton.cdiv(kk, bk))](
        out, blocks.to(torch.int32), live_i, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, N=n,
        K=kk, BLOCK_N=bn, BLOCK_K=bk, SPREAD=cfg.get("SPREAD", 1), num_warps=cfg.get("num_warps", 4))
    return out


def _ap_moe_dequant(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, ex: APExperts,
                    cfg: dict[str, Any]) -> torch.Tensor:
    """Prefill path: dequantize every expert that has a token once (Triton), then dense tensor-core GEMMs.

    The GEMMs are one ``torch._grouped_mm`` per unit over the expert-sorted pairs (no host
    sync: every expert gets a dense slot, those without tokens are skipped by the kernel and get an
    empty group), with ``kernels.moe_prefill``'s SiLU-and-mul (times the routing weight) between them and its
    gather-sum over the k slots after; where grouped mm is unavailable, a per-expert loop. A single expert with
    k = 1 (a shared expert) skips the sorting: two plain GEMMs around the same SiLU-and-mul (the same result as
    its grouped path: one term per token, rounded once).
    """
    t, k = topk_ids.shape
    e_all = torch.arange(ex.num_experts, device=x.device)
    if ex.num_experts == 1 and k == 1:  # a shared expert: every token, in token order; two plain GEMMs, no sorting
        w_gu = dequant_blocks(ex, e_all, "gate_up", x.dtype, None, cfg)[0]
        w_dn = dequant_blocks(ex, e_all + 1, "down", x.dtype, None, cfg)[0]
        return F.linear(silu_mul(F.linear(x, w_gu), topk_w.reshape(t).float().contiguous()), w_dn)
    sorted_ids, order = torch.sort(topk_ids.flatten())
    offs = torch.searchsorted(sorted_ids, e_all + 1).to(torch.int32)  # end of each expert's rows
    live = torch.diff(offs, prepend=offs.new_zeros(1)) > 0
    w_gu = dequant_blocks(ex, 2 * e_all, "gate_up", x.dtype, live, cfg)
    w_dn = dequant_blocks(ex, 2 * e_all + 1, "down", x.dtype, live, cfg)
    if hasattr(torch, "_grouped_mm"):  # CUDA; CPU too since torch 2.9 (CI runs it there in Triton's interpreter)
        try:
            h = torch._grouped_mm(x[order // k], w_gu.transpose(1, 2), offs=offs)
            act = silu_mul(h, topk_w.flatten()[order].float())  # the routing weight applied before down
            y = torch._grouped_mm(act, w_dn.transpose(1, 2), offs=offs)
            pos = torch.empty_like(order)
            pos[order] = torch.arange(t * k, device=x.device)  # where pair (token, slot) sits in y
            return gather_sum(y, pos.view(t, k))
        except RuntimeError:
            pass  # layout or dtype not supported by this build: per-expert loop below
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        g, u = (x[rows] @ w_gu[e].T).float().chunk(2, dim=-1)
        h = (F.silu(g) * u).to(x.dtype)
        out.index_add_(0, rows, (h @ w_dn[e].T).float() * topk_w[rows, slot, None].float())
    return out.to(x.dtype)


def ap_moe_shared(x: torch.Tensor, shared: APExperts, gate: torch.Tensor | None = None,
                  check: bool = True) -> torch.Tensor:
    """The shared expert through the same kernels: every token selects expert 0 with weight
    ``sigmoid(gate)`` [T, 1] (or 1). ``shared`` holds one expert (blocks 0 and 1); ``check`` as in ``ap_moe``."""
    ids = torch.zeros(x.shape[0], 1, dtype=torch.int64, device=x.device)
    w = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device) if gate is None else torch.sigmoid(
        gate.float())
    return ap_moe(x, ids, w, shared, check=check)


def ap_moe_block(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: APExperts,
                 shared: APExperts | None = None, shared_w: torch.Tensor | None = None,
                 shared_ids: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
    """A layer's MoE output y [T, H] (x's dtype): the routed experts (as ``ap_moe``) plus, if ``shared`` is given,
    the shared expert times ``shared_w`` [T, 1] fp32 (its gate already applied), as an always-selected expert
    (SPEC section 7: one fused path for routed and shared experts).

    ``shared_ids``: optional [T, 1] int64 zeros to reuse (saves a fill per call). On the ``gemv1`` path (both
    configs) the two sets of fp32 partials are summed and rounded once, in one launch; elsewhere the two
    outputs are added in x's dtype. Raises ``ValueError`` as ``ap_moe`` does, and if ``shared_w`` is not [T, 1] or
    the shared expert's hidden size or LUT dtype differs from the routed experts'.
    """
    if shared is None:
        return ap_moe(x, topk_ids, topk_w, experts, check=check)
    t = x.shape[0]
    if shared_w is None or shared_w.shape != (t, 1):
        raise ValueError(f"shared_w must be [T, 1] = [{t}, 1]")
    if shared.hidden != experts.hidden or shared.lut_pool.dtype != experts.lut_pool.dtype:
        raise ValueError(f"the shared expert (hidden {shared.hidden}, LUT {shared.lut_pool.dtype}) must match the "
                         f"routed experts (hidden {experts.hidden}, LUT {experts.lut_pool.dtype})")
    sid = shared_ids if shared_ids is not None else torch.zeros(t, 1, dtype=torch.int64, device=x.device)
    cr, cs = pick_config(t, experts.hidden, experts.inter), pick_config(t, shared.hidden, shared.inter)
    if cr.get("path") == "gemv1" and cs.get("path") == "gemv1" and topk_ids.numel() > 0:
        _check(x, topk_ids, topk_w, experts, sync=check)
        _check(x, sid, shared_w, shared, sync=check)
        a, xw = gemv1_partials(x, topk_ids, topk_w, experts, cr)
        b, _ = gemv1_partials(x, sid, shared_w, shared, cs, xw)
        return combine(a, b, x.dtype)
    return ap_moe(x, topk_ids, topk_w, experts, check=check) + ap_moe(x, sid, shared_w, shared, check=check)


def build_experts(codes: list[torch.Tensor], luts: list[dict[int, torch.Tensor]], bits: list[int], hidden: int,
                  inter: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                  shuffle_seed: int | None = None) -> APExperts:
    """Lay out blocks (2 per expert: gate_up [2I, H], down [H, I]) into one plane pool + LUT pool.

    ``codes[i]``: 8-bit parent codes [N, K] uint8, or already packed planes [8, N, Kw] int32;
    ``luts[i][b]``: [N, 2^b]; ``bits[i]``: committed q.
    Only planes 0..q-1 and the q-bit LUT are placed. With ``shuffle_seed`` the planes land in a random
    order with gaps, to exercise table addressing (the runtime's pages are not contiguous either).
    """
    from pwrun.ap.format import pack_planes

    pieces: list[tuple[int, int, torch.Tensor]] = []
    for i, (c, q) in enumerate(zip(codes, bits, strict=True)):
        planes = c if c.dtype == torch.int32 else pack_planes(c.to(device))
        pieces += [(i, p, planes[p].flatten().to(device)) for p in range(q)]
    if shuffle_seed is not None:
        g = torch.Generator().manual_seed(shuffle_seed)
        pieces = [pieces[j] for j in torch.randperm(len(pieces), generator=g).tolist()]
    offset = torch.full((len(codes), 8), -1, dtype=torch.int64)
    chunks, pos = [], 0
    for i, p, words in pieces:
        gap = 7 if shuffle_seed is not None else 0
        chunks.append(torch.full((gap,), -1, dtype=torch.int32, device=device))
        pos += gap
        offset[i, p] = pos
        chunks.append(words)
        pos += words.numel()
    lut_chunks, lut_offset, lpos = [], [], 0
    for i, q in enumerate(bits):
        lut_offset.append(lpos)
        lut_chunks.append(luts[i][q].flatten().to(device=device, dtype=dtype))
        lpos += lut_chunks[-1].numel()
    return APExperts(pool=torch.cat(chunks), plane_offset=offset.to(device),
                     lut_pool=torch.cat(lut_chunks), lut_offset=torch.tensor(lut_offset).to(device),
                     bits=torch.tensor(bits, dtype=torch.int32, device=device), hidden=hidden, inter=inter)
