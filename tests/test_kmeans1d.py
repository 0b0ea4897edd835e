"""Nested weighted k-means: nestedness, monotone error, optimality of splits, degenerate rows."""

from __future__ import annotations

import itertools

import pytest
import torch

from pwcal.quant.kmeans1d import nested_kmeans


def weighted_errors(x: torch.Tensor, w: torch.Tensor, nc, seed: int) -> torch.Tensor:
    return torch.stack([((nc.luts[b].double().gather(1, nc.codes.long() >> (8 - b)) - x.double()) ** 2
                         * w.double()).sum(1) for b in range(seed, 9)])


@pytest.mark.parametrize("seed", [2, 3])
def test_error_never_increases_with_bits_random(seed: int) -> None:
    torch.manual_seed(seed)
    x = torch.cat([torch.randn(40, 333), torch.randn(10, 333) ** 3])  # gaussian and heavy-tailed rows
    w = torch.rand(50, 333) ** 4 + 1e-3  # very uneven Hessian weights
    nc = nested_kmeans(x, w, seed)
    e = weighted_errors(x, w, nc, seed)
    assert (e[1:] <= e[:-1]).all()
    assert (e[-1] < 0.01 * e[0]).all()  # 8 bits is far better than the seed


def test_luts_consistent_with_codes() -> None:
    torch.manual_seed(1)
    x, w = torch.randn(8, 200), torch.rand(8, 200) + 0.1
    nc = nested_kmeans(x, w, 3)
    for b in range(3, 9):
        assert nc.luts[b].shape == (8, 2**b) and nc.luts[b].dtype == torch.float16
        code = nc.codes.long() >> (8 - b)
        # every used LUT entry is (within fp16 rounding) the weighted mean of its members
        for r in range(8):
            for c in code[r].unique().tolist():
                m = code[r] == c
                mean = (x[r, m] * w[r, m]).sum() / w[r, m].sum()
                assert abs(nc.luts[b][r, c].float() - mean) <= 2e-3 * (1 + abs(mean))


def test_seed_split_is_optimal_two_means() -> None:
    # with a 1-bit seed and a tiny row, the seed must find the globally optimal weighted 2-means split
    torch.manual_seed(2)
    x = torch.randn(1, 9)
    w = torch.rand(1, 9) + 0.1
    nc = nested_kmeans(x, w, 1)
    xs, order = x[0].double().sort()
    ws = w[0].double()[order]
    best = min(
        sum(((xs[s] - (xs[s] * ws[s]).sum() / ws[s].sum()) ** 2 * ws[s]).sum() for s in (slice(0, t), slice(t, 9)))
        for t in range(1, 9))
    got = weighted_errors(x, w, nc, 1)[0, 0]
    assert got <= best + 1e-3


def test_degenerate_rows() -> None:
    x = torch.zeros(4, 50)
    x[1] = 0.25  # all equal
    x[2, :3] = torch.tensor([1.0, 2.0, 3.0])  # fewer distinct values than 2^3
    x[3] = torch.arange(50.0) % 5
    nc = nested_kmeans(x, torch.ones_like(x), 3)
    for b in range(3, 9):
        rec = nc.luts[b].float().gather(1, nc.codes.long() >> (8 - b))
        assert torch.equal(rec, x), b  # <= 2^b distinct values are represented exactly


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_raise(bad: float) -> None:
    x = torch.randn(2, 10)
    x[1, 3] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        nested_kmeans(x, torch.ones_like(x), 3)


def test_codes_are_independent_of_row_batching() -> None:
    torch.manual_seed(3)
    x, w = torch.randn(6, 64), torch.rand(6, 64) + 0.1
    whole = nested_kmeans(x, w, 3)
    for lo, hi in itertools.pairwise([0, 2, 6]):
        part = nested_kmeans(x[lo:hi], w[lo:hi], 3)
        assert torch.equal(part.codes, whole.codes[lo:hi])
