"""The middle of a gated MLP, ``act(gate) * up`` of one gate_up projection [T, 2I] -> [T, I], in one launch.

What it does: for the dense 16-bit MLPs of the decode step (Gemma-4's GeGLU MLP beside each MoE block), the two eager
ops (the activation, then the product: two launches and a [T, I] round trip) as one Triton kernel that rounds as
they do: act(gate) to the dtype, then the product once. ``act_mul_ref`` is its PyTorch twin (the eager ops).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pwkernels.moe.activation import check_activation, gate_act, gate_act_ref
from pwkernels.rounding import round_to

BLOCK = 1024  # columns per program


def act_mul_ref(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of gate_up [..., 2I] (gate the first half), in gate_up's dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return gate_act_ref(gate, activation) * up


@triton.jit
def _act_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < inter
    g = tl.load(gu_ptr + row * stride_gu + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + c, mask=m, other=0.0).to(tl.float32)
    a = round_to(gate_act(g, GELU), out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * inter + c, round_to(a * u, out_ptr.dtype.element_ty), mask=m)


def act_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act_mul_ref`` in one Triton launch for a 16-bit gate_up [T, 2I] with contiguous columns on CUDA (or in
    Triton's interpreter), else the eager ops; returns [T, I] in gate_up's dtype. ``activation``: ``silu`` or
    ``gelu_tanh`` (``ValueError`` else). Not a SPEC equation: the dense MLP of the decode step (the experts' own
    activation is inside the MoE kernels, SPEC section 7)."""
    gelu = check_activation(activation)
    on_triton = gate_up.is_cuda or (os.environ.get("TRITON_INTERPRET") == "1" and gate_up.device.type == "cpu")
    if not (on_triton and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1
            and gate_up.dtype in (torch.bfloat16, torch.float16) and gate_up.shape[0] > 0):
        return act_mul_ref(gate_up, activation)
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(BLOCK, triton.next_power_of_2(inter))
    _act_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), GELU=gelu, BLOCK=block,
                                                     num_warps=4)
    return out
