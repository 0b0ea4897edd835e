"""Elementwise building blocks of the lean model: RMSNorm (with the residual add) and rotary embeddings.

What it does: the exact math of the supported families (computed in fp32, cast back, as
transformers does, so that parity holds). It does not do attention or MoE.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: x [..., H] any float dtype, weight [H] -> [..., H] in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: (h + delta, rms_norm(h + delta)) [T, H]; h itself when ``delta`` is None.

    The eager twin of the fused kernel ``kernels.fused_norm.add_rms_norm``.
    """
    if delta is not None:
        h = h + delta
    return h, rms_norm(h, weight, eps)


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str) -> torch.Tensor:
    """[D/2] fp32 inverse frequencies ``theta^(-2i/D)`` of the default RoPE (full head_dim)."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta ** exps)


def rope_cos_sin_fp32(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] fp32, not rounded, for positions [T] int64 and inv_freq [D/2] fp32.

    Shared by the eager tables (``rope_cos_sin`` rounds them to the model dtype) and the reference
    of the fused kernel (``kernels.rope_kv.rope_kv_write_ref``, which rounds them the same way but
    rotates in fp32), so both start from the same angles.
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


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
