"""Successive halving over bucket settings: the selection phase of ``pwcal search-buckets``.

What it does: the selection windows are cut into ``rounds`` consecutive chunks. Round r scores the allocations of
the candidates still in the race on chunk r; after every round but the last, only the candidates whose score (mean
log-perplexity over the budgets, on all windows so far) is at most the n-th best stay, n = ceil(``keep`` x the
feasible ones still in), at least two, plus the neutral candidate (index 0: the reference every report compares
with). The winner is the best of the last round, so it is scored on every selection window. Candidates within the
noise of each other survive the early rounds; those clearly worse stop costing passes after a few windows (the
usual best-arm identification under a fixed budget: Karnin et al. 2013, Jamieson & Talwalkar 2016). With
``rounds`` 1 every candidate sees every window. It does not run the model: ``window_nll`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# window_nll(allocations, lo, hi): the mean NLL of each allocation on selection windows lo..hi-1 [A, hi - lo]
WindowNLL = Callable[[list[np.ndarray], int, int], np.ndarray]


@dataclass(frozen=True)
class Selection:
    """``scores`` [C]: mean log-perplexity over the budgets on the windows each candidate saw (+inf: a budget it
    cannot fit); ``windows`` [C]: how many selection windows it saw (the first ``windows[c]``); ``nll``: the
    window NLLs of every allocation scored, by its bytes; ``best``: the winner."""

    scores: np.ndarray
    windows: np.ndarray
    nll: dict[bytes, np.ndarray]
    best: int


def round_bounds(windows: int, rounds: int) -> list[int]:
    """Window index where each round starts, then ``windows``: near-equal consecutive chunks."""
    return [r * windows // rounds for r in range(rounds + 1)]


def select(fits: list[list[np.ndarray | None]], windows: int, rounds: int, keep: float,
           window_nll: WindowNLL) -> Selection:
    """Race the candidates ``fits[c][k]`` (allocation of candidate c at budget k, None where it does not fit) over
    ``windows`` selection windows in ``rounds`` rounds keeping the best ``keep`` of them after each (module doc).
    Each distinct allocation is scored once per window, whichever candidates share it."""
    n = len(fits)
    bounds = round_bounds(windows, rounds)
    nll: dict[bytes, np.ndarray] = {}
    scores, seen = np.full(n, math.inf), np.zeros(n, dtype=np.int64)
    alive = np.arange(n)
    for r in range(rounds):
        lo, hi = bounds[r], bounds[r + 1]
        todo: dict[bytes, np.ndarray] = {}
        for c in alive:
            for q in fits[c]:
                if q is not None and q.tobytes() not in todo:
                    todo[q.tobytes()] = q
        if todo and hi > lo:
            got = window_nll(list(todo.values()), lo, hi)
            for key, row in zip(todo, got, strict=True):
                nll.setdefault(key, np.full(windows, np.nan))[lo:hi] = row
        for c in alive:
            seen[c] = hi
            qs = fits[c]
            scores[c] = (math.inf if any(q is None for q in qs) else
                         float(np.mean([nll[q.tobytes()][:hi].mean() for q in qs if q is not None])))
        if r < rounds - 1:
            alive = _survivors(alive, scores, keep)
    best = int(alive[np.argmin(scores[alive])])
    return Selection(scores, seen, nll, best)


def _survivors(alive: np.ndarray, scores: np.ndarray, keep: float) -> np.ndarray:
    """The candidates of ``alive`` that stay: finite scores at most the n-th best (ties stay; n = ceil(keep x the
    finite ones), at least 2), and the neutral candidate 0 if it was in."""
    finite = alive[np.isfinite(scores[alive])]
    if len(finite) == 0:
        return alive
    n = min(len(finite), max(2, math.ceil(keep * len(finite))))
    cut = np.sort(scores[finite])[n - 1]
    stay = finite[scores[finite] <= cut]
    return np.union1d(stay, alive[alive == 0])
