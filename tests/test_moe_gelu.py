"""GeGLU experts (GELU-tanh gate, Gemma-4) on every AP MoE path against ``ap_moe_ref`` at tiny odd shapes, in
Triton's interpreter on the CPU: decode (token slots and sorted slots), mid, prefill, the routed + shared block,
and the prefill path's activation kernel. The SiLU reference differs from the GELU one by far more than the
tolerance, so a kernel that ignored the flag would fail."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pwkernels.moe.activation import gate_act_ref
from pwkernels.moe.dispatch import ap_moe_block
from pwkernels.moe.prefill import silu_mul, silu_mul_ref
from pwkernels.moe.ref import ap_moe_ref
from tests._moe_cases import BF, DEV, PATHS, check, make


@pytest.mark.parametrize("path", sorted(PATHS))
def test_each_path_gelu_tanh(path: str) -> None:
    bits = [3, 8, 4, 5, 6, 7, 3, 5, 8, 4]  # 5 experts x (gate_up, down)
    check(3, 2, 5, 40, 24, bits, BF, seed=11, config=PATHS[path], activation="gelu_tanh")


def test_gelu_reference_is_not_silu() -> None:
    ex = make(4, 64, 32, [8] * 8, BF, seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, generator=g).to(BF).to(DEV)
    ids, w = torch.tensor([[0, 1], [2, 3], [1, 2]], device=DEV), torch.ones(3, 2, device=DEV)
    silu, gelu = ap_moe_ref(x, ids, w, ex).float(), ap_moe_ref(x, ids, w, ex, "gelu_tanh").float()
    assert (silu - gelu).abs().max() > 0.1 * gelu.abs().max()
    z = torch.linspace(-9, 9, 101)
    assert torch.allclose(gate_act_ref(z, "gelu_tanh"), F.gelu(z, approximate="tanh"))
    with pytest.raises(ValueError, match="activation"):
        gate_act_ref(z, "relu")


@pytest.mark.parametrize("scaled", [False, True])
def test_gelu_mul_kernel(scaled: bool) -> None:
    g = torch.Generator().manual_seed(5)
    h = (torch.randn(7, 2 * 33, generator=g) * 4).to(BF).to(DEV)
    scale = torch.rand(7, generator=g).to(DEV) if scaled else None
    got, want = silu_mul(h, scale, "gelu_tanh").float(), silu_mul_ref(h, scale, "gelu_tanh").float()
    assert (got - want).abs().max() <= 2**-7 * 2 * want.abs().max()


def test_routed_and_shared_block_gelu() -> None:
    ex, shared = make(4, 40, 24, [4, 5, 6, 7, 8, 3, 4, 5], BF, seed=7), make(1, 40, 16, [6, 5], BF, seed=8)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 40, generator=g).to(BF).to(DEV)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(3)]).to(DEV)
    w, sw = torch.rand(3, 2, generator=g).to(DEV), torch.rand(3, 1, generator=g).to(DEV)
    got = ap_moe_block(x, ids, w, ex, shared, sw, activation="gelu_tanh").float()
    want = (ap_moe_ref(x, ids, w, ex, "gelu_tanh").float()
            + ap_moe_ref(x, torch.zeros(3, 1, dtype=torch.int64, device=DEV), sw, shared, "gelu_tanh").float())
    assert (got - want).abs().max() <= 2**-7 * 4 * want.abs().max()
