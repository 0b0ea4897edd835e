"""The reference attention's causal masking without a mask tensor (``pwrun.model.attention._causal_attention``)
against attention written out with an explicit [n, ctx] mask: whole prompts, one token, chunks of a longer
context, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from pwrun.model.attention import _causal_attention


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    n, ctx = q.shape[0], k.shape[0]
    s = torch.einsum("nhd,chd->hnc", q.double(), k.double()) * scale
    qpos = torch.arange(ctx - n, ctx)
    s = s.masked_fill(torch.arange(ctx)[None, None, :] > qpos[None, :, None], float("-inf"))
    return torch.einsum("hnc,chd->hnd", s.softmax(-1), v.double())


@pytest.mark.parametrize(("n", "ctx"), [(1, 1), (1, 9), (7, 7), (3, 10), (5, 6), (16, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_attention_matches_explicit_mask(n: int, ctx: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n * 100 + ctx)
    q, k, v = (torch.randn(m, 3, 8, generator=g).to(dtype) for m in (n, ctx, ctx))
    got = _causal_attention(q, k, v, 8**-0.5)
    assert got.shape == (3, n, 8) and got.dtype == dtype
    ref = _explicit(q, k, v, 8**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.double() - ref).abs().max().item() <= tol
    # the last query sees every key: a masked-out key would change it
    assert not torch.allclose(got[:, -1].double(), _explicit(q, k[:-1], v[:-1], 8**-0.5)[:, -1], atol=1e-3)


@pytest.mark.parametrize(("n", "ctx"), [(1, 9), (7, 7), (3, 10)])
def test_causal_attention_calls_sdpa_with_4d_inputs(n: int, ctx: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """SDPA's flash and memory-efficient backends take only 4-D inputs; 3-D ones silently take the math backend,
    which on CUDA upcasts to fp32 and materialises the scores."""
    import torch.nn.functional as F

    seen: list[tuple[int, ...]] = []
    real = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *a: object, **kw: object) -> torch.Tensor:
        seen.extend([tuple(q.shape), tuple(k.shape), tuple(v.shape)])
        return real(q, k, v, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k, v = (torch.randn(m, 2, 4) for m in (n, ctx, ctx))
    assert _causal_attention(q, k, v, 0.5).shape == (2, n, 4)
    assert seen == [(1, 2, n, 4), (1, 2, ctx, 4), (1, 2, ctx, 4)]
