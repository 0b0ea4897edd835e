"""Fused AP MoE kernel vs its PyTorch reference (Triton interpreter on CPU, native on GPU).

Fresh random inputs each run; ragged sizes (H, I not multiples of the tiles), experts with no
token, all tokens on one expert, every q in 2..8, a random mix of q in one launch, several top-k,
bf16 and fp16; the output is poisoned first so unwritten rows are caught.
"""

from __future__ import annotations

import pytest
import torch

from kernels.ap_moe import ap_moe, ap_moe_ref, ap_moe_shared, build_experts, dequant_blocks

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make(num_experts: int, hidden: int, inter: int, bits: list[int], dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes, luts = [], []
    for i in range(2 * num_experts):
        n, k = (2 * inter, hidden) if i % 2 == 0 else (hidden, inter)
        codes.append(torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g))
        luts.append({b: (torch.randn(n, 2**b, generator=g) * k**-0.5) for b in range(1, 9)})
    return build_experts(codes, luts, bits, hidden, inter, dtype, DEV, shuffle_seed=seed)


def check(t: int, k: int, e: int, hidden: int, inter: int, bits: list[int], dtype: torch.dtype, seed: int,
          ids: torch.Tensor | None = None) -> None:
    ex = make(e, hidden, inter, bits, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(t, hidden, generator=g).to(dtype).to(DEV)
    if ids is None:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g).to(DEV)
    ids = ids.to(DEV)
    got = ap_moe(x, ids, w, ex).float()
    ref = ap_moe_ref(x, ids, w, ex).float()
    assert torch.isfinite(got).all()
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item() + 1e-6
    # bf16 / fp16 rounding of the output and of the stored intermediate: a few ulps of the output scale
    tol = (2**-7 if dtype == torch.bfloat16 else 2**-10) * 4
    assert err <= tol * scale, f"max err {err:.3e} vs scale {scale:.3e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "k"), [(1, 1), (3, 2), (8, 4), (33, 2), (257, 2)])
def test_random_routing_ragged_shapes(t: int, k: int, dtype: torch.dtype) -> None:
    e = 6
    bits = torch.randint(2, 9, (2 * e,)).tolist()  # a random mix of q in one launch
    check(t, k, e, hidden=96 + 8, inter=40, bits=bits, dtype=dtype, seed=t * 10 + k)


@pytest.mark.parametrize("q", [2, 3, 4, 5, 6, 7, 8])
def test_every_bitwidth(q: int) -> None:
    check(5, 2, 3, hidden=64, inter=48, bits=[q] * 6, dtype=torch.bfloat16, seed=q)


def test_all_tokens_on_one_expert_and_idle_experts() -> None:
    ids = torch.full((17, 1), 2)
    check(17, 1, 4, hidden=72, inter=40, bits=[3, 5, 8, 2, 4, 6, 7, 3], dtype=torch.float16, seed=7, ids=ids)


def test_top8_of_many_experts() -> None:
    check(4, 8, 10, hidden=64, inter=32, bits=torch.randint(2, 9, (20,)).tolist(), dtype=torch.bfloat16, seed=11)


def test_shared_expert_path() -> None:
    ex = make(1, 64, 48, [4, 6], torch.bfloat16, 3)
    x = torch.randn(5, 64).to(torch.bfloat16).to(DEV)
    gate = torch.randn(5, 1).to(DEV)
    got = ap_moe_shared(x, ex, gate).float()
    ids = torch.zeros(5, 1, dtype=torch.int64, device=DEV)
    ref = ap_moe_ref(x, ids, torch.sigmoid(gate), ex).float()
    assert (got - ref).abs().max() <= 4 * 2**-7 * ref.abs().max()


def test_poisoned_workspace_rows_are_all_written() -> None:
    # NaN-filled buffers: any (token, slot) row the kernels fail to write shows up as NaN in y
    ex = make(5, 64, 32, [8, 3] * 5, torch.bfloat16, 5)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(9, 64, generator=g).to(torch.bfloat16).to(DEV)
    ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(9)]).to(DEV)
    w = torch.rand(9, 2, generator=g).to(DEV)
    ws = (torch.full((18, 32), float("nan"), dtype=torch.bfloat16, device=DEV),
          torch.full((18, 64), float("nan"), device=DEV))
    got = ap_moe(x, ids, w, ex, workspace=ws).float()
    ref = ap_moe_ref(x, ids, w, ex).float()
    assert torch.isfinite(got).all() and (got - ref).abs().max() <= 4 * 2**-7 * ref.abs().max()


@pytest.mark.parametrize(("bad", "msg"), [("dtype", "float16 or bfloat16"), ("ids", "expert ids"),
                                          ("shape", "must be \\[T, 64\\]"), ("bits", "bits must be")])
def test_launcher_validates(bad: str, msg: str) -> None:
    ex = make(2, 64, 32, [4, 4, 4, 4], torch.bfloat16, 1)
    x = torch.randn(3, 64).to(torch.bfloat16).to(DEV)
    ids = torch.zeros(3, 1, dtype=torch.int64, device=DEV)
    w = torch.ones(3, 1, device=DEV)
    if bad == "dtype":
        x = x.float()
    elif bad == "ids":
        ids = ids + 5
    elif bad == "shape":
        x = torch.randn(3, 65).to(torch.bfloat16).to(DEV)
    elif bad == "bits":
        ex = type(ex)(**{**ex.__dict__, "bits": torch.tensor([4, 9, 4, 4], dtype=torch.int32, device=DEV)})
    with pytest.raises(ValueError, match=msg):
        ap_moe(x, ids, w, ex)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_dequant_path_matches_reference(dtype: torch.dtype) -> None:
    ex = make(5, 72, 40, torch.randint(2, 9, (10,)).tolist(), dtype, 21)
    g = torch.Generator().manual_seed(22)
    x = torch.randn(20, 72, generator=g).to(dtype).to(DEV)
    ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(20)]).to(DEV)
    w = torch.rand(20, 2, generator=g).to(DEV)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "dequant_min_pairs": 1}
    got = ap_moe(x, ids, w, ex, config=cfg).float()
    ref = ap_moe_ref(x, ids, w, ex).float()
    tol = (2**-7 if dtype == torch.bfloat16 else 2**-10) * 4
    assert (got - ref).abs().max() <= tol * ref.abs().max()


def test_dequant_blocks_match_reference_dequantization() -> None:
    from pwrun.ap.format import dequantize

    ex = make(3, 100, 36, [2, 5, 8, 3, 4, 6], torch.bfloat16, 4)
    got = dequant_blocks(ex, torch.tensor([2, 0, 4], device=DEV), "gate_up", torch.bfloat16)
    for j, b in enumerate([2, 0, 4]):
        planes, lut, _, k = ex.block(b)
        assert torch.equal(got[j], dequantize(planes, lut, k, planes.shape[0], torch.bfloat16))
