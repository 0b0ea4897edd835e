"""Weighted 1-D k-means per row with nested upscaling, vectorized over rows (PyTorch, CPU or GPU).

What it does (SPEC section 2, SqueezeLLM seed + Any-Precision upscaling): for every row of x
[R, K] with positive weights w [R, K], (1) a weighted Lloyd k-means with 2^seed clusters, started
at equal-weight quantiles; (2) level by level up to 8 bits, every cluster split in two by the
exact weighted 2-means of its own members (children 2c and 2c+1). In 1-D every cluster is an
interval of the sorted row, so all statistics come from prefix sums (float64) and each level
is O(R * K) work with no per-row Python loop.

``split_clusters`` is step (2) for memberships that are not intervals of the sorted row (the error-feedback
quantizer, ``pwcal.quant.gptq``, moves weights between clusters).

LUT values are rounded to float16 and then, per child, the better of (rounded child mean,
rounded parent value) is kept, so the weighted error provably never increases with b, rounding
included. An empty child (a cluster with < 2 distinct members) inherits its parent's value.

Why our own code and not ``flash1dkmeans`` (PyPI), decided by measurement (``bench/quantize_speed.py``):
that library runs one row per call (numba, CPU). On 64 rows x 2048 of a Qwen1.5-MoE gate_up block it
took 0.46 s on this project's 2-core CPU against 0.92 s for this code on the same CPU
(``bench/results/kmeans_compare_cpu.md``), but this code on one H200 took 0.025 s for the same rows and
quantized the whole Qwen1.5-MoE-A2.7B expert set (13.3 B weights, 7.3 M rows) in 59 s end to end
(``bench/results/quantize_h200.md``), where flash1dkmeans at ~7 ms per row would need hours on a CPU.
For large models the GPU version wins by orders of magnitude; on the bundled tiny model either takes
seconds, so one implementation serves both and results do not depend on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PARENT_BITS = 8


@dataclass
class NestedCodes:
    """codes [R, K] uint8 (8-bit parent codes); luts[b] [R, 2^b] float16 for b in seed..8."""

    codes: torch.Tensor
    luts: dict[int, torch.Tensor]


def _prefix_sums(xs: torch.Tensor, ws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefix sums [R, K+1] float64 of w, w x and w x^2 along the (sorted) rows xs, ws [R, K]."""
    zero = torch.zeros(xs.shape[0], 1, dtype=torch.float64, device=xs.device)
    return (torch.cat([zero, ws.cumsum(1)], 1), torch.cat([zero, (ws * xs).cumsum(1)], 1),
            torch.cat([zero, (ws * xs * xs).cumsum(1)], 1))


