"""The variable-length paged attention kernel against its reference twin, and the twin against dense causal SDPA.

Ragged steps: prompt chunks of many lengths beside decodes, contexts that end mid-page, page tables whose pages
are scattered over the pool with unused entries holding stray page ids; GQA and MHA; a sliding window.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pwkernels.varlen_attention import varlen_paged_attention, varlen_paged_attention_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: tests/conftest.py sets TRITON_INTERPRET


def _i32(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=DEV)


def _step(chunks: list[tuple[int, int]], hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype, seed: int,
          device: str = DEV):
    """Random step: chunks are (context length, new tokens) per sequence; returns the kernel's inputs plus the
    contiguous K/V of every sequence."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-ctx // bs) for ctx, _ in chunks]
    width = max(nbs) + 2
    pages = 2 * sum(nbs) + 7
    k_pages = torch.randn(pages, bs, hkv, d, generator=g).to(dtype)
    v_pages = torch.randn(pages, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(pages, generator=g)
    kt = torch.randint(0, pages, (len(chunks), width), generator=g, dtype=torch.int32)  # stray ids past the end
    vt = torch.randint(0, pages, (len(chunks), width), generator=g, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(nbs):
        kt[s, :nb] = perm[used: used + nb].int()
        vt[s, :nb] = perm[used + nb: used + 2 * nb].int()
        used += 2 * nb
    qs = [0]
    for _, n in chunks:
        qs.append(qs[-1] + n)
    q = torch.randn(qs[-1], hq, d, generator=g).to(dtype)
    ctx = [c for c, _ in chunks]
    dev = torch.device(device)
    return (q.to(dev), k_pages.to(dev), v_pages.to(dev), kt.to(dev), vt.to(dev), qs, ctx)


CASES = [
    # (chunks (ctx, new), hq, hkv, d, block_size)
    ([(37, 37), (5, 1), (70, 23), (16, 1), (129, 64)], 4, 2, 32, 16),  # prompts, chunks, decodes; GQA
    ([(1, 1), (200, 1), (90, 90)], 2, 2, 64, 8),  # MHA; a 1-token prompt
    ([(33, 17), (64, 64), (3, 2)], 6, 2, 16, 32),  # pages wider than a key tile; 3 query heads per kv head
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("window", [0, 24])
def test_kernel_matches_reference_on_ragged_steps(case: int, window: int) -> None:
    chunks, hq, hkv, d, bs = CASES[case]
    dtype = torch.bfloat16
    q, kp, vp, kt, vt, qs, ctx = _step(chunks, hq, hkv, d, bs, dtype, seed=case)
    scale = d ** -0.5
    ref = varlen_paged_attention_ref(q, kp, vp, kt, vt, qs, ctx, scale, window)
    out = varlen_paged_attention(q, kp, vp, kt, vt, _i32(qs), _i32(ctx), max(n for _, n in chunks), scale, window)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_reference_equals_dense_causal_attention() -> None:
    """The twin itself: a whole prompt (n == ctx) through scattered pages equals SDPA's causal attention on the
    contiguous K/V, and a chunk's rows equal the same rows of the whole-prompt attention."""
    hq, hkv, d, bs = 4, 2, 32, 8
    q, kp, vp, kt, vt, qs, ctx = _step([(45, 45)], hq, hkv, d, bs, torch.float32, seed=3, device="cpu")
    nb = -(-45 // bs)
    k = kp[kt[0, :nb].long()].flatten(0, 1)[:45].repeat_interleave(2, dim=1)
    v = vp[vt[0, :nb].long()].flatten(0, 1)[:45].repeat_interleave(2, dim=1)
    dense = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           is_causal=True, scale=d ** -0.5).transpose(0, 1)
    whole = varlen_paged_attention_ref(q, kp, vp, kt, vt, qs, ctx, d ** -0.5)
    torch.testing.assert_close(whole, dense, atol=1e-5, rtol=1e-5)
    tail = varlen_paged_attention_ref(q[30:], kp, vp, kt, vt, [0, 15], [45], d ** -0.5)
    torch.testing.assert_close(tail, dense[30:], atol=1e-5, rtol=1e-5)


def test_window_sees_only_the_last_positions() -> None:
    """With a window, changing a key older than the window leaves the output unchanged; one inside changes it."""
    q, kp, vp, kt, vt, qs, ctx = _step([(40, 1)], 2, 2, 16, 8, torch.bfloat16, seed=5)
    args = (_i32(qs), _i32(ctx), 1, 0.25, 8)
    base = varlen_paged_attention(q, kp, vp, kt, vt, *args)
    old = kp.clone()
    old[kt[0, 0].long(), 3] += 5.0  # position 3: outside the last 8 of 40
    torch.testing.assert_close(varlen_paged_attention(q, old, vp, kt, vt, *args), base)
    near = kp.clone()
    near[kt[0, 4].long(), 3] += 5.0  # position 35: inside
    assert not torch.allclose(varlen_paged_attention(q, near, vp, kt, vt, *args), base)


def test_bad_inputs_are_refused() -> None:
    q, kp, vp, kt, vt, qs, ctx = _step([(9, 9)], 2, 2, 16, 8, torch.bfloat16, seed=1)
    good = (_i32(qs), _i32(ctx), 9, 0.25)
    with pytest.raises(ValueError, match="int32"):
        varlen_paged_attention(q, kp, vp, kt.long(), vt, *good)
    with pytest.raises(ValueError, match="query_start"):
        varlen_paged_attention(q, kp, vp, kt, vt, _i32([0]), *good[1:])
    with pytest.raises(ValueError, match="multiple"):
        varlen_paged_attention(q[:, :1].expand(-1, 3, -1).contiguous(), kp, vp, kt, vt, *good)


def test_window_never_reads_pages_before_it() -> None:
    """Pages wholly before the window of a chunk's first query may already have gone back to the pool (sliding-window
    layers give them back): NaN-poisoned there, the kernel's output stays finite and equals the reference's."""
    chunks, hq, hkv, d, bs, window = [(70, 23), (40, 1), (129, 64), (9, 9)], 4, 2, 32, 8, 12
    q, kp, vp, kt, vt, qs, ctx = _step(chunks, hq, hkv, d, bs, torch.bfloat16, seed=7)
    ref = varlen_paged_attention_ref(q, kp, vp, kt, vt, qs, ctx, d ** -0.5, window)
    for s, (c, n) in enumerate(chunks):
        for j in range(max(c - n - window + 1, 0) // bs):
            kp[kt[s, j].long()], vp[vt[s, j].long()] = float("nan"), float("nan")
    out = varlen_paged_attention(q, kp, vp, kt, vt, _i32(qs), _i32(ctx), max(n for _, n in chunks), d ** -0.5,
                                 window)
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
