"""Run the lean model over calibration windows with several observers at once.

What it does: ``Tee`` forwards every ``MoEObserver`` call to each observer it holds;
``observe`` runs teacher-forced forward passes (through ``pwrun.ppl``) over the windows and
reports progress. It does not interpret what is observed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pwrun.model.lean import LeanMoEModel
from pwrun.model.moe import MoEObserver
from pwrun.ppl import PerplexityResult, perplexity


class Tee:
    """Fan out MoE observations to several observers."""

    def __init__(self, *observers: MoEObserver) -> None:
        self.observers = observers

    def routing(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        for o in self.observers:
            o.routing(layer, ids, weights)

    def expert_inputs(self, layer: int, expert: int, x: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        for o in self.observers:
            o.expert_inputs(layer, expert, x, h, w)


def observe(model: LeanMoEModel, windows: list[list[int]], observer: MoEObserver, batch: int = 8,
            on_window: Callable[[int], None] | None = None) -> PerplexityResult:
    """Forward every window (all of one length) with ``observer`` attached; returns their perplexity."""
    flat = [t for w in windows for t in w]
    return perplexity(model, flat, seq_len=len(windows[0]), batch=batch, observer=observer, on_window=on_window)
