"""Rotary embeddings and small ops of the lean model (RMSNorm's eager math is ``pwkernels.norm.rms_norm_ref``).

What it does: the exact math of the supported families (computed in fp32, cast back, as
transformers does, so that parity holds): RoPE tables (full, or proportional partial RoPE), the
weightless RMSNorm, the gated activations and the logit soft cap. It does not do attention or MoE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pwkernels.norm import rms_norm, rms_norm_ref, rms_unit_ref
from pwkernels.rope_kv import rope_cos_sin_fp32


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str,
                  rotary_dim: int | None = None) -> torch.Tensor:
    """[D/2] fp32 inverse frequencies ``theta^(-2i/D)`` of the default RoPE (full head_dim), or with
    ``rotary_dim`` < D only the first rotary_dim/2 of them and zeros after (proportional partial RoPE: the other
    dims are not rotated)."""
    rot = head_dim if rotary_dim is None else rotary_dim
    exps = torch.arange(0, rot, 2, dtype=torch.int64, device=device).float() / head_dim
    inv = 1.0 / (theta ** exps)
    if rot < head_dim:
        inv = torch.cat([inv, torch.zeros((head_dim - rot) // 2, dtype=torch.float32, device=device)])
    return inv


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 rotary_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] in ``dtype`` for positions [T] int64 (fp32 math; ``rotary_dim`` as ``rope_inv_freq``)."""
    cos, sin = rope_cos_sin_fp32(positions, rope_inv_freq(head_dim, theta, positions.device, rotary_dim))
    return cos.to(dtype), sin.to(dtype)




def act(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The gate activation of a gated MLP: ``silu`` (SwiGLU) or ``gelu_tanh`` (GELU, tanh approximation)."""
    return F.silu(x) if kind == "silu" else F.gelu(x, approximate="tanh")


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(logits / cap)``, or the logits unchanged for ``cap`` None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by cos/sin [T, D] (the rotate-half convention of HF Llama-style models)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def add_rows(out: torch.Tensor, rows: torch.Tensor, y: torch.Tensor) -> None:
    """``out[rows] += y`` for distinct ``rows`` (``index_add_``: each row gets one addition, so the result does not
    depend on the order; on the CPU 5-10x faster than ``index_put_(accumulate=True)`` from a few hundred rows)."""
    out.index_add_(0, rows, y)


def norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, fused: bool = False,
         residual: torch.Tensor | None = None, scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """RMSNorm of x's last dim, with ``weight`` or without (None), then ``(residual + y) * scale`` where given: one
    Triton launch (``pwkernels.norm.rms_norm``) when ``fused`` and x is [T, D] or [T, G, D], the eager ops
    otherwise."""
    kernel = fused and x.dim() in (2, 3) and x.stride(-1) == 1 and (weight is None or weight.dtype == x.dtype)
    if kernel and (residual is None or (residual.dtype == x.dtype and residual.is_contiguous()
                                        and residual.shape == x.shape)) and (
            not isinstance(scale, torch.Tensor) or (scale.numel() == 1 and scale.dtype == x.dtype
                                                    and scale.device == x.device)):
        return rms_norm(x, weight, eps, residual, scale)
    if kernel:  # the norm in its kernel, the residual or scale it cannot take eagerly
        y = rms_norm(x, weight, eps)
    else:
        y = rms_unit_ref(x, eps) if weight is None else rms_norm_ref(x, weight, eps)
    if residual is not None:
        y = residual + y
    return y if scale is None else y * scale
