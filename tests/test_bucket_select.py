"""Successive halving of the bucket search (``pwcal.bucket_select``) against exhaustive scoring."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from pwcal.bucket_select import round_bounds, select


class Oracle:
    """Window NLLs of allocations (a per-allocation mean plus per-window noise) that counts what it scores."""

    def __init__(self, means: dict[bytes, float], windows: int, noise: float, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.table = {k: m + noise * rng.standard_normal(windows) for k, m in means.items()}
        self.scored: list[tuple[bytes, int]] = []

    def __call__(self, allocations: list[np.ndarray], lo: int, hi: int) -> np.ndarray:
        keys = [q.tobytes() for q in allocations]
        assert len(set(keys)) == len(keys)  # each allocation once per call
        self.scored += [(k, w) for k in keys for w in range(lo, hi)]
        return np.stack([self.table[k][lo:hi] for k in keys])


def _problem(n: int, budgets: int, seed: int, shared: float = 0.3) -> tuple[list[list[np.ndarray | None]],
                                                                            dict[bytes, float]]:
    """n candidates x budgets allocations (some shared between candidates, some infeasible) and their means."""
    rng = np.random.default_rng(seed)
    fits: list[list[np.ndarray | None]] = []
    pool: list[np.ndarray] = []
    for c in range(n):
        row: list[np.ndarray | None] = []
        for _ in range(budgets):
            if c > 0 and rng.random() < 0.05:
                row.append(None)  # the neutral candidate 0 fits every budget
            elif pool and rng.random() < shared:
                row.append(pool[int(rng.integers(len(pool)))])
            else:
                pool.append(rng.integers(3, 9, 12))
                row.append(pool[-1])
        fits.append(row)
    means = {q.tobytes(): float(rng.normal(4.7, 0.01)) for q in pool}
    return fits, means


def _exhaustive(fits: list[list[np.ndarray | None]], oracle: Oracle, windows: int) -> np.ndarray:
    return np.array([math.inf if any(q is None for q in row) else
                     float(np.mean([oracle.table[q.tobytes()][:windows].mean() for q in row if q is not None]))
                     for row in fits])


@pytest.mark.parametrize("seed", range(6))
def test_one_round_is_the_exhaustive_search(seed: int) -> None:
    fits, means = _problem(30, 5, seed)
    oracle = Oracle(means, 12, 0.02, seed)
    got = select(fits, 12, 1, 0.5, oracle)
    want = _exhaustive(fits, oracle, 12)
    assert got.best == int(np.argmin(want))
    np.testing.assert_allclose(got.scores, want, rtol=0, atol=1e-12)
    assert (got.windows == 12).all()
    assert len(oracle.scored) == len(set(oracle.scored)) == 12 * len(means)  # each allocation once per window


@pytest.mark.parametrize("seed", range(6))
def test_halving_scores_survivors_on_every_window_and_the_rest_on_a_prefix(seed: int) -> None:
    fits, means = _problem(40, 5, seed)
    oracle = Oracle(means, 12, 0.02, seed)
    got = select(fits, 12, 4, 0.34, oracle)
    assert len(oracle.scored) == len(set(oracle.scored)) < 12 * len(means)  # no window scored twice; fewer passes
    # every candidate's score is the exhaustive score on the windows it saw
    for c, row in enumerate(fits):
        w = int(got.windows[c])
        assert w in round_bounds(12, 4)[1:]
        want = math.inf if any(q is None for q in row) else np.mean([oracle.table[q.tobytes()][:w].mean()
                                                                     for q in row if q is not None])
        assert got.scores[c] == pytest.approx(want, abs=1e-12) if math.isfinite(want) else got.scores[c] == want
    final = np.flatnonzero(got.windows == 12)
    assert 0 in final and got.best in final and got.best == final[np.argmin(got.scores[final])]
    # the neutral candidate stays in however bad it is; infeasible ones leave after the first round
    assert all(got.windows[c] == 3 for c, row in enumerate(fits) if any(q is None for q in row))


def test_clearly_better_candidates_win_and_ties_stay_together() -> None:
    """Well-separated candidates: halving finds the exhaustive winner; candidates with the same allocations (equal
    scores) go on together; a candidate worse than most stops after the first round."""
    rng = np.random.default_rng(7)
    qs = [rng.integers(3, 9, 12) for _ in range(20)]
    fits: list[list[np.ndarray | None]] = [[q] for q in qs] + [[qs[5]]]  # candidate 20 repeats candidate 5
    means = {q.tobytes(): 4.0 + 0.1 * i for i, q in enumerate(qs)}
    means[qs[5].tobytes()] = 3.0  # the best by far
    oracle = Oracle(means, 8, 0.01, 0)
    got = select(fits, 8, 3, 0.25, oracle)
    assert got.best == 5 and got.windows[20] == 8  # the twin is scored with it (its allocation is shared)
    assert got.windows[19] == round_bounds(8, 3)[1]
    assert got.windows[0] == 8  # neutral


def test_round_bounds_cut_near_equal_chunks() -> None:
    assert round_bounds(12, 6) == [0, 2, 4, 6, 8, 10, 12]
    assert round_bounds(12, 5) == [0, 2, 4, 7, 9, 12]
    for w in range(1, 30):
        for r in range(1, w + 1):
            b = round_bounds(w, r)
            assert b[0] == 0 and b[-1] == w and all(hi > lo for lo, hi in itertools.pairwise(b))
