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

Kernels (what is fused, and why):
  1. ``_gate_up_kernel``: per tile of BLOCK_M (token, slot) pairs routed to one expert and
     BLOCK_N intermediate columns: unpack int32 plane words into codes in registers, look the
     codes up in the row's LUT, dequantize a [BLOCK_N, BLOCK_K] tile once and feed tensor cores
     (``tl.dot``) for both the gate and the up rows, then SiLU(gate) * up -> ``inter`` [T*k, I].
  2. ``_down_kernel``: same tiling over ``inter``, times the routing weight of each pair ->
     ``out_pairs`` [T*k, H] fp32; the k pairs of a token are summed by the launcher (a
     deterministic reduction instead of atomics).
Tokens are grouped by expert (sorted pair ids, each expert's segment padded to BLOCK_M, as fused
MoE kernels do), so decode (T = 1..8) and prefill use the same kernels with different tiles;
tile configs are data (``kernels/configs/ap_moe.json``). Accumulation is fp32.
The shared expert runs through the same kernels as an always-selected expert (k = 1, weight =
its sigmoid gate or 1): see ``ap_moe_shared``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

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
# Triton kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _dequant_tile(pool_ptr, lut_ptr, plane_off_ptr, q, row, row_mask, k0, K, KW: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K] dequantized weights of rows ``row`` and columns k0..k0+BLOCK_K-1."""
    BKW: tl.constexpr = BLOCK_K // 32
    kw = k0 // 32 + tl.arange(0, BKW)
    shifts = tl.arange(0, 32)
    code = tl.zeros((row.shape[0], BLOCK_K), dtype=tl.int32)
    for p in range(0, q):
        off = tl.load(plane_off_ptr + p)
        words = tl.load(pool_ptr + off + row[:, None] * KW + kw[None, :],
                        mask=row_mask[:, None] & (kw[None, :] < KW), other=0)
        bit = (words[:, :, None] >> shifts[None, None, :]) & 1
        code = code | (tl.reshape(bit, (row.shape[0], BLOCK_K)) << (q - 1 - p))
    cols = k0 + tl.arange(0, BLOCK_K)
    w = tl.load(lut_ptr + row[:, None] * (1 << q) + code, mask=row_mask[:, None] & (cols[None, :] < K), other=0.0)
    return w


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H] activations (bf16/fp16)
    inter_ptr,  # [T*k, I] output: silu(gate) * up, x's dtype
    sorted_ptr,  # [num_tiles * BLOCK_M] int32 pair ids (t * k + j), padded with T*k
    tile_expert_ptr,  # [num_tiles] int32 expert of each tile
    pool_ptr,  # int32 plane pool
    plane_off_ptr,  # int64 [2E, 8] word offsets of each block's planes
    lut_ptr,  # LUT pool (x's dtype)
    lut_off_ptr,  # int64 [2E] element offset of each block's committed LUT
    bits_ptr,  # int32 [2E] committed bitwidths
    num_pairs,  # T * k
    TOPK: tl.constexpr,
    H: tl.constexpr,  # K of gate_up
    I: tl.constexpr,  # noqa: E741 - expert intermediate size
    stride_xm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only: its bf16 tl.dot is wrong (Triton 3.9), fp32 is exact
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m)
    blk = 2 * e
    q = tl.load(bits_ptr + blk)
    lut = lut_ptr + tl.load(lut_off_ptr + blk)
    poff = plane_off_ptr + blk * 8
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pmask = pairs < num_pairs
    tok = pairs // TOPK
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < I
    KW: tl.constexpr = (H + 31) // 32
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + tok[:, None] * stride_xm + cols[None, :], mask=pmask[:, None] & (cols[None, :] < H),
                     other=0.0)
        wg = _dequant_tile(pool_ptr, lut, poff, q, n, nmask, k0, H, KW, BLOCK_K)
        wu = _dequant_tile(pool_ptr, lut, poff, q, n + I, nmask, k0, H, KW, BLOCK_K)
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
    H: tl.constexpr,
    I: tl.constexpr,  # noqa: E741 - K of down
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m)
    blk = 2 * e + 1
    q = tl.load(bits_ptr + blk)
    lut = lut_ptr + tl.load(lut_off_ptr + blk)
    poff = plane_off_ptr + blk * 8
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pmask = pairs < num_pairs
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < H
    KW: tl.constexpr = (I + 31) // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ht = tl.load(inter_ptr + pairs[:, None] * I + cols[None, :], mask=pmask[:, None] & (cols[None, :] < I),
                     other=0.0)
        wd = _dequant_tile(pool_ptr, lut, poff, q, n, nmask, k0, I, KW, BLOCK_K)
        if DOT_FP32:
            ht, wd = ht.to(tl.float32), wd.to(tl.float32)
        acc += tl.dot(ht, tl.trans(wd))
    wt = tl.load(w_ptr + pairs, mask=pmask, other=0.0)
    tl.store(out_ptr + pairs[:, None] * H + n[None, :], acc * wt[:, None], mask=pmask[:, None] & nmask[None, :])


