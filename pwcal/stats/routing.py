"""Routing mass per (layer, expert), SPEC Eq. 1, gathered by observing the lean model's routers.

What it does: ``RoutingMass`` implements ``MoEObserver.routing``: it accumulates, per MoE layer,
the routing weight each expert receives (``sum_t sum_k r_{l,t,k} 1{z_{l,t,k} = e}``) and the
number of (token, slot) assignments, and ``mass()`` normalises per layer so each row sums to 1.
It does not look at expert inputs (the Hessian statistics of a later stage do).
"""

from __future__ import annotations

import numpy as np
import torch


class RoutingMass:
    """Accumulates routing weight and token counts: both [num_layers, num_experts] float64 / int64."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.weight = np.zeros((num_layers, num_experts), dtype=np.float64)
        self.tokens = np.zeros((num_layers, num_experts), dtype=np.int64)

    def routing(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """ids, weights: [T, k] from the router of ``layer``."""
        e = self.weight.shape[1]
        flat = ids.flatten()
        self.weight[layer] += torch.zeros(e, dtype=torch.float64, device=ids.device).index_add_(
            0, flat, weights.flatten().double()).cpu().numpy()
        self.tokens[layer] += torch.bincount(flat, minlength=e).cpu().numpy()

    def expert_inputs(self, layer: int, expert: int, x: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        """Not needed for routing mass."""

    def mass(self) -> np.ndarray:
        """m_{l,e} of Eq. 1: [num_layers, num_experts], each row sums to 1 (rows of unseen layers are 0)."""
        tot = self.weight.sum(axis=1, keepdims=True)
        return np.divide(self.weight, tot, out=np.zeros_like(self.weight), where=tot > 0)
