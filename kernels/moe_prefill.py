"""The elementwise ends of the AP MoE prefill path (Triton), with their PyTorch reference twins.

What it computes, around the two grouped GEMMs of ``kernels.ap_moe`` path ``dequant`` (SPEC section 7), for
M (token, slot) pairs sorted by expert:
  * ``silu_mul``: act [M, I] = SiLU(gate) * up * scale, from the gate_up output h [M, 2I] (gate = h[:, :I],
    up = h[:, I:]) and one fp32 scale per pair (its routing weight; down is linear, so weighting the
    intermediate equals weighting the output), in fp32, rounded once to h's dtype;
  * ``gather_sum``: out [T, H] = sum over j < k of y[pos[t, j]] (fp32, slots in order, rounded once), where
    pos [T, k] is where pair (t, j) sits in the sorted order.
Eagerly that is ~10 launches (fp32 casts of h and y, SiLU, two products, the cast back, an index_put, the
sum and its cast) and two fp32 copies of [M, 2I] and [M, H]; replacing them took the Qwen1.5-MoE shape's
2048-token prefill step from 55.6 to 41.0 ms of GPU time (``bench/results/profile_prefill_u4_s11{b,d}_h200.txt``).
What it does not do: the GEMMs, or anything but contiguous rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.rounding import round_to


def silu_mul_ref(h: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """act [M, I] in h's dtype = SiLU(h[:, :I]) * h[:, I:] (* scale[:, None]), in fp32. h [M, 2I]; scale [M] fp32."""
    g, u = h.float().chunk(2, dim=-1)
    a = F.silu(g) * u
    if scale is not None:
        a = a * scale.float()[:, None]
    return a.to(h.dtype)


def gather_sum_ref(y: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """out [T, H] in y's dtype = sum_j y[pos[:, j]] in fp32. y [M, H]; pos [T, k] integer indices into y's rows."""
    return y[pos].float().sum(1).to(y.dtype)


@triton.jit
def _silu_mul_kernel(h_ptr, scale_ptr, out_ptr, inter, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(h_ptr + m * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + m * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    a = g / (1.0 + tl.exp(-g)) * u
    if HAS_SCALE:
        a = a * tl.load(scale_ptr + m)
    tl.store(out_ptr + m * inter + cols, round_to(a, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_sum_kernel(y_ptr, pos_ptr, out_ptr, H, K: tl.constexpr, BLOCK: tl.constexpr):
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


def silu_mul(h: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of ``silu_mul_ref``: h [M, 2I] bf16/fp16/fp32 contiguous, scale [M] fp32 or None.

    Returns a new [M, I] tensor in h's dtype. Raises ``ValueError`` on an odd width, a non-contiguous h or a
    scale that is not [M] fp32 on h's device.
    """
    _rows(h, "h")
    m, two_i = h.shape
    if two_i % 2:
        raise ValueError(f"h must be [M, 2I] (gate then up), got width {two_i}")
    if scale is not None and (scale.shape != (m,) or scale.dtype != torch.float32 or scale.device != h.device):
        raise ValueError(f"scale must be [M] = [{m}] float32 on {h.device}, got {tuple(scale.shape)} {scale.dtype}")
    inter = two_i // 2
    out = torch.empty(m, inter, dtype=h.dtype, device=h.device)
    if m == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(m, triton.cdiv(inter, block))](h, h if scale is None else scale, out, inter,
                                                    HAS_SCALE=scale is not None, BLOCK=block, num_warps=4)
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
