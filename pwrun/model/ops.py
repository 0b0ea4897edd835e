"""Rotary embeddings of the lean model (RMSNorm's eager math is ``kernels.norm.rms_norm_ref``).

What it does: the exact math of the supported families (computed in fp32, cast back, as
transformers does, so that parity holds). It does not do attention or MoE.
"""

from __future__ import annotations

import torch

from kernels.rope_kv import rope_cos_sin_fp32


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str) -> torch.Tensor:
    """[D/2] fp32 inverse frequencies ``theta^(-2i/D)`` of the default RoPE (full head_dim)."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta ** exps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] in ``dtype`` for positions [T] int64 (default RoPE, full head_dim, fp32 math)."""
    cos, sin = rope_cos_sin_fp32(positions, rope_inv_freq(head_dim, theta, positions.device))
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] by cos/sin [T, D] (the rotate-half convention of HF Llama-style models)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