@triton.jit
def _dequant_kernel(
    out_ptr,  # [num_blocks_listed, N, K] dense weights (x's dtype)
    blocks_ptr,  # int32 [num_blocks_listed] block ids to dequantize
    pool_ptr,
    plane_off_ptr,
    lut_ptr,
    lut_off_ptr,
    bits_ptr,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    j = tl.program_id(0)
    blk = tl.load(blocks_ptr + j)
    q = tl.load(bits_ptr + blk)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(2) * BLOCK_K
    KW: tl.constexpr = (K + 31) // 32
    w = _dequant_tile(pool_ptr, lut_ptr + tl.load(lut_off_ptr + blk), plane_off_ptr + blk * 8, q, n, n < N, k0, K,
                      KW, BLOCK_K)
    cols = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + j * N * K + n[:, None] * K + cols[None, :], w, mask=(n[:, None] < N) & (cols[None, :] < K))


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------
def pick_config(num_tokens: int) -> dict[str, int]:
    """Tile config for ``num_tokens`` tokens from ``configs/ap_moe.json`` (largest bucket <= T)."""
    best = CONFIGS["default"]
    for row in CONFIGS["by_tokens"]:
        if num_tokens >= row["min_tokens"]:
            best = row["config"]
    return dict(best)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair ids sorted by expert, each expert's segment padded to ``block_m`` with T*k; tile -> expert.

    Returns ``sorted_pairs`` [num_tiles * block_m] int32 and ``tile_expert`` [num_tiles] int32.
    Experts that receive no token get no tile.
    """
    flat = topk_ids.flatten().to(torch.int64)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    tiles = (counts + block_m - 1) // block_m
    tile_expert = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), tiles)
    padded_start = torch.cumsum(tiles * block_m, 0) - tiles * block_m
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(num_pairs, device=flat.device) - start[flat[order]]
    sorted_pairs = torch.full((int(tiles.sum()) * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[padded_start[flat[order]] + rank] = order.to(torch.int32)
    return sorted_pairs, tile_expert.to(torch.int32)


def _check(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, ex: APExperts) -> None:
    if x.dim() != 2 or x.shape[1] != ex.hidden:
        raise ValueError(f"x must be [T, {ex.hidden}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x must be float16 or bfloat16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x must be contiguous along the hidden dim")
    if topk_ids.shape != topk_w.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids and topk_w must both be [T, k] with T = {x.shape[0]}")
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= ex.num_experts):
        raise ValueError(f"expert ids must be in [0, {ex.num_experts})")
    if ex.lut_pool.dtype != x.dtype:
        raise ValueError(f"LUT dtype {ex.lut_pool.dtype} must equal the activation dtype {x.dtype}")
    if ex.pool.dtype != torch.int32 or ex.plane_offset.shape != (2 * ex.num_experts, 8):
        raise ValueError("pool must be int32 and plane_offset [2E, 8]")
    b = ex.bits
    if b.dtype != torch.int32 or int(b.min()) < 1 or int(b.max()) > 8:
        raise ValueError("bits must be int32 in 1..8")
    for t in (ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, b, topk_ids, topk_w):
        if t.device != x.device:
            raise ValueError("all tensors must be on x's device")


def ap_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: APExperts,
           config: dict[str, int] | None = None,
           workspace: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Triton MoE output y [T, H] in x's dtype (see module docstring). Raises ``ValueError`` on bad input.

    ``workspace``: optional preallocated (inter [>=T*k, I] x.dtype, out_pairs [>=T*k, H] fp32) buffers,
    so that a runtime step allocates nothing.
    """
    _check(x, topk_ids, topk_w, experts)
    t, k = topk_ids.shape
    cfg = config or pick_config(t)
    if t * k >= cfg.get("dequant_min_pairs", 1 << 62):
        return _ap_moe_dequant(x, topk_ids, topk_w, experts)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    ex = experts
    sorted_pairs, tile_expert = align_by_expert(topk_ids, ex.num_experts, bm)
    num_pairs = t * k
    if workspace is None:
        inter = torch.empty(num_pairs, ex.inter, dtype=x.dtype, device=x.device)
        out_pairs = torch.empty(num_pairs, ex.hidden, dtype=torch.float32, device=x.device)
    else:
        inter, out_pairs = workspace
        if inter.shape[0] < num_pairs or inter.shape[1:] != (ex.inter,) or out_pairs.shape[1:] != (ex.hidden,) \
                or out_pairs.shape[0] < num_pairs or inter.dtype != x.dtype or out_pairs.dtype != torch.float32:
            raise ValueError("workspace must be (inter [>=T*k, I] in x's dtype, out_pairs [>=T*k, H] float32)")
    tiles = tile_expert.numel()
    if tiles == 0:
        return torch.zeros_like(x)
    warps = cfg.get("num_warps", 4)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    _gate_up_kernel[(tiles, triton.cdiv(ex.inter, bn))](
        x, inter, sorted_pairs, tile_expert, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits,
        num_pairs, TOPK=k, H=ex.hidden, I=ex.inter, stride_xm=x.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        DOT_FP32=interp, num_warps=warps)
    _down_kernel[(tiles, triton.cdiv(ex.hidden, bn))](
        inter, out_pairs, topk_w.flatten().float().contiguous(), sorted_pairs, tile_expert, ex.pool,
        ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, num_pairs, H=ex.hidden, I=ex.inter, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, DOT_FP32=interp, num_warps=warps)
    return out_pairs[:num_pairs].view(t, k, ex.hidden).sum(1).to(x.dtype)


