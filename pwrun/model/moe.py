"""MoE feed-forward, pure-PyTorch reference: softmax router, top-k, SwiGLU experts, shared expert.

What it does: ``route`` implements the routers of all supported families (softmax over the
experts in fp32, top-k, optional renormalisation; SPEC Eq. 1 uses these weights as routing
mass); ``moe_forward`` groups tokens by expert, runs each expert's ``gate_up`` / ``down`` and
accumulates ``sum_k w_tk * down_e(silu(gate_e(x_t)) * up_e(x_t))``, then adds the shared expert
(scaled by its sigmoid gate where the family has one). This is the reference twin of the fused
Triton MoE kernel of a later stage. ``MoEObserver`` lets calibration see each block's inputs.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from pwrun.model.inventory import SHARED_EXPERT
from pwrun.model.spec import MoESpec
from pwrun.model.weights import MLPWeights, MoEWeights


class MoEObserver(Protocol):
    """Receives what calibration needs from one MoE layer (routing and the inputs of each block)."""

    def routing(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None: ...

    def expert_inputs(self, layer: int, expert: int, x: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        """x [n, H]: tokens routed to ``expert`` (gate_up input); h [n, I]: down input; w [n]: routing weights.

        ``expert`` is ``SHARED_EXPERT`` (-1) for the shared expert, which sees every token (w = 1).
        """


def route(x: torch.Tensor, router: torch.Tensor, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, k] (x's dtype) and expert ids [T, k] int64 for x [T, H], router [E, H]."""
    logits = F.linear(x, router)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), ids


def mlp_forward(x: torch.Tensor, w: MLPWeights) -> torch.Tensor:
    """SwiGLU MLP: x [T, H] -> [T, H] with gate_up [2I, H], down [H, I]."""
    gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w.down)


def moe_forward(x: torch.Tensor, w: MoEWeights, spec: MoESpec, layer: int = 0,
                observer: MoEObserver | None = None) -> torch.Tensor:
    """MoE block output [T, H] for normalised hidden states x [T, H]."""
    weights, ids = route(x, w.router, spec)
    if observer is not None:
        observer.routing(layer, ids, weights)
    return experts_forward(x, w, weights, ids, spec.num_experts, layer, observer)


def experts_forward(x: torch.Tensor, w: MoEWeights, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                    layer: int = 0, observer: MoEObserver | None = None) -> torch.Tensor:
    """Routed experts (tokens grouped by expert) plus the shared expert, for given routing weights/ids [T, k].

    ``w.gate_up[e]`` / ``w.down[e]`` may be any indexable of [2I, H] / [H, I] tensors (the runtime
    passes dense views of its AP blocks).
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
        h = F.silu(gate) * up
        if observer is not None:
            observer.expert_inputs(layer, e, xe, h, flat_w[start:start + n])
        y = F.linear(h, w.down[e]) * flat_w[start:start + n, None]
        out.index_add_(0, idx, y)
        start += n
    if w.shared is not None:
        gate, up = F.linear(x, w.shared.gate_up).chunk(2, dim=-1)
        h = F.silu(gate) * up
        if observer is not None:
            observer.expert_inputs(layer, SHARED_EXPERT, x, h, torch.ones(x.shape[0], dtype=x.dtype, device=x.device))
        s = F.linear(h, w.shared.down)
        if w.shared_gate is not None:
            s = torch.sigmoid(F.linear(x, w.shared_gate)) * s
        out = out + s
    return out
