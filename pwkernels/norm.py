"""Residual add + RMSNorm in one pass (Triton), with its PyTorch reference twin.

What it computes: for the residual stream h [T, H] and a block output delta [T, H] (or none),
``h' = h + delta`` (rounded to h's dtype, as the eager ``h = h + delta`` is) and
``x = weight * (h' * rsqrt(mean(h'^2) + eps))`` with the mean and rsqrt in fp32 and the product
with ``weight`` in h's dtype (the math of transformers' RMSNorm; ``rms_norm_ref`` is the lean model's
eager norm). One program per token row: the eager version is ~8 launches plus the add.
What it does not do: anything but the last dim, or in-place updates (h' is a new tensor).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pwkernels.rounding import round_to


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x [..., H] any float dtype, weight [H] -> [..., H] in x's dtype (fp32 math)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: (h + delta, rms_norm_ref(h + delta)) [T, H]; h itself when ``delta`` is None."""
    if delta is not None:
        h = h + delta
    return h, rms_norm_ref(h, weight, eps)


@triton.jit
def _add_rms_norm_kernel(
    h_ptr,  # [T, H] residual stream (bf16/fp16/fp32), rows stride_hm apart
    delta_ptr,  # [T, H] block output added to h (unused when not HAS_DELTA), rows stride_dm apart
    w_ptr,  # [H] norm weight, h's dtype
    h_out_ptr,  # [T, H] out: h + delta (contiguous; unused when not HAS_DELTA)
    x_ptr,  # [T, H] out: the normalised row (contiguous)
    H,  # hidden size
    stride_hm,  # elements between rows of h
    stride_dm,  # elements between rows of delta
    eps,  # RMSNorm epsilon
    HAS_DELTA: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of 2 >= H
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    h = tl.load(h_ptr + t * stride_hm + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + t * stride_dm + cols, mask=mask, other=0.0)
        h = round_to(h.to(tl.float32) + d.to(tl.float32), h_out_ptr.dtype.element_ty)
        tl.store(h_out_ptr + t * H + cols, h, mask=mask)
    hf = h.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / H + eps)
    xn = round_to(hf * r, x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(x_ptr + t * H + cols, round_to(w.to(tl.float32) * xn.to(tl.float32), x_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``add_rms_norm_ref``: h, delta [T, H] (rows contiguous), weight [H], same dtype.

    Returns (h + delta, x), new contiguous tensors (h itself when ``delta`` is None). Raises
    ``ValueError`` on mismatched shapes, dtypes or devices.
    """
    if h.dim() != 2 or weight.shape != (h.shape[1],) or weight.dtype != h.dtype or weight.device != h.device:
        raise ValueError(f"h must be [T, H] and weight [H] of h's dtype/device; got {tuple(h.shape)}, "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if delta is not None and (delta.shape != h.shape or delta.dtype != h.dtype or delta.device != h.device):
        raise ValueError(f"delta must match h [T, H] {h.dtype}; got {tuple(delta.shape)} {delta.dtype}")
    for z in (h, delta, weight):
        if z is not None and z.stride(-1) != 1:
            raise ValueError("rows of h, delta and weight must be contiguous")
    t, hidden = h.shape
    x = torch.empty_like(h, memory_format=torch.contiguous_format)
    h_out = torch.empty_like(x) if delta is not None else h
    if t == 0:
        return h_out, x
    d = delta if delta is not None else h
    _add_rms_norm_kernel[(t,)](h, d, weight, h_out, x, hidden, h.stride(0), d.stride(0), eps,
                               HAS_DELTA=delta is not None, BLOCK_H=triton.next_power_of_2(hidden),
                               num_warps=4 if hidden <= 4096 else 8)
    return h_out, x
