"""The pure-PyTorch reference of the AP MoE (SPEC section 7), the slow twin every MoE kernel is tested against.

For hidden states x [T, H] and top-k expert ids / weights [T, k]:
``y[t] = sum_j w_tj * down_e(act(gate_e(x_t)) * up_e(x_t))`` with e = ids[t, j] (act: SiLU, or GELU-tanh),
each block dequantized at its committed bitwidth. Like the kernels it accumulates in fp32 and stores the
intermediate in x's dtype. ``dense_moe_ref`` is the same for 16-bit experts (``DenseExperts``), the twin of
``pwkernels.moe.dense``.
"""

from __future__ import annotations

import torch

from pwformat.ap import dequantize
from pwkernels.moe.activation import gate_act_ref
from pwkernels.moe.experts import APExperts, DenseExperts


def ap_moe_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: APExperts,
               activation: str = "silu") -> torch.Tensor:
    """Reference MoE output y [T, H] (x's dtype) from x [T, H], topk_ids/topk_w [T, k]; ``activation`` of the gate
    half (``pwkernels.moe.activation``)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        pg, lg, _, kg = experts.block(2 * e)
        pd_, ld, _, kd = experts.block(2 * e + 1)
        gate_up = dequantize(pg, lg, kg, pg.shape[0], torch.float32)
        down = dequantize(pd_, ld, kd, pd_.shape[0], torch.float32)
        g, u = (x[rows].float() @ gate_up.T).chunk(2, dim=-1)
        h = (gate_act_ref(g, activation) * u).to(x.dtype).float()  # the kernels store the intermediate in x's dtype
        out.index_add_(0, rows, (h @ down.T) * topk_w[rows, slot, None].float())
    return out.to(x.dtype)


def dense_moe_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, experts: DenseExperts,
                  activation: str = "silu") -> torch.Tensor:
    """Reference MoE output y [T, H] (x's dtype) of 16-bit experts from x [T, H], topk_ids/topk_w [T, k]: fp32
    accumulation, the intermediate rounded to x's dtype, one rounding of the sum (as ``pwkernels.moe.dense``)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in topk_ids.unique().tolist():
        rows, slot = (topk_ids == e).nonzero(as_tuple=True)
        g, u = (x[rows].float() @ experts.block(2 * e).float().T).chunk(2, dim=-1)
        h = (gate_act_ref(g, activation) * u).to(x.dtype).float()
        out.index_add_(0, rows, (h @ experts.block(2 * e + 1).float().T) * topk_w[rows, slot, None].float())
    return out.to(x.dtype)
