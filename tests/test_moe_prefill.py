"""The AP MoE prefill path's elementwise kernels (``pwkernels.moe.prefill``) against their references, and the
references against the eager math they replace (interpreter on CPU, native on GPU): odd widths, empty inputs,
bf16 / fp16, k = 1..8, pairs in a random sorted order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _moe_cases import DEV, make

from pwformat.ap import dequantize
from pwkernels.moe.dispatch import ap_moe
from pwkernels.moe.prefill import dequant_blocks, gather_sum, gather_sum_ref, silu_mul, silu_mul_ref
from pwkernels.moe.ref import ap_moe_ref


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


@pytest.mark.parametrize(("m", "p"), [(1, 1), (37, 50), (5, 5)])
def test_silu_mul_gathers_its_scale_through_an_index(m: int, p: int) -> None:
    """``index``: row m's scale is scale[index[m]] (the routing weight of pair ``order[m]``), exactly the scale
    gathered first; bad index or scale refused."""
    g = torch.Generator().manual_seed(m + p)
    h = (3 * torch.randn(m, 2 * 24, generator=g)).to(torch.bfloat16).to(DEV)
    scale = torch.rand(p, generator=g).to(DEV)
    index = torch.randint(0, p, (m,), generator=g).to(torch.int32).to(DEV)
    assert torch.equal(silu_mul(h, scale, index=index), silu_mul(h, scale[index.long()].contiguous()))
    _close(silu_mul(h, scale, index=index), silu_mul_ref(h, scale[index.long()]))
    for bad_scale, bad_index in ((None, index), (scale.double(), index), (scale, index.long()), (scale, index[:-1])):
        with pytest.raises(ValueError):
            silu_mul(h, bad_scale, index=bad_index)


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_dequant_path_matches_reference(dtype: torch.dtype) -> None:
    ex = make(5, 72, 40, torch.randint(2, 9, (10,)).tolist(), dtype, 21)
    g = torch.Generator().manual_seed(22)
    x = torch.randn(20, 72, generator=g).to(dtype).to(DEV)
    ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(20)]).to(DEV)
    w = torch.rand(20, 2, generator=g).to(DEV)
    cfg = {"path": "prefill", "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}
    tol = (2**-7 if dtype == torch.bfloat16 else 2**-10) * 4
    # every expert used; then the middle ones only (the first and last experts have no pair: their blocks are
    # skipped and their grouped-GEMM groups empty)
    for route in (ids, torch.stack([torch.randperm(3, generator=g)[:2] + 1 for _ in range(20)]).to(DEV)):
        got = ap_moe(x, route, w, ex, config=cfg).float()
        ref = ap_moe_ref(x, route, w, ex).float()
        assert (got - ref).abs().max() <= tol * ref.abs().max()


def test_dequant_blocks_match_reference_dequantization() -> None:
    ex = make(3, 100, 36, [2, 5, 8, 3, 4, 6], torch.bfloat16, 4)
    got = dequant_blocks(ex, torch.tensor([2, 0, 4], device=DEV), "gate_up", torch.bfloat16)
    for j, b in enumerate([2, 0, 4]):
        planes, lut, _, k = ex.block(b)
        assert torch.equal(got[j], dequantize(planes, lut, k, planes.shape[0], torch.bfloat16))
    # ends: blocks whose expert has pairs (its cumulative count grows) are written as without
    blocks = torch.tensor([0, 2, 4], device=DEV)
    full = dequant_blocks(ex, blocks, "gate_up", torch.bfloat16)
    for ends, live in (([0, 3, 3], [1]), ([2, 2, 5], [0, 2])):
        got = dequant_blocks(ex, blocks, "gate_up", torch.bfloat16, torch.tensor(ends, dtype=torch.int32, device=DEV))
        assert all(torch.equal(got[j], full[j]) for j in live)
    with pytest.raises(ValueError, match="ends must be int32"):
        dequant_blocks(ex, blocks, "gate_up", torch.bfloat16, torch.tensor([1, 2, 3], device=DEV))



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shared_expert_prefill_path(dtype: torch.dtype) -> None:
    """The prefill (dequant) path of one expert at k = 1 (a shared expert: no sorting, two plain GEMMs) against the
    reference, with a gate weight per token, and against the grouped path of the same expert among others."""
    ex = make(1, 72, 104, [5, 3], dtype, 31)
    g = torch.Generator().manual_seed(32)
    x = torch.randn(40, 72, generator=g).to(dtype).to(DEV)
    gate = torch.rand(40, 1, generator=g).to(DEV)
    ids = torch.zeros(40, 1, dtype=torch.int64, device=DEV)
    cfg = {"path": "prefill", "BLOCK_N": 16, "BLOCK_K": 64}
    got = ap_moe(x, ids, gate, ex, config=cfg).float()
    ref = ap_moe_ref(x, ids, gate, ex).float()
    tol = (2**-7 if dtype == torch.bfloat16 else 2**-10) * 4
    assert (got - ref).abs().max() <= tol * ref.abs().max()
    assert got[gate[:, 0] > 0.5].abs().sum() > 0  # rows are written, scaled by their own gate
    wide = make(2, 72, 104, [5, 3, 4, 4], dtype, 31)  # same seed: expert 0 as above, and a second expert
    for b in (0, 1):
        assert all(torch.equal(u, v) for u, v in zip(wide.block(b)[:2], ex.block(b)[:2], strict=True))
    grouped = ap_moe(x, ids, gate, wide, config=cfg).float()  # the grouped path: the same sums (GEMM order aside)
    assert (got - grouped).abs().max() <= 2 * torch.finfo(dtype).eps * grouped.abs().max()