def _seg(prefix: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Sum over sorted positions [lo, hi) per row, from a prefix sum [R, K+1]."""
    return prefix.gather(1, hi) - prefix.gather(1, lo)


def _means(sw: torch.Tensor, swx: torch.Tensor, bnd: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Weighted mean of each interval [bnd[:, c], bnd[:, c+1]); ``fallback`` where empty. [R, C]."""
    lo, hi = bnd[:, :-1], bnd[:, 1:]
    wsum = _seg(sw, lo, hi)
    return torch.where(wsum > 0, _seg(swx, lo, hi) / wsum.clamp_min(1e-300), fallback)


def _sse(sw: torch.Tensor, swx: torch.Tensor, swxx: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
         value: torch.Tensor) -> torch.Tensor:
    """Weighted squared error of representing interval [lo, hi) by ``value``."""
    return _seg(swxx, lo, hi) - 2 * value * _seg(swx, lo, hi) + value * value * _seg(sw, lo, hi)


def _split(sw: torch.Tensor, swx: torch.Tensor, swxx: torch.Tensor, bnd: torch.Tensor) -> torch.Tensor:
    """Split every interval of bnd [R, C+1] at its exact weighted 2-means point -> [R, 2C+1].

    Children of cluster c are 2c (left) and 2c+1 (right); a cluster with no interior split point
    (fewer than 2 members) keeps all members in the left child.
    """
    r, nc, k = bnd.shape[0], bnd.shape[1] - 1, sw.shape[1] - 1
    pos = torch.arange(k + 1, device=bnd.device, dtype=torch.int64).expand(r, k + 1).contiguous()
    cl = torch.searchsorted(bnd[:, 1:].contiguous(), pos, right=True).clamp(max=nc - 1)
    lo, hi = bnd.gather(1, cl), bnd.gather(1, cl + 1)
    valid = (pos > lo) & (pos < hi)
    left = _seg(swxx, lo, pos) - _seg(swx, lo, pos) ** 2 / _seg(sw, lo, pos).clamp_min(1e-300)
    right = _seg(swxx, pos, hi) - _seg(swx, pos, hi) ** 2 / _seg(sw, pos, hi).clamp_min(1e-300)
    cost = torch.where(valid, left + right, torch.inf)
    best = torch.full((r, nc), torch.inf, dtype=torch.float64, device=bnd.device)
    best = best.scatter_reduce(1, cl, cost, "amin")
    is_best = valid & (cost <= best.gather(1, cl))
    split = torch.full((r, nc), k + 1, dtype=torch.int64, device=bnd.device)
    split = split.scatter_reduce(1, cl, torch.where(is_best, pos, k + 1), "amin")
    split = torch.where(split > k, bnd[:, 1:], split)
    return torch.cat([torch.stack([bnd[:, :-1], split], 2).flatten(1), bnd[:, -1:]], 1)


def nested_kmeans(x: torch.Tensor, w: torch.Tensor, seed_bits: int = 3, iters: int = 50) -> NestedCodes:
    """Nested weighted k-means codes and LUTs for every row of x [R, K] (float) with weights w [R, K] > 0.

    The seed k-means starts from bisecting splits (so no cluster starts empty while the row has
    enough distinct values) and is refined by Lloyd iterations.
    Raises ``ValueError`` on non-finite inputs, non-positive weights or a seed outside 1..8.
    """
    if not 1 <= seed_bits <= PARENT_BITS:
        raise ValueError(f"seed_bits must be in 1..8, got {seed_bits}")
    if not torch.isfinite(x).all():
        raise ValueError("weights contain NaN or Inf")
    if not (w > 0).all():
        raise ValueError("k-means weights must be positive")
    r, k = x.shape
    xs, order = x.double().sort(dim=1)
    xs = xs.contiguous()
    ws = w.double().gather(1, order)
    sw, swx, swxx = _prefix_sums(xs, ws)
    kk = torch.full((r, 1), k, dtype=torch.int64, device=x.device)
    z = torch.zeros_like(kk)

    # (1) seed: bisecting init, then weighted Lloyd
    bnd = torch.cat([z, kk], 1)
    for _ in range(seed_bits):
        bnd = _split(sw, swx, swxx, bnd)
    cent = _means(sw, swx, bnd, xs.gather(1, bnd[:, :-1].clamp(max=k - 1)))
    for _ in range(iters):
        mids = ((cent[:, :-1] + cent[:, 1:]) / 2).contiguous()
        new = torch.cat([z, torch.searchsorted(xs, mids, right=True), kk], 1).cummax(1).values
        if torch.equal(new, bnd):
            break
        bnd = new
        cent = _means(sw, swx, bnd, cent)
    lut = cent.to(torch.float16).double()
    luts = {seed_bits: lut}

    # (2) nested upscaling: exact weighted 2-means inside every cluster
    for bits in range(seed_bits + 1, PARENT_BITS + 1):
        bnd = _split(sw, swx, swxx, bnd)
        parent = lut.repeat_interleave(2, dim=1)
        mean = _means(sw, swx, bnd, parent).to(torch.float16).double()
        lo, hi = bnd[:, :-1], bnd[:, 1:]
        keep_mean = _sse(sw, swx, swxx, lo, hi, mean) <= _sse(sw, swx, swxx, lo, hi, parent)
        lut = torch.where(keep_mean, mean, parent)
        luts[bits] = lut

    # parent codes: cluster index of every sorted position, scattered back to column order
    pos = torch.arange(k, device=x.device, dtype=torch.int64).expand(r, k).contiguous()
    code_sorted = torch.searchsorted(bnd[:, 1:].contiguous(), pos, right=True)
    codes = torch.empty(r, k, dtype=torch.uint8, device=x.device)
    codes.scatter_(1, order, code_sorted.clamp(max=2**PARENT_BITS - 1).to(torch.uint8))
    return NestedCodes(codes=codes, luts={b: v.to(torch.float16) for b, v in luts.items()})


def split_clusters(x: torch.Tensor, w: torch.Tensor, codes: torch.Tensor, clusters: int,
                   fallback: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One nested level for arbitrary memberships: the exact weighted 2-means inside every cluster.

    x [R, K] float, w [R, K] > 0 (k-means weights), codes [R, K] int64 in [0, clusters): each weight's cluster
    (not necessarily an interval of the sorted row, e.g. after error feedback); fallback [R, clusters] float64:
    the value of a child left without members (its parent's). Returns child codes [R, K] int64 (2c or 2c + 1)
    and the children's weighted means [R, 2 * clusters] float64. Sorting by (cluster, value) makes every
    cluster an interval again, so the same prefix-sum split as ``nested_kmeans`` applies.
    """
    r, k = x.shape
    xd = x.double()
    rank = xd.argsort(1).argsort(1)
    order = (codes * k + rank).argsort(1)
    xs = xd.gather(1, order).contiguous()
    ws = w.double().gather(1, order)
    sw, swx, swxx = _prefix_sums(xs, ws)
    counts = torch.zeros(r, clusters, dtype=torch.int64, device=x.device).scatter_add_(1, codes, torch.ones_like(codes))
    bnd = torch.cat([torch.zeros(r, 1, dtype=torch.int64, device=x.device), counts.cumsum(1)], 1)
    bnd = _split(sw, swx, swxx, bnd)
    means = _means(sw, swx, bnd, fallback.repeat_interleave(2, dim=1))
    pos = torch.arange(k, device=x.device, dtype=torch.int64).expand(r, k).contiguous()
    child_sorted = torch.searchsorted(bnd[:, 1:].contiguous(), pos, right=True).clamp(max=2 * clusters - 1)
    child = torch.empty(r, k, dtype=torch.int64, device=x.device)
    child.scatter_(1, order, child_sorted)
    return child, means
