"""Prefill MoE path (Triton + grouped GEMM): dequantize each used expert once, then dense tensor-core GEMMs.

For many tokens (SPEC section 7) the cheapest plan is to write every expert that has a token densely once
(``_dequant_kernel``), run one ``torch._grouped_mm`` per unit over the expert-sorted pairs (no host sync), and
do the elementwise ends in one launch each:
  * ``silu_mul``: act [M, I] = SiLU(gate) * up * scale from the gate_up output h [M, 2I] and one fp32 scale
    per pair (its routing weight: down is linear, so weighting the intermediate weights the output), in fp32,
    rounded once to h's dtype;
  * ``gather_sum``: out [T, H] = sum over j < k of y[pos[t, j]] (fp32, slots in order, rounded once).
Eagerly each end is several launches and an fp32 copy of [M, 2I] or [M, H].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pwkernels.moe.activation import check_activation, gate_act, gate_act_ref
from pwkernels.moe.experts import APExperts
from pwkernels.moe.launch import PrefillConfig
from pwkernels.moe.pair_sort import group_pairs
from pwkernels.moe.tile import lut_rows, weight_tile
from pwkernels.rounding import round_to


def silu_mul_ref(h: torch.Tensor, scale: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """act [M, I] in h's dtype = SiLU(h[:, :I]) * h[:, I:] (* scale[:, None]), in fp32 (GELU-tanh for
    ``activation="gelu_tanh"``). h [M, 2I]; scale [M] fp32."""
    g, u = h.float().chunk(2, dim=-1)
    a = gate_act_ref(g, activation) * u
    if scale is not None:
        a = a * scale.float()[:, None]
    return a.to(h.dtype)


def gather_sum_ref(y: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """out [T, H] in y's dtype = sum_j y[pos[:, j]] in fp32. y [M, H]; pos [T, k] integer indices into y's rows."""
    return y[pos].float().sum(1).to(y.dtype)


@triton.jit
def _silu_mul_kernel(
    h_ptr,  # [M, 2I] gate_up output, contiguous (gate then up)
    scale_ptr,  # [M] fp32 per-row scale (unused when not HAS_SCALE), or [P] read through index_ptr
    index_ptr,  # [M] int32: row m's scale is scale[index[m]] (with HAS_INDEX)
    out_ptr,  # [M, I] out, h's dtype
    inter,  # I
    HAS_SCALE: tl.constexpr,  # multiply by scale
    HAS_INDEX: tl.constexpr,  # gather the scale through index
    BLOCK: tl.constexpr,  # columns per program
    GELU: tl.constexpr,  # GELU-tanh instead of SiLU
):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(h_ptr + m * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + m * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    a = gate_act(g, GELU) * u
    if HAS_SCALE:
        if HAS_INDEX:
            a = a * tl.load(scale_ptr + tl.load(index_ptr + m).to(tl.int64)).to(tl.float32)
        else:
            a = a * tl.load(scale_ptr + m)
    tl.store(out_ptr + m * inter + cols, round_to(a, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_sum_kernel(
    y_ptr,  # [M, H] rows to sum, contiguous
    pos_ptr,  # [T, K] row of y of each (token, slot)
    out_ptr,  # [T, H] out, y's dtype
    H,  # columns
    K: tl.constexpr,  # slots per token
    BLOCK: tl.constexpr,  # columns per program
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(pos_ptr + t * K + j).to(tl.int64)
        acc += tl.load(y_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, round_to(acc, out_ptr.dtype.element_ty), mask=mask)


def _rows(z: torch.Tensor, name: str) -> None:
    if z.dim() != 2 or not z.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 2-D tensor, got {tuple(z.shape)} strides {z.stride()}")


def silu_mul(h: torch.Tensor, scale: torch.Tensor | None = None, activation: str = "silu",
             index: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of ``silu_mul_ref``: h [M, 2I] bf16/fp16/fp32 contiguous, scale [M] fp32 or None; with
    ``index`` [M] int32, row m's scale is ``scale[index[m]]`` (scale 1-D contiguous fp32, not range-checked: that
    would sync), i.e. ``silu_mul_ref(h, scale[index])`` without the gather's launch.

    Returns a new [M, I] tensor in h's dtype. Raises ``ValueError`` on an odd width, a non-contiguous h or a
    scale (index) that is not [M] fp32 ([M] int32) on h's device.
    """
    _rows(h, "h")
    m, two_i = h.shape
    if two_i % 2:
        raise ValueError(f"h must be [M, 2I] (gate then up), got width {two_i}")
    if index is not None:
        if scale is None or scale.dim() != 1 or not scale.is_contiguous() or scale.dtype != torch.float32 \
                or scale.device != h.device:
            raise ValueError("with an index, scale must be a contiguous 1-D float32 tensor on h's device")
        if index.shape != (m,) or index.dtype != torch.int32 or index.device != h.device:
            raise ValueError(f"index must be [M] = [{m}] int32 on {h.device}, got {tuple(index.shape)} {index.dtype}")
    elif scale is not None and (scale.shape != (m,) or scale.dtype != torch.float32 or scale.device != h.device):
        raise ValueError(f"scale must be [M] = [{m}] float32 on {h.device}, got {tuple(scale.shape)} {scale.dtype}")
    inter = two_i // 2
    out = torch.empty(m, inter, dtype=h.dtype, device=h.device)
    if m == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(m, triton.cdiv(inter, block))](h, h if scale is None else scale, h if index is None else index,
                                                    out, inter, HAS_SCALE=scale is not None,
                                                    HAS_INDEX=index is not None, BLOCK=block,
                                                    GELU=check_activation(activation), num_warps=4)
    return out


