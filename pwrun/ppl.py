"""Perplexity of the lean model on a token stream (teacher-forced, non-overlapping windows).

What it does: splits the tokens into windows of ``seq_len`` (the GPTQ convention: every window
starts fresh, the first token of a window is context only), runs ``batch`` windows per step
through the engine (``prefill_logits``: one prefill step over the paged KV cache) and returns
exp(mean NLL) over all predicted tokens (and each window's mean NLL, for paired comparisons of
two models on the same text). It does not tokenize (the caller does) and does not change weight
precision.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pwformat.errors import PagedWeightError
from pwrun.model.lean import LeanMoEModel
from pwrun.model.moe import MoEObserver
from pwrun.runner.prefill import prefill_logits


@dataclass(frozen=True)
class PerplexityResult:
    """``nll``: mean negative log-likelihood (nats/token) over ``tokens`` predicted tokens; ``window_nll``: the
    mean NLL of each window (all windows predict the same number of tokens, so ``nll`` is their mean)."""

    nll: float
    tokens: int
    windows: int
    window_nll: tuple[float, ...] = ()

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)


def window_nll_sums(logits: torch.Tensor, ids: torch.Tensor) -> list[float]:
    """Summed NLL (nats, fp64) of each window's predicted tokens: fp32 logits [n * L, V] of windows ids [n, L]
    (each position predicts the next; the last position predicts nothing)."""
    n, seq_len = ids.shape
    logits = logits.view(n, seq_len, -1)[:, :-1]
    target = ids[:, 1:].to(logits.device)
    loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(n, -1)
    return [float(x) for x in loss.double().sum(1).tolist()]


def perplexity(model: LeanMoEModel, token_ids: list[int], seq_len: int = 512, max_windows: int | None = None,
               batch: int = 8, block_size: int = 16, on_window: Callable[[int], None] | None = None,
               observer: MoEObserver | None = None) -> PerplexityResult:
    """Perplexity over ``len(token_ids) // seq_len`` windows (at most ``max_windows``).

    Raises ``PagedWeightError`` if ``seq_len`` exceeds the model's context or the text is shorter
    than one window.
    """
    if max_windows is not None and max_windows < 1:
        raise PagedWeightError(f"--max-windows must be >= 1, got {max_windows}")
    if not 2 <= seq_len <= model.spec.max_position_embeddings:
        raise PagedWeightError(f"--seq-len {seq_len} must be in [2, {model.spec.max_position_embeddings}] "
                               "(the model's context)")
    n = len(token_ids) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise PagedWeightError(f"the text has {len(token_ids)} tokens, fewer than one window of {seq_len}: "
                               "lower --seq-len or give more text")
    ids = torch.tensor(token_ids[: n * seq_len], dtype=torch.int64).view(n, seq_len)
    sums: list[float] = []
    for lo in range(0, n, batch):
        rows = range(lo, min(n, lo + batch))
        logits = prefill_logits(model, [ids[r].tolist() for r in rows], block_size, observer=observer)
        sums += window_nll_sums(logits, ids[lo:lo + len(rows)])
        if on_window is not None:
            on_window(len(rows))
    return PerplexityResult(nll=sum(sums) / (n * (seq_len - 1)), tokens=n * (seq_len - 1), windows=n,
                            window_nll=tuple(x / (seq_len - 1) for x in sums))
