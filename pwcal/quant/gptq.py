"""Nested error-feedback quantization: GPTQ's column-by-column compensation inside the Any-Precision code tree.

What it does (SPEC section 2, our choice where the paper is silent; see ``docs/quantizer.md``): starting from
the nested k-means of ``kmeans1d`` (its LUTs and its sensitivity weighting), every bitwidth b = seed..8 is
quantized once more with error feedback against the full input Hessian H = X^T X of the block:

1. **codes** (``feedback_codes``): columns are visited in decreasing H[k, k] (GPTQ's act-order); each column's
   weights take the nearest LUT_b value among the codes allowed (any of the 2^seed at the seed level; the two
   children 2c, 2c+1 of the weight's level-(b-1) code above it, so ``code_b = code_8 >> (8 - b)`` still holds),
   and the rounding error is spread over the columns not yet visited through the Cholesky factor of H^-1
   (Frantar et al., GPTQ, ICLR 2023, Algorithm 1, with lazy block updates);
2. **LUT** (``refit_luts``): with the codes fixed, each row's 2^b centroids are the least-squares solution of
   min_c (w - A c)^T H (w - A c) (A: the row's one-hot codes), rounded to fp16;
3. **never worse with more bits**: a row whose full-Hessian error at b exceeds its error at b - 1 takes its
   level-(b-1) values at b (both children of a code get the parent's centroid), so raising a block's bitwidth
   never increases its calibration error, as with the k-means quantizer.

The storage format does not change (nested codes + one LUT per bitwidth): the runtime reads these artifacts as
it reads k-means ones. It does not collect Hessians (``pwcal.stats.hessian_full``) or pack planes.
"""

from __future__ import annotations

import torch

from pwcal.quant.kmeans1d import PARENT_BITS, NestedCodes, split_clusters