def gather_sum(y: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Triton version of ``gather_sum_ref``: y [M, H] contiguous, pos [T, k] int32/int64 contiguous on y's device.

    Returns a new [T, H] tensor in y's dtype. Indices are not range-checked (that would sync with the host).
    Raises ``ValueError`` on bad shapes, dtypes or devices.
    """
    _rows(y, "y")
    _rows(pos, "pos")
    if pos.dtype not in (torch.int32, torch.int64) or pos.device != y.device:
        raise ValueError(f"pos must be int32/int64 on {y.device}, got {pos.dtype} on {pos.device}")
    t, k = pos.shape
    hidden = y.shape[1]
    out = torch.empty(t, hidden, dtype=y.dtype, device=y.device)
    if t == 0 or hidden == 0:
        return out
    block = min(1024, triton.next_power_of_2(hidden))
    _gather_sum_kernel[(t, triton.cdiv(hidden, block))](y, pos, out, hidden, K=k, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _dequant_kernel(
    out_ptr,  # [num_listed, N, K] dense weights (x's dtype)
    blocks_ptr,  # int32 [num_listed] block ids to dequantize
    ends_ptr,  # int32 [num_listed] (with HAS_ENDS): cumulative pair counts; skip block j (left unwritten) when
    # it has none (ends[j] == ends[j - 1], or ends[0] == 0)
    pool_ptr,  # int32 plane pool
    plane_off_ptr,  # int64 [2E, 8] word offsets
    lut_ptr,  # LUT pool
    lut_off_ptr,  # int64 [2E] LUT offsets
    bits_ptr,  # int32 [2E] committed bitwidths
    N: tl.constexpr,  # rows of each block
    K: tl.constexpr,  # columns of each block
    BLOCK_N: tl.constexpr,  # rows per program
    BLOCK_K: tl.constexpr,  # columns per program, a multiple of 32
    HAS_ENDS: tl.constexpr,  # skip blocks without pairs (else every listed block is written)
):
    j = tl.program_id(0)
    live = j >= 0
    if HAS_ENDS:
        live = tl.load(ends_ptr + j) > tl.load(ends_ptr + j - 1, mask=j > 0, other=0)
    if live:
        blk = tl.load(blocks_ptr + j)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(2) * BLOCK_K
        q, lut = lut_rows(lut_ptr, lut_off_ptr, bits_ptr, blk, n)
        KW: tl.constexpr = (K + 31) // 32
        w = weight_tile(pool_ptr, plane_off_ptr + blk * 8, lut, q, n, n < N, k0, K, KW, BLOCK_N, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        tl.store(out_ptr + j.to(tl.int64) * N * K + n[:, None] * K + cols[None, :], w,
                 mask=(n[:, None] < N) & (cols[None, :] < K))


def dequant_blocks(experts: APExperts, blocks: torch.Tensor, unit: str, dtype: torch.dtype,
                   ends: torch.Tensor | None = None, config: PrefillConfig | None = None) -> torch.Tensor:
    """Dense weights [len(blocks), N, K] in ``dtype`` of the listed blocks (all gate_up or all down).

    ``ends`` [len(blocks)] int32: the cumulative pair count of the listed blocks' experts (``group_pairs``); a block
    whose expert has no pair is left unwritten (no host sync to drop it). ``config``: the dequantize kernel's tile
    (default ``PrefillConfig()``). Raises ``ValueError`` for another unit or ``ends`` of another length or dtype.
    """
    ex = experts
    cfg = config or PrefillConfig()
    if unit not in ("gate_up", "down"):
        raise ValueError(f"unit must be gate_up or down, got {unit!r}")
    if ends is not None and (ends.shape != blocks.shape or ends.dtype != torch.int32):
        raise ValueError(f"ends must be int32 of blocks' shape {tuple(blocks.shape)}, got {tuple(ends.shape)} "
                         f"{ends.dtype}")
    n, kk = (2 * ex.inter, ex.hidden) if unit == "gate_up" else (ex.hidden, ex.inter)
    out = torch.empty(blocks.numel(), n, kk, dtype=dtype, device=ex.pool.device)
    blocks = blocks.to(torch.int32)
    _dequant_kernel[(blocks.numel(), triton.cdiv(n, cfg.BLOCK_N), triton.cdiv(kk, cfg.BLOCK_K))](
        out, blocks, blocks if ends is None else ends, ex.pool, ex.plane_offset, ex.lut_pool, ex.lut_offset, ex.bits,
        N=n, K=kk, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, HAS_ENDS=ends is not None, num_warps=cfg.num_warps)
    return out


_BLOCK_IDS: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}  # per (E, device)


def _block_ids(num_experts: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 (gate_up blocks 2e, down blocks 2e + 1) of experts 0..E-1, made once per (E, device)."""
    ids = _BLOCK_IDS.get((num_experts, device))
    if ids is None:
        e = torch.arange(num_experts, dtype=torch.int32, device=device)
        ids = _BLOCK_IDS[(num_experts, device)] = (2 * e, 2 * e + 1)
    return ids


def prefill_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: APExperts,
                cfg: PrefillConfig, activation: str = "silu") -> torch.Tensor:
    """MoE output y [T, H] in x's dtype; x [T, H], ids / weights [T, k] as checked by ``pwkernels.moe.dispatch``.

    One grouped GEMM per unit over the expert-sorted pairs (experts without tokens get an empty group; the grouping
    is ``group_pairs``: one launch and a ``searchsorted``); where ``torch._grouped_mm`` is unavailable, a per-expert
    loop. A single expert with k = 1 (a shared expert) skips the sorting: two plain GEMMs around the same
    SiLU-and-mul (one term per token, rounded once, as grouped). ``cfg`` as in ``dequant_blocks``; ``activation``:
    ``silu`` or ``gelu_tanh``.
    """
    ex = experts
    t, k = topk_ids.shape
    if ex.num_experts == 1 and k == 1:
        w_gu = dequant_blocks(ex, _block_ids(1, x.device)[0], "gate_up", x.dtype, None, cfg)[0]
        w_dn = dequant_blocks(ex, _block_ids(1, x.device)[1], "down", x.dtype, None, cfg)[0]
        return F.linear(silu_mul(F.linear(x, w_gu), topk_w.reshape(t).float().contiguous(), activation), w_dn)
    gate_up_ids, down_ids = _block_ids(ex.num_experts, x.device)
    order, offs, inv = group_pairs(topk_ids.flatten(), ex.num_experts)
    w_gu = dequant_blocks(ex, gate_up_ids, "gate_up", x.dtype, offs, cfg)
    w_dn = dequant_blocks(ex, down_ids, "down", x.dtype, offs, cfg)
    if hasattr(torch, "_grouped_mm"):  # CUDA; CPU too since torch 2.9
        try:
            h = torch._grouped_mm(x[order // k], w_gu.transpose(1, 2), offs=offs)
            # the routing weight applied before down (linear), gathered in the kernel
            act = silu_mul(h, topk_w.float().flatten().contiguous(), activation, order)
            y = torch._grouped_mm(act, w_dn.transpose(1, 2), offs=offs)
            return gather_sum(y, inv.view(t, k))  # inv: where pair (token, slot) sits in y
        except RuntimeError:
            pass  # layout or dtype not supported by this build: per-expert loop below
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        g, u = (x[rows] @ w_gu[e].T).float().chunk(2, dim=-1)
        h = (gate_act_ref(g, activation) * u).to(x.dtype)
        out.index_add_(0, rows, (h @ w_dn[e].T).float() * topk_w[rows, slot, None].float())
    return out.to(x.dtype)
