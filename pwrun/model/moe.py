"""MoE feed-forward, pure-PyTorch reference: softmax router, top-k, gated experts, shared expert.

What it does: ``route`` implements the routers of all supported families (softmax over the
experts in fp32, top-k, optional renormalisation, Gemma-4's per-expert scale; SPEC Eq. 1 uses these
weights as routing mass; ``router_input`` is what the router reads); ``moe_forward`` groups tokens by
expert, runs each expert's ``gate_up`` / ``down`` and
accumulates ``sum_k w_tk * down_e(act(gate_e(x_t)) * up_e(x_t))``, then adds the shared expert
(scaled by its sigmoid gate where the family has one). This is the reference twin of the fused
Triton MoE kernel of a later stage. ``MoEObserver`` lets calibration see each block's inputs.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from pwkernels.act_mul import act_mul
from pwkernels.dense_gemv import linear
from pwrun.model.inventory import SHARED_EXPERT
from pwrun.model.ops import act, add_rows, norm
from pwrun.model.spec import MoESpec
from pwrun.model.weights import MLPWeights, MoEWeights


class MoEObserver(Protocol):
    """Receives what calibration needs from one MoE layer (routing and the inputs of each block)."""

    def routing(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None: ...

    def expert_inputs(self, layer: int, expert: int, x: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        """x [n, H]: tokens routed to ``expert`` (gate_up input); h [n, I]: down input; w [n]: routing weights.

        ``expert`` is ``SHARED_EXPERT`` (-1) for the shared expert, which sees every token (w = 1).
        """


def router_input(h: torch.Tensor, w: MoEWeights, spec: MoESpec, eps: float, fused: bool = False) -> torch.Tensor:
    """What the router of a ``gemma4`` block reads: the residual stream h [T, H] RMS-normalised without weight,
    times ``router_scale`` and H^-0.5 (other routers read the MoE input itself: callers pass it)."""
    assert spec.router == "gemma4" and w.router_scale is not None
    return norm(h, w.router_scale, eps, fused, scale=h.shape[-1] ** -0.5)  # one launch where fused


def route(x: torch.Tensor, router: torch.Tensor, spec: MoESpec, expert_scale: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, k] (x's dtype) and expert ids [T, k] int64 for the router input x [T, H], router
    [E, H]; ``expert_scale`` [E] multiplies each renormalised weight (Gemma-4)."""
    logits = F.linear(x, router)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if expert_scale is not None:
        weights = weights * expert_scale[ids]
    return weights.to(x.dtype), ids


def mlp_forward(x: torch.Tensor, w: MLPWeights, activation: str = "silu", fused: bool = False) -> torch.Tensor:
    """Gated MLP: x [T, H] -> [T, H] with gate_up [2I, H], down [H, I] (SwiGLU, or GeGLU for ``gelu_tanh``);
    ``fused``: the decode GEMV of ``pwkernels.dense_gemv`` for few tokens and ``pwkernels.act_mul`` (CUDA
    runtime)."""
    lin = linear if fused else F.linear
    if fused:  # the activation and the product in one launch (``pwkernels.act_mul``)
        return lin(act_mul(lin(x, w.gate_up), activation), w.down)
    gate, up = lin(x, w.gate_up).chunk(2, dim=-1)
    return lin(act(gate, activation) * up, w.down)


def moe_forward(x: torch.Tensor, w: MoEWeights, spec: MoESpec, layer: int = 0,
                observer: MoEObserver | None = None, r: torch.Tensor | None = None) -> torch.Tensor:
    """MoE block output [T, H] for normalised hidden states x [T, H]; ``r``: the router's input if not x."""
    weights, ids = route(x if r is None else r, w.router, spec, w.expert_scale)
    if observer is not None:
        observer.routing(layer, ids, weights)
    return experts_forward(x, w, weights, ids, spec.num_experts, layer, observer, spec.activation)


def experts_forward(x: torch.Tensor, w: MoEWeights, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                    layer: int = 0, observer: MoEObserver | None = None, activation: str = "silu") -> torch.Tensor:
    """Routed experts (tokens grouped by expert) plus the shared expert, for given routing weights/ids [T, k].

    ``w.gate_up[e]`` / ``w.down[e]`` may be any indexable of [2I, H] / [H, I] tensors (the runtime
    passes dense views of its AP blocks). ``activation``: of the gate half (``MoESpec.activation``).
    """
    top_k = ids.shape[1]
    out = torch.zeros_like(x)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    token_of = order // top_k
    flat_w = weights.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        idx = token_of[start:start + n]
        xe = x.index_select(0, idx)
        gate, up = F.linear(xe, w.gate_up[e]).chunk(2, dim=-1)
        h = act(gate, activation) * up
        if observer is not None:
            observer.expert_inputs(layer, e, xe, h, flat_w[start:start + n])
        y = F.linear(h, w.down[e]) * flat_w[start:start + n, None]
        add_rows(out, idx, y)
        start += n
    if w.shared is not None:
        gate, up = F.linear(x, w.shared.gate_up).chunk(2, dim=-1)
        h = act(gate, activation) * up
        if observer is not None:
            observer.expert_inputs(layer, SHARED_EXPERT, x, h, torch.ones(x.shape[0], dtype=x.dtype, device=x.device))
        s = F.linear(h, w.shared.down)
        if w.shared_gate is not None:
            s = torch.sigmoid(F.linear(x, w.shared_gate)) * s
        out = out + s
    return out