def _inverse_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1 for H [B, K, K] float64 -> [B, K, K].

    Dead input columns (H[k, k] = 0) get H[k, k] = 1 first, as in GPTQ: their weights never see an input.
    """
    h = h.clone()
    diag = h.diagonal(dim1=1, dim2=2)
    diag[diag <= 0] = 1.0
    diag += damp * diag.mean(1, keepdim=True)
    hinv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(hinv, upper=True)


def feedback_codes(w: torch.Tensor, h: torch.Tensor, lut: torch.Tensor, parent: torch.Tensor | None,
                   damp: float = 0.01, block: int = 128) -> torch.Tensor:
    """Codes [B, R, K] int64 of weights w [B, R, K] float64 at one bitwidth, with GPTQ error feedback.

    h [B, K, K] float64: each block's input Hessian; lut [B, R, C] float64: the bitwidth's centroids;
    ``parent`` [B, R, K] int64: the codes one bitwidth lower (each weight then picks one of its two children,
    C = 2 x the parent's), or None at the seed level (any of the C codes). ``damp``: the ridge added to H as a
    fraction of its mean diagonal; ``block``: columns per lazy update. Raises ``torch.linalg.LinAlgError`` only
    if the damped H is not positive definite (it is for any damp > 0).
    """
    nb, r, k = w.shape
    perm = torch.argsort(h.diagonal(dim1=1, dim2=2), dim=1, descending=True)  # [B, K]
    hp = h.gather(1, perm[:, :, None].expand(nb, k, k)).gather(2, perm[:, None, :].expand(nb, k, k))
    u = _inverse_factor(hp, damp)
    wp = w.gather(2, perm[:, None, :].expand(nb, r, k)).clone()
    par = None if parent is None else parent.gather(2, perm[:, None, :].expand(nb, r, k))
    codes = torch.empty(nb, r, k, dtype=torch.int64, device=w.device)
    for lo in range(0, k, block):
        hi = min(lo + block, k)
        errs = torch.zeros(nb, r, hi - lo, dtype=w.dtype, device=w.device)
        for j in range(lo, hi):
            col = wp[:, :, j]  # [B, R]
            if par is None:
                c = (col[:, :, None] - lut).abs().argmin(2)
            else:
                c0 = 2 * par[:, :, j]
                v0 = lut.gather(2, c0[:, :, None])[:, :, 0]
                v1 = lut.gather(2, (c0 + 1)[:, :, None])[:, :, 0]
                c = torch.where((col - v1).abs() < (col - v0).abs(), c0 + 1, c0)
            codes[:, :, j] = c
            e = (col - lut.gather(2, c[:, :, None])[:, :, 0]) / u[:, j, j, None]
            wp[:, :, j:hi] -= e[:, :, None] * u[:, None, j, j:hi]
            errs[:, :, j - lo] = e
        wp[:, :, hi:] -= errs @ u[:, lo:hi, hi:]
    out = torch.empty_like(codes)
    out.scatter_(2, perm[:, None, :].expand(nb, r, k), codes)
    return out


def hessian_errors(w: torch.Tensor, h: torch.Tensor, lut: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Per-row full-Hessian error (w - q) H (w - q)^T [B, R] float64 of q = lut[codes] (shapes as above)."""
    d = w - lut.gather(2, codes)
    return ((d @ h) * d).sum(2)


def refit_luts(w: torch.Tensor, h: torch.Tensor, codes: torch.Tensor, lut: torch.Tensor,
               max_elements: int = 1 << 25) -> torch.Tensor:
    """Least-squares centroids [B, R, C] (fp16-representable float64) for fixed codes [B, R, K] (step 2 above).

    Per row: G = A^T H A [C, C] and A^T H w [C] are built by scatter-adds (O(K^2 + C K) per row, not O(C K^2)),
    solved with a small ridge that pulls unused or degenerate centroids to their old value ``lut``; a row keeps
    ``lut`` where the fp16-rounded solution is not better. ``max_elements`` bounds the [rows, C, K] scratch.
    """
    nb, r, k = w.shape
    c = lut.shape[2]
    out = lut.clone()
    rows = max(1, max_elements // (c * k))
    for b in range(nb):
        for lo in range(0, r, rows):
            hi = min(lo + rows, r)
            code = codes[b, lo:hi]  # [n, K]
            n = hi - lo
            m = torch.zeros(n, c, k, dtype=w.dtype, device=w.device)  # m[i] = A_i^T H
            m.scatter_add_(1, code[:, :, None].expand(n, k, k), h[b][None].expand(n, k, k))
            g = torch.zeros(n, c, c, dtype=w.dtype, device=w.device)
            g.scatter_add_(2, code[:, None, :].expand(n, c, k), m)
            rhs = (m @ w[b, lo:hi, :, None])[:, :, 0]
            old = lut[b, lo:hi]
            lam = 1e-6 * h[b].diagonal().mean() + 1e-4 * g.diagonal(dim1=1, dim2=2).mean(1, keepdim=True)
            g = g + lam[:, :, None] * torch.eye(c, dtype=w.dtype, device=w.device)
            chol, info = torch.linalg.cholesky_ex(g)  # SPD: A^T H A + ridge; LU only if rounding broke that
            sol = (torch.cholesky_solve((rhs + lam * old)[:, :, None], chol)[:, :, 0] if not bool(info.any())
                   else torch.linalg.solve(g, rhs + lam * old))
            new = sol.to(torch.float16).double()
            sub = (slice(b, b + 1), slice(lo, hi))
            better = hessian_errors(w[sub], h[b:b + 1], new[None], code[None]) <= \
                hessian_errors(w[sub], h[b:b + 1], old[None], code[None])
            out[b, lo:hi] = torch.where(better[0, :, None], new, old)
    return out


def _best_of(w: torch.Tensor, h: torch.Tensor, lut0: torch.Tensor, plain: torch.Tensor, parent: torch.Tensor | None,
             damp: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LUT [B, R, C], codes [B, R, K] and error [B, R] of one bitwidth: per row the better of error feedback and
    the plain split ``plain`` (rows are independent), each with its least-squares LUT."""
    codes = feedback_codes(w, h, lut0, parent, damp)
    lut = refit_luts(w, h, codes, lut0)
    err = hessian_errors(w, h, lut, codes)
    plain_lut = refit_luts(w, h, plain, lut0)
    plain_err = hessian_errors(w, h, plain_lut, plain)
    take = plain_err < err
    return (torch.where(take[:, :, None], plain_lut, lut), torch.where(take[:, :, None], plain, codes),
            torch.where(take, plain_err, err))


def nested_gptq(w: torch.Tensor, h: torch.Tensor, init: NestedCodes, kmeans_weights: torch.Tensor, seed_bits: int,
                damp: float = 0.01, max_feedback_bits: int = PARENT_BITS) -> NestedCodes:
    """Error-feedback nested codes and LUTs for B blocks: w [B, R, K] float, h [B, K, K] float64.

    ``init``: the nested k-means of the same B * R rows (``kmeans1d.nested_kmeans``), whose seed LUT and codes
    start the tree; ``kmeans_weights`` [B * R, K] > 0: the weights that k-means used, which the splits of the higher
    bitwidths use too. Bitwidths above ``max_feedback_bits`` take the weighted 2-means split of the memberships
    below them only (no feedback, no refit: the refit's cost grows with 2^b). Returns codes [B * R, K] uint8 and
    luts {b: [B * R, 2^b] float16} like ``nested_kmeans``, with per-row full-Hessian error non-increasing in b.
    Raises ``ValueError`` for mismatched shapes.
    """
    nb, r, k = w.shape
    if h.shape != (nb, k, k) or init.codes.shape != (nb * r, k) or kmeans_weights.shape != (nb * r, k):
        raise ValueError(f"shapes do not match: w {tuple(w.shape)}, h {tuple(h.shape)}, "
                         f"init codes {tuple(init.codes.shape)}")
    w = w.double()
    h = h.double()
    parent: torch.Tensor | None = None
    prev_err: torch.Tensor | None = None
    luts: dict[int, torch.Tensor] = {}
    for bits in range(seed_bits, PARENT_BITS + 1):
        if parent is None:
            lut0 = init.luts[bits].double().view(nb, r, 2**bits)
            plain = (init.codes.long() >> (PARENT_BITS - bits)).view(nb, r, k)
        else:  # split the clusters as error feedback left them, not as the k-means cut the sorted row
            child, means = split_clusters(w.reshape(nb * r, k), kmeans_weights, parent.reshape(nb * r, k),
                                          2**(bits - 1), luts[bits - 1])
            lut0 = means.to(torch.float16).double().view(nb, r, 2**bits)
            plain = child.view(nb, r, k)
        if bits > max_feedback_bits:
            lut, codes = lut0, plain
            err = hessian_errors(w, h, lut, codes)
        else:
            lut, codes, err = _best_of(w, h, lut0, plain, parent, damp)
        if prev_err is not None:
            worse = err > prev_err  # [B, R]: inherit the parent's centroids (and so its error)
            inherited = luts[bits - 1].view(nb, r, -1).repeat_interleave(2, dim=2)
            lut = torch.where(worse[:, :, None], inherited, lut)
            err = torch.where(worse, prev_err, err)
        luts[bits] = lut.reshape(nb * r, -1)
        parent, prev_err = codes, err
    assert parent is not None
    return NestedCodes(codes=parent.reshape(nb * r, k).to(torch.uint8),
                       luts={b: v.to(torch.float16) for b, v in luts.items()})
