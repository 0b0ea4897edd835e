"""Prompt features phi of every expert linear block (SPEC Eq. 5), gathered by observing the lean model.

What it does: implements ``MoEObserver.expert_inputs``: per block i = (layer, expert, unit) it
accumulates over the tokens routed to it, with r = routing weight (1 for the shared expert),
``sum r``, ``sum r * ||x||``, ``sum r * ||x||^2`` and ``max ||x||`` (x = the block's input: the layer
input for gate_up, silu(gate) * up for down). ``features()`` gives the three features of Eq. 5:
routing-weighted mean input norm, routing-weighted RMS input norm, max input norm.
"""

from __future__ import annotations

import numpy as np
import torch

FEATURES = ("mean_norm", "rms_norm", "max_norm")


class NormFeatures:
    """Accumulators per block key (layer, expert, unit): [sum r, sum r*n, sum r*n^2, max n]."""

    def __init__(self) -> None:
        self.acc: dict[tuple[int, int, str], np.ndarray] = {}

    def routing(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Not needed here."""

    def expert_inputs(self, layer: int, expert: int, x: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        r = w.double()
        for unit, inp in (("gate_up", x), ("down", h)):
            n = inp.double().norm(dim=-1)
            new = torch.stack([r.sum(), (r * n).sum(), (r * n * n).sum(), n.max()]).cpu().numpy()
            key = (layer, expert, unit)
            if key in self.acc:
                old = self.acc[key]
                self.acc[key] = np.array([old[0] + new[0], old[1] + new[1], old[2] + new[2], max(old[3], new[3])])
            else:
                self.acc[key] = new

    def features(self) -> dict[tuple[int, int, str], np.ndarray]:
        """phi [3] float64 per observed block: (mean_norm, rms_norm, max_norm)."""
        return {k: np.array([a[1] / a[0], np.sqrt(a[2] / a[0]), a[3]]) for k, a in self.acc.items() if a[0] > 0}
