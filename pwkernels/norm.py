"""Residual add + RMSNorm in one pass, and RMSNorm alone of rows or heads (Triton), with their PyTorch reference
twins.

What it computes: for the residual stream h [T, H] and a block output delta [T, H] (or none),
``h' = h + delta`` (rounded to h's dtype, as the eager ``h = h + delta`` is) and
``x = weight * (h' * rsqrt(mean(h'^2) + eps))`` with the mean and rsqrt in fp32 and the product
with ``weight`` in h's dtype (the math of transformers' RMSNorm; ``rms_norm_ref`` is the lean model's
eager norm). One program per token row: the eager version is ~8 launches plus the add.
``rms_norm`` normalises the last dim of [T, D] or [T, G, D] (e.g. per-head q/k/v norms on a strided view of a
projection), with a weight (``rms_norm_ref``) or without (``rms_unit_ref``), in one launch where the eager norm
takes ~8: a Gemma-4 layer has nine such norms.
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


def rms_unit_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without weight over the last dim, fp32 math, in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


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


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, G, D] rows to normalise (last dim contiguous)
    w_ptr,  # [D] weight, x's dtype (unused when not HAS_W)
    y_ptr,  # [T, G, D] out, contiguous
    G,  # rows per token (heads; 1 for [T, D])
    D,  # row length
    stride_t,  # elements between tokens of x
    stride_g,  # elements between rows of a token of x
    eps,  # RMSNorm epsilon
    w2_ptr,  # [D] weight of rows W_ROWS <= g < W2_ROWS (x's dtype; rows from W2_ROWS on take none)
    W_ROWS,  # rows g < W_ROWS of each token take w (G: all)
    W2_ROWS,  # rows W_ROWS <= g < W2_ROWS take w2
    res_ptr,  # [T, G, D] contiguous residual added after the norm (when HAS_RES)
    scale_ptr,  # [1] multiplies the result (when HAS_SCALE == 1)
    scale_f,  # fp32 number that multiplies the result (when HAS_SCALE == 2)
    HAS_W: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_SCALE: tl.constexpr,  # 0: none, 1: the tensor at scale_ptr, 2: the number scale_f
    BLOCK_D: tl.constexpr,  # next power of 2 >= D
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    xf = tl.load(x_ptr + t * stride_t + g * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    y = round_to(xf * r, y_ptr.dtype.element_ty)
    if HAS_W:
        if g < W_ROWS:
            w = tl.load(w_ptr + cols, mask=mask, other=0.0)
            y = round_to(w.to(tl.float32) * y.to(tl.float32), y_ptr.dtype.element_ty)
        elif g < W2_ROWS:
            w = tl.load(w2_ptr + cols, mask=mask, other=0.0)
            y = round_to(w.to(tl.float32) * y.to(tl.float32), y_ptr.dtype.element_ty)
    if HAS_RES:  # each step rounded to the dtype, as the eager ops round
        res = tl.load(res_ptr + (t * G + g) * D + cols, mask=mask, other=0.0)
        y = round_to(res.to(tl.float32) + y.to(tl.float32), y_ptr.dtype.element_ty)
    if HAS_SCALE == 1:
        y = round_to(y.to(tl.float32) * tl.load(scale_ptr).to(tl.float32), y_ptr.dtype.element_ty)
    if HAS_SCALE == 2:
        y = round_to(y.to(tl.float32) * scale_f, y_ptr.dtype.element_ty)
    tl.store(y_ptr + (t * G + g) * D + cols, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None,
             scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """Triton version of ``rms_norm_ref`` (``weight`` [D]) and ``rms_unit_ref`` (``weight`` None) for x [T, D] or
    [T, G, D] whose last dim is contiguous (other strides free); a new contiguous tensor of x's shape and dtype.
    With ``residual`` (x's shape and dtype, contiguous) and ``scale`` ([1] of x's dtype, or a Python number):
    ``(residual + y) * scale`` in the same launch, each op rounded to the dtype as eagerly (a sandwich layer's
    post-norms; Gemma-4's router input).
    Raises ``ValueError`` on other shapes, a weight of another length, dtype or device, or a strided last dim."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, D] or [T, G, D] with a contiguous last dim; got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    d = x.shape[-1]
    if weight is not None and (weight.shape != (d,) or weight.dtype != x.dtype or weight.device != x.device
                               or weight.stride(-1) != 1):
        raise ValueError(f"weight must be [{d}] of x's dtype and device; got {tuple(weight.shape)} {weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device or not residual.is_contiguous()):
        raise ValueError(f"residual must be a contiguous {tuple(x.shape)} {x.dtype} tensor on {x.device}")
    if isinstance(scale, torch.Tensor) and (scale.numel() != 1 or scale.dtype != x.dtype
                                            or scale.device != x.device):
        raise ValueError(f"scale must be one {x.dtype} element on {x.device}")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    g = x.shape[1] if x.dim() == 3 else 1
    if y.numel() == 0:
        return y
    _launch(x, y, weight, None, g, g, eps, residual, scale)
    return y


def _launch(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None, w2: torch.Tensor | None, rows: int,
            rows2: int, eps: float, residual: torch.Tensor | None, scale: torch.Tensor | float | None) -> None:
    """One ``_rms_norm_kernel`` launch over x [T, D] or [T, G, D] into y (arguments checked by the callers)."""
    t, g, d = x.shape[0], (x.shape[1] if x.dim() == 3 else 1), x.shape[-1]
    tensor_scale = isinstance(scale, torch.Tensor)
    _rms_norm_kernel[(t, g)](x, x if w is None else w, y, g, d, x.stride(0), x.stride(1) if x.dim() == 3 else 0,
                             eps, x if w2 is None else w2, rows, rows2, x if residual is None else residual,
                             scale if tensor_scale else x,
                             1.0 if scale is None or tensor_scale else float(scale),
                             HAS_W=w is not None, HAS_RES=residual is not None,
                             HAS_SCALE=0 if scale is None else 1 if tensor_scale else 2,
                             BLOCK_D=triton.next_power_of_2(d), num_warps=1 if d <= 512 else 4 if d <= 4096 else 8)


def rms_norm_heads(x: torch.Tensor, w: torch.Tensor, rows: int, w2: torch.Tensor, rows2: int, eps: float
                   ) -> torch.Tensor:
    """Per-head RMSNorms of one projection's heads in one launch: x [T, G, D] (last dim contiguous) -> a new
    contiguous [T, G, D] whose heads g < ``rows`` are ``rms_norm_ref(x[:, g], w)``, ``rows`` <= g < ``rows2``
    with ``w2``, the rest without a weight (``rms_unit_ref``): q, k and v of a fused projection with their own
    norms (Gemma-4's sliding layers), each head as ``rms_norm`` computes it. Raises ``ValueError`` on bad shapes,
    dtypes or row bounds."""
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, G, D] with a contiguous last dim; got {tuple(x.shape)} strides {x.stride()}")
    _, g, d = x.shape
    for v in (w, w2):
        if v.shape != (d,) or v.dtype != x.dtype or v.device != x.device or v.stride(-1) != 1:
            raise ValueError(f"weights must be [{d}] of x's dtype and device; got {tuple(v.shape)} {v.dtype}")
    if not 0 <= rows <= rows2 <= g:
        raise ValueError(f"row bounds must satisfy 0 <= rows <= rows2 <= {g}; got {rows}, {rows2}")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    _launch(x, y, w, w2, rows, rows2, eps, None, None)
    return y