def dequant_blocks(experts: APExperts, blocks: torch.Tensor, unit: str, dtype: torch.dtype) -> torch.Tensor:
    """Dense weights [len(blocks), N, K] of the listed blocks (all gate_up or all down), via Triton."""
    ex = experts
    n, kk = (2 * ex.inter, ex.hidden) if unit == "gate_up" else (ex.hidden, ex.inter)
    out = torch.empty(blocks.numel(), n, kk, dtype=dtype, device=ex.pool.device)
    bn, bk = 64, 64
    _dequant_kernel[(blocks.numel(), triton.cdiv(n, bn), triton.cdiv(kk, bk))](
        out, blocks.to(torch.int32), ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits, N=n, K=kk,
        BLOCK_N=bn, BLOCK_K=bk)
    return out


def _ap_moe_dequant(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, ex: APExperts) -> torch.Tensor:
    """Prefill path: dequantize each used expert once (Triton), then dense tensor-core GEMMs.

    On CUDA the GEMMs are one ``torch._grouped_mm`` per unit over the expert-sorted pairs; elsewhere
    (or if grouped mm is unavailable) a per-expert loop.
    """
    t, k = topk_ids.shape
    used, local = topk_ids.unique(return_inverse=True)
    w_gu = dequant_blocks(ex, 2 * used, "gate_up", x.dtype)
    w_dn = dequant_blocks(ex, 2 * used + 1, "down", x.dtype)
    if x.is_cuda and hasattr(torch, "_grouped_mm"):
        flat = local.flatten()
        order = torch.argsort(flat)
        offs = torch.cumsum(torch.bincount(flat, minlength=used.numel()), 0).to(torch.int32)
        try:
            h = torch._grouped_mm(x[order // k], w_gu.transpose(1, 2), offs=offs)
            g, u = h.float().chunk(2, dim=-1)
            y = torch._grouped_mm((F.silu(g) * u).to(x.dtype), w_dn.transpose(1, 2), offs=offs)
            pairs = torch.empty(t * k, x.shape[1], dtype=torch.float32, device=x.device)
            pairs[order] = y.float() * topk_w.flatten()[order, None].float()
            return pairs.view(t, k, -1).sum(1).to(x.dtype)
        except RuntimeError:
            pass  # layout or dtype not supported by this build: per-expert loop below
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j, e in enumerate(used.tolist()):
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        g, u = (x[rows] @ w_gu[j].T).float().chunk(2, dim=-1)
        h = (F.silu(g) * u).to(x.dtype)
        out.index_add_(0, rows, (h @ w_dn[j].T).float() * topk_w[rows, slot, None].float())
    return out.to(x.dtype)


def ap_moe_shared(x: torch.Tensor, shared: APExperts, gate: torch.Tensor | None = None) -> torch.Tensor:
    """The shared expert through the same kernels: every token selects expert 0 with weight
    ``sigmoid(gate)`` [T, 1] (or 1). ``shared`` holds one expert (blocks 0 and 1)."""
    ids = torch.zeros(x.shape[0], 1, dtype=torch.int64, device=x.device)
    w = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device) if gate is None else torch.sigmoid(
        gate.float())
    return ap_moe(x, ids, w, shared)


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
