"""Diagonal Hessian of every expert linear block's inputs, gathered by observing the lean model.

What it does: implements ``MoEObserver.expert_inputs``: for each block i = (layer, expert, unit)
it accumulates ``diag(X^T X)`` over the calibration tokens routed to that expert (gate_up sees
the layer input x [n, H]; down sees silu(gate) * up [n, I]; the shared expert sees every token),
and the number of tokens. These are the k-means weights of the quantizer (SPEC section 2) and
the h of the Hessian sensitivity (SPEC Eq. 2). Sums are float64 on the observed device.
"""

from __future__ import annotations

import torch

from pwrun.model.inventory import LinearBlock


class HessianDiag:
    """Per-block sums of squared inputs; ``diag[(layer, expert, unit)]`` [K] float64, ``tokens[...]`` int."""

    def __init__(self) -> None:
        self.diag: dict[tuple[int, int, str], torch.Tensor] = {}
        self.tokens: dict[tuple[int, int], int] = {}

    def routing(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Not needed here (routing mass has its own observer)."""

    def expert_inputs(self, layer: int, expert: int, x: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        for unit, inp in (("gate_up", x), ("down", h)):
            key = (layer, expert, unit)
            sq = inp.double().pow(2).sum(0)
            self.diag[key] = self.diag[key] + sq if key in self.diag else sq
        self.tokens[(layer, expert)] = self.tokens.get((layer, expert), 0) + x.shape[0]

    def weights_for(self, block: LinearBlock, min_tokens: int, eps: float = 1e-6) -> tuple[torch.Tensor | None, int]:
        """k-means weights [K] float64 for ``block`` and its token count.

        Returns ``None`` (uniform fallback) when the expert saw fewer than ``min_tokens`` tokens.
        A relative floor ``eps * mean`` keeps every weight positive (dead input columns).
        """
        n = self.tokens.get((block.layer, block.expert), 0)
        d = self.diag.get((block.layer, block.expert, block.unit))
        if d is None or n < min_tokens:
            return None, n
        return kmeans_weights(d, eps), n


def kmeans_weights(diag: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The k-means weights [K] of a Hessian diagonal [K]: ``diag + eps * mean(diag)``, all positive."""
    return diag + eps * diag.mean().clamp_min(1e-30)

