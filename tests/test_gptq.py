"""Nested error-feedback quantization (pwcal.quant.gptq) against slow references, on random and ragged shapes."""

from __future__ import annotations

import pytest
import torch

from pwcal.quant.gptq import feedback_codes, hessian_errors, nested_gptq, refit_luts
from pwcal.quant.kmeans1d import nested_kmeans, split_clusters


def correlated_hessian(k: int, tokens: int = 2048, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g, dtype=torch.float64) * 0.3 + torch.eye(k, dtype=torch.float64)
    x = torch.randn(tokens, k, generator=g, dtype=torch.float64) @ mix * (torch.rand(k, generator=g) * 3 + 0.1)
    return x.T @ x


def gptq_ref(w: torch.Tensor, h: torch.Tensor, lut: torch.Tensor, parent: torch.Tensor | None,
             damp: float) -> torch.Tensor:
    """GPTQ's Algorithm 1 without lazy blocks, one row at a time, explicit H^-1 updates (Frantar et al.)."""
    r, k = w.shape
    hd = h.clone()
    hd.diagonal()[hd.diagonal() <= 0] = 1.0
    hd += damp * hd.diagonal().mean() * torch.eye(k, dtype=h.dtype)
    perm = torch.argsort(h.diagonal(), descending=True)  # act-order, on the undamped diagonal as the code does
    codes = torch.empty(r, k, dtype=torch.int64)
    for i in range(r):
        wi = w[i, perm].clone()
        hinv = torch.linalg.inv(hd[perm][:, perm])
        for j in range(k):
            allowed = range(lut.shape[1]) if parent is None else (2 * int(parent[i, perm[j]]),
                                                                 2 * int(parent[i, perm[j]]) + 1)
            c = min(allowed, key=lambda a: abs(float(wi[j] - lut[i, a])))
            codes[i, perm[j]] = c
            e = (wi[j] - lut[i, c]) / hinv[j, j]
            wi[j + 1:] -= e * hinv[j, j + 1:]
            hinv = hinv - torch.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]  # remove column j (Schur complement)
    return codes


