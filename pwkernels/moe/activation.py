"""The gate activations of the AP MoE experts: SiLU (SwiGLU experts) and GELU with the tanh approximation
(GeGLU experts of Gemma-4), as one Triton helper and its PyTorch twin.

``gelu_tanh(g) = 0.5 g (1 + tanh(c (g + 0.044715 g^3)))``, c = sqrt(2 / pi), is computed as
``g * sigmoid(2 c (g + 0.044715 g^3))`` (the same function: 0.5 (1 + tanh z) = sigmoid(2 z)), which needs only
``exp`` and saturates correctly at both ends in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ACTIVATIONS = ("silu", "gelu_tanh")


def check_activation(activation: str) -> bool:
    """True for ``gelu_tanh``, False for ``silu`` (the kernels' GELU flag); ``ValueError`` for anything else."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return activation == "gelu_tanh"


def gate_act_ref(g: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation of the gate half, in g's dtype."""
    return F.gelu(g, approximate="tanh") if check_activation(activation) else F.silu(g)


@triton.jit
def gate_act(g, GELU: tl.constexpr):
    """fp32 g -> act(g): SiLU, or GELU-tanh when GELU (see the module docstring)."""
    if GELU:
        return g / (1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g)))
    return g / (1.0 + tl.exp(-g))
