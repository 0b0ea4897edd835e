"""``pwkernels.act_mul`` (the gated MLP's activation and product in one launch) against its eager twin."""

from __future__ import annotations

import os

import pytest
import torch

from pwkernels.act_mul import act_mul, act_mul_ref

needs_triton = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                  reason="needs CUDA or Triton's interpreter (TRITON_INTERPRET=1)")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal for most elements (over 85%), the others within two units in the last place of the 16-bit result (the
    kernel's activation is the same function in another fp32 formula; act(gate) and the product are rounded
    apart) or, where the activation all but vanishes, within 1e-5 of the largest output."""
    assert got.shape == ref.shape and got.dtype == ref.dtype
    g, r = got.float(), ref.float()
    ulp = r.abs() * (2.0 ** -7 if ref.dtype == torch.bfloat16 else 2.0 ** -10)
    tol = 2 * ulp + 1e-5 * float(r.abs().max())
    assert bool(((g - r).abs() <= tol).all()), float(((g - r).abs() - tol).max())
    assert float((g == r).float().mean()) > 0.85


@needs_triton
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "inter"), [(1, 16), (3, 100), (17, 1100)])
def test_act_mul_equals_the_eager_ops(t: int, inter: int, dtype: torch.dtype, activation: str) -> None:
    g = torch.Generator().manual_seed(t * 1000 + inter)
    gate_up = (torch.randn(t, 2 * inter, generator=g) * 3).to(dtype).to(DEV)
    _close(act_mul(gate_up, activation), act_mul_ref(gate_up, activation))


@needs_triton
def test_act_mul_reads_rows_at_their_stride() -> None:
    """A gate_up whose rows lie further apart than 2I (a view of a wider buffer) is read at its stride."""
    wide = (torch.randn(5, 2 * 40 + 8, generator=torch.Generator().manual_seed(7)) * 2).to(torch.bfloat16).to(DEV)
    view = wide[:, :80]
    assert view.stride(0) == 88
    _close(act_mul(view, "gelu_tanh"), act_mul_ref(view, "gelu_tanh"))


def test_act_mul_falls_back_and_refuses_an_unknown_activation() -> None:
    x = torch.randn(3, 8)  # fp32: the eager ops
    assert torch.equal(act_mul(x, "silu"), act_mul_ref(x, "silu"))
    with pytest.raises(ValueError, match="activation"):
        act_mul(x.to(torch.bfloat16), "relu")
