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
            progress: Callable[[str, int, int], None] | None = None, label: str = "calibrate"
            ) -> PerplexityResult:
    """Forward every window (all of one length) with ``observer`` attached; returns their perplexity.

    ``progress(label, windows_done, windows_total)`` is called after each batch.
    """
    flat = [t for w in windows for t in w]
    done = 0
    if progress is not None:  # the task starts with the work: its rate and ETA count from here
        progress(label, 0, len(windows))

    def step(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(label, done, len(windows))

    return perplexity(model, flat, seq_len=len(windows[0]), batch=batch, observer=observer, on_window=step)
