"""Layouts and glue of the word-first decode path (``pwkernels.moe.decode``; SPEC section 7).

What it holds: the word-major activation layout the decode kernels read (``word_major``, ``padded_words``) and the
one-launch sum of their fp32 partial outputs over split-K parts and top-k slots, of one or two expert sets, rounded
once to the activations' dtype (``combine``: the weighted accumulation of SPEC section 7 for routed + shared
experts). The reference twin of ``combine`` is ``a.sum((0, 2)) + b.sum((0, 2))`` cast once (tests compare them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pwkernels.rounding import round_to


def padded_words(k: int, bkw: int, split: int = 1) -> int:
    """Words of a word-major activation row for K = k columns read in K steps of ``bkw`` words by ``split``
    split-K programs: ceil(k / 32) rounded up so that no step reads past the row. Raises ``ValueError`` unless
    bkw and split are >= 1."""
    if bkw < 1 or split < 1:
        raise ValueError(f"words per K step and split-K parts must be >= 1, got {bkw}, {split}")
    steps = triton.cdiv(triton.cdiv(k, 32), bkw)
    return triton.cdiv(steps, split) * split * bkw


def word_major(x: torch.Tensor, words: int | None = None) -> torch.Tensor:
    """x [T, K] -> [T, 32, W] (same dtype, zero-padded; W = ``words``, default ceil(K / 32)): column 32 w + i at
    [t, i, w], the order in which the word-first kernels' lanes (one plane word each) read activations.
    Raises ``ValueError`` if ``words`` < ceil(K / 32)."""
    t, kdim = x.shape
    kw = triton.cdiv(kdim, 32) if words is None else words
    if 32 * kw < kdim:
        raise ValueError(f"{words} words hold {32 * kw} columns, fewer than K = {kdim}")
    if 32 * kw > kdim:
        x = torch.nn.functional.pad(x, (0, 32 * kw - kdim))
    return x.reshape(t, kw, 32).transpose(1, 2).contiguous()


@triton.jit
def _combine_kernel(
    a_ptr,  # [SA, T, KA, H] fp32 partial outputs (split-K part s, token t, slot j), contiguous
    b_ptr,  # [SB, T, KB, H] fp32 second set (unused when not HAS_B), contiguous
    y_ptr,  # [T, H] out, the activations' dtype
    T,  # tokens
    H,  # columns
    SA,  # split-K parts of a
    KA,  # top-k slots of a
    SB,  # split-K parts of b
    KB,  # top-k slots of b
    HAS_B: tl.constexpr,  # add the second set
    BLOCK: tl.constexpr,  # columns per program
):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SA):
        for j in range(KA):
            acc += tl.load(a_ptr + ((s * T + t) * KA + j).to(tl.int64) * H + c, mask=m, other=0.0)
    if HAS_B:
        for s in range(SB):
            for j in range(KB):
                acc += tl.load(b_ptr + ((s * T + t) * KB + j).to(tl.int64) * H + c, mask=m, other=0.0)
    tl.store(y_ptr + t * H + c, round_to(acc, y_ptr.dtype.element_ty), mask=m)  # nearest-even, interpreter too


def combine(a: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """y [T, H] in ``dtype`` = a [SA, T, KA, H].sum((0, 2)) (+ b [SB, T, KB, H].sum((0, 2))): fp32 partials (split-K
    part, token, top-k slot) summed in fp32 and rounded once, in one launch (instead of a reduction, a cast and an
    add per set); the weighted accumulation of SPEC section 7. Non-contiguous partials are copied first. Raises
    ``ValueError`` if a or b is not 4-D fp32 or they differ in T or H."""
    for name, v in (("a", a), ("b", b)):
        if v is not None and (v.dim() != 4 or v.dtype != torch.float32):
            raise ValueError(f"{name} must be fp32 partials [S, T, K, H], got {v.dtype} {tuple(v.shape)}")
    a = a.contiguous()
    b = b.contiguous() if b is not None else None
    sa, t, ka, h = a.shape
    y = torch.empty(t, h, dtype=dtype, device=a.device)
    sb, kb = (b.shape[0], b.shape[2]) if b is not None else (0, 0)
    if b is not None and (b.shape[1] != t or b.shape[3] != h):
        raise ValueError(f"partials of one block must agree in T and H: {tuple(a.shape)} vs {tuple(b.shape)}")
    if t and h:
        block = min(1024, triton.next_power_of_2(h))
        _combine_kernel[(t, triton.cdiv(h, block))](a, b if b is not None else a, y, t, h, sa, ka, sb, kb,
                                                    HAS_B=b is not None, BLOCK=block)
    return y
