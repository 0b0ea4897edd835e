"""The AP MoE prefill path's elementwise kernels (``kernels.moe.prefill``) against their references, and the
references against the eager math they replace (interpreter on CPU, native on GPU): odd widths, empty inputs,
bf16 / fp16, k = 1..8, pairs in a random sorted order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.moe.prefill import gather_sum, gather_sum_ref, silu_mul, silu_mul_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """At most one rounding step of the output dtype apart (fp32 SiLU may differ from torch's in the last bit)."""
    eps = torch.finfo(got.dtype).eps
    d = (got.float() - ref.float()).abs()
    assert bool((d <= eps * ref.float().abs() + 1e-6).all()), float(d.max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "inter"), [(1, 8), (37, 1408 + 8), (5, 96), (0, 16)])
@pytest.mark.parametrize("scaled", [True, False])
def test_silu_mul(dtype: torch.dtype, m: int, inter: int, scaled: bool) -> None:
    g = torch.Generator().manual_seed(m * 7 + inter)
    h = (3 * torch.randn(m, 2 * inter, generator=g)).to(dtype).to(DEV)
    scale = torch.rand(m, generator=g).to(DEV) if scaled else None
    got = silu_mul(h, scale)
    ref = silu_mul_ref(h, scale)
    assert got.shape == (m, inter) and got.dtype == dtype
    _close(got, ref)
    # the reference is the eager math of the per-expert path: SiLU(gate) * up, weighted
    gate, up = h.double().chunk(2, dim=-1)
    eager = F.silu(gate) * up * (1.0 if scale is None else scale.double()[:, None])
    assert torch.allclose(ref.double(), eager, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "k", "hidden"), [(1, 1, 8), (9, 2, 72), (33, 4, 2048 + 8), (5, 8, 96), (0, 4, 16)])
def test_gather_sum(dtype: torch.dtype, t: int, k: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(t * 13 + k)
    y = torch.randn(t * k, hidden, generator=g).to(dtype).to(DEV)
    order = torch.randperm(t * k, generator=g)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(t * k)
    pos = pos.view(t, k).to(DEV)
    got = gather_sum(y, pos)
    ref = gather_sum_ref(y, pos)
    assert got.shape == (t, hidden) and got.dtype == dtype
    assert torch.equal(got, ref)  # same fp32 sum in slot order, rounded once to nearest even
    eager = torch.stack([y[pos[:, j]].double() for j in range(k)]).sum(0) if t else torch.zeros(0, hidden).double()
    assert torch.allclose(ref.double().cpu(), eager.cpu(), rtol=torch.finfo(dtype).eps, atol=1e-6)


def test_bad_input_is_refused() -> None:
    h = torch.randn(4, 10, device=DEV)
    with pytest.raises(ValueError, match="2I"):
        silu_mul(h[:, :9].contiguous())
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul(h.t())
    with pytest.raises(ValueError, match="scale must be"):
        silu_mul(h, torch.ones(3, device=DEV))
    with pytest.raises(ValueError, match="pos must be"):
        gather_sum(h, torch.zeros(2, 2, device=DEV))