@pytest.mark.parametrize("r,k,block", [(5, 37, 8), (3, 64, 128), (4, 19, 1)])
def test_feedback_codes_match_the_unblocked_reference(r: int, k: int, block: int) -> None:
    torch.manual_seed(k)
    w = torch.randn(r, k, dtype=torch.float64)
    h = correlated_hessian(k, seed=k)
    lut = torch.sort(torch.randn(r, 8, dtype=torch.float64), dim=1).values
    got = feedback_codes(w[None], h[None], lut[None], None, damp=0.01, block=block)[0]
    assert torch.equal(got, gptq_ref(w, h, lut, None, 0.01))
    parent = got // 2  # any parent codes in range: each weight must pick one of its two children
    lut16 = torch.sort(torch.randn(r, 16, dtype=torch.float64), dim=1).values
    got16 = feedback_codes(w[None], h[None], lut16[None], parent[None], damp=0.01, block=block)[0]
    assert torch.equal(got16 // 2, parent)
    assert torch.equal(got16, gptq_ref(w, h, lut16, parent, 0.01))


def test_diagonal_hessian_means_no_feedback() -> None:
    torch.manual_seed(3)
    w = torch.randn(6, 50, dtype=torch.float64)
    lut = torch.randn(6, 8, dtype=torch.float64)
    h = torch.diag(torch.rand(50, dtype=torch.float64) + 0.5)
    got = feedback_codes(w[None], h[None], lut[None], None)[0]
    assert torch.equal(got, (w[..., None] - lut[:, None, :]).abs().argmin(2))


def test_refit_is_the_least_squares_optimum() -> None:
    torch.manual_seed(4)
    r, k, c = 4, 41, 8
    w = torch.randn(r, k, dtype=torch.float64)
    h = correlated_hessian(k, seed=4)
    codes = torch.randint(0, c - 1, (r, k))  # code c - 1 unused: it must keep its old value
    old = torch.randn(r, c, dtype=torch.float64).half().double()
    new = refit_luts(w[None], h[None], codes[None], old[None], max_elements=2 * c * k)[0]  # 2 rows per chunk
    assert torch.equal(new.half().double(), new)  # fp16-representable
    assert torch.allclose(new[:, c - 1], old[:, c - 1], atol=1e-3)
    for i in range(r):
        a = torch.nn.functional.one_hot(codes[i], c).double()[:, : c - 1]
        lhs, rhs = a.T @ h @ a, a.T @ h @ w[i]
        best = torch.linalg.solve(lhs, rhs)
        assert torch.allclose(new[i, : c - 1], best, rtol=2e-3, atol=2e-3)
    e_new = hessian_errors(w[None], h[None], new[None], codes[None])
    e_old = hessian_errors(w[None], h[None], old[None], codes[None])
    assert (e_new <= e_old).all() and (e_new < 0.9 * e_old).any()


def test_split_clusters_is_the_weighted_two_means_of_each_members_set() -> None:
    torch.manual_seed(5)
    r, k, clusters = 3, 30, 4
    x = torch.randn(r, k, dtype=torch.float64)
    wt = torch.rand(r, k, dtype=torch.float64) + 0.1
    codes = torch.randint(0, clusters, (r, k))  # memberships that are not intervals of the sorted row
    codes[:, 0] = 3
    codes[0, :] = torch.where(codes[0] == 2, 1, codes[0])  # row 0: cluster 2 has no member
    fallback = torch.arange(clusters, dtype=torch.float64).expand(r, clusters) * 10
    child, means = split_clusters(x, wt, codes, clusters, fallback)
    assert torch.equal(child // 2, codes)
    assert means[0, 4] == 20 and means[0, 5] == 20  # an empty cluster's children take its fallback
    for i in range(r):
        for c in range(clusters):
            m = codes[i] == c
            if m.sum() < 2:
                continue
            xs, ws = x[i, m], wt[i, m]
            order = xs.argsort()
            xs, ws = xs[order], ws[order]

            def sse(lo: int, hi: int, xs: torch.Tensor = xs, ws: torch.Tensor = ws) -> float:
                mu = (xs[lo:hi] * ws[lo:hi]).sum() / ws[lo:hi].sum()
                return float(((xs[lo:hi] - mu) ** 2 * ws[lo:hi]).sum())
            best = min(sse(0, t) + sse(t, len(xs)) for t in range(1, len(xs)))
            got = sum(float(((x[i, child[i] == ch] - means[i, ch]) ** 2 * wt[i, child[i] == ch]).sum())
                      for ch in (2 * c, 2 * c + 1))
            assert got <= best + 1e-9


@pytest.mark.parametrize("seed_bits", [2, 3])
def test_nested_gptq_is_nested_never_worse_with_bits_and_beats_kmeans_at_the_seed(seed_bits: int) -> None:
    torch.manual_seed(6)
    nb, r, k = 2, 6, 45
    w = torch.randn(nb, r, k, dtype=torch.float64) * 0.05
    h = torch.stack([correlated_hessian(k, seed=s) for s in (6, 7)])
    kw = torch.cat([h[i].diagonal().expand(r, k) for i in range(nb)])
    init = nested_kmeans(w.reshape(nb * r, k), kw, seed_bits)
    out = nested_gptq(w.float(), h, init, kw, seed_bits)
    assert out.codes.dtype == torch.uint8 and out.codes.shape == (nb * r, k)
    errs, kmeans_errs = [], []
    for b in range(seed_bits, 9):
        assert out.luts[b].dtype == torch.float16 and out.luts[b].shape == (nb * r, 2**b)
        code = (out.codes.long() >> (8 - b)).view(nb, r, k)
        errs.append(hessian_errors(w, h, out.luts[b].double().view(nb, r, -1), code))
        kcode = (init.codes.long() >> (8 - b)).view(nb, r, k)
        kmeans_errs.append(hessian_errors(w, h, init.luts[b].double().view(nb, r, -1), kcode))
    e = torch.stack(errs)
    assert (e[1:] <= e[:-1] * (1 + 1e-12)).all()  # per row, raising the bitwidth never hurts
    assert e[0].sum() < 0.8 * torch.stack(kmeans_errs)[0].sum()  # correlated inputs: feedback pays at the seed


def test_nested_gptq_refuses_mismatched_shapes() -> None:
    w = torch.randn(1, 4, 10)
    init = nested_kmeans(w[0], torch.ones(4, 10), 3)
    with pytest.raises(ValueError, match="shapes do not match"):
        nested_gptq(w, torch.eye(9, dtype=torch.float64)[None], init, torch.ones(4, 10), 3)


def test_layer_groups_fit_the_budget_and_refuse_a_layer_too_big() -> None:
    from pwcal.stats.hessian_full import hessian_bytes, layer_groups
    from pwformat.errors import PagedWeightError
    from pwrun.model.inventory import LinearBlock

    blocks = [LinearBlock(layer, e, unit, 8, k) for layer in (0, 1, 2, 5) for e in (0, 1)
              for unit, k in (("gate_up", 16), ("down", 8))]
    per_layer = hessian_bytes([b for b in blocks if b.layer == 0])
    assert per_layer == 2 * 8 * (16 * 16 + 8 * 8)
    assert layer_groups(blocks, 10**9) == [[0, 1, 2, 5]]
    assert layer_groups(blocks, 2 * per_layer) == [[0, 1], [2, 5]]
    assert layer_groups(blocks, per_layer) == [[0], [1], [2], [5]]
    with pytest.raises(PagedWeightError, match="--hessian-memory"):
        layer_groups(blocks, per_layer - 1)
