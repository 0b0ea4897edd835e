"""The 16-bit MoE kernels (``pwkernels.moe.dense``) against their reference twin (``dense_moe_ref``): both paths
(GEMV, grouped GEMM) on ragged token counts, random routings with experts that get no token, blocks laid out in
shuffled order with NaN gaps between them, bf16 and fp16, SiLU and GELU-tanh, H and I not multiples of the tiles,
rows of x strided; in Triton's interpreter on the CPU and natively on the GPU."""

from __future__ import annotations

import pytest
import torch

import pwkernels.moe.dense as dense_mod
from pwkernels.moe.dense import dense_moe
from pwkernels.moe.dense_grouped import grouped_mm_fits, grouped_mm_runs_without_sync
from pwkernels.moe.experts import DenseExperts, build_dense_experts, stacked_views
from pwkernels.moe.launch import DenseGemmTile, DenseGemvTile, DenseMoEConfig
from pwkernels.moe.ref import dense_moe_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: tests/conftest.py sets TRITON_INTERPRET
HIDDEN, INTER = 72, 40  # neither a multiple of the tiles below
GEMV = DenseGemvTile(BLOCK_N=16, BLOCK_K=32)
GEMM = DenseGemmTile(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32)


def _experts(e: int, dtype: torch.dtype, seed: int, shuffle: bool = True) -> DenseExperts:
    g = torch.Generator().manual_seed(seed)
    blocks = [torch.randn(*((2 * INTER, HIDDEN) if i % 2 == 0 else (HIDDEN, INTER)), generator=g)
              * (HIDDEN if i % 2 == 0 else INTER) ** -0.5 for i in range(2 * e)]
    return build_dense_experts(blocks, HIDDEN, INTER, dtype, DEV, shuffle_seed=seed if shuffle else None)


def _check(t: int, k: int, e: int, dtype: torch.dtype, activation: str,
           tile: DenseGemvTile | DenseGemmTile | DenseMoEConfig, seed: int, shuffle: bool = True) -> None:
    ex = _experts(e, dtype, seed, shuffle)
    # shuffled blocks with gaps: no common stride; no views either where torch's grouped GEMM would sync
    assert (ex.stacked is None) == (shuffle or not grouped_mm_fits(torch.empty(0, dtype=dtype, device=DEV)))
    g = torch.Generator().manual_seed(seed + 1)
    wide = torch.randn(t, HIDDEN + 8, generator=g).to(dtype).to(DEV)
    x = wide[:, 3:3 + HIDDEN]  # rows HIDDEN + 8 apart, as a slice of a fused buffer would be
    # experts 0..e-2 only: the last one gets no token; at few tokens most others get none either
    ids = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(t)]).to(DEV)
    w = torch.rand(t, k, generator=g).to(DEV)
    got = dense_moe(x, ids.to(torch.int32), w, ex, tile, activation).float()
    ref = dense_moe_ref(x, ids, w, ex, activation).float()
    assert got.shape == (t, HIDDEN) and torch.isfinite(got).all()
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item() + 1e-6
    tol = (2**-7 if dtype == torch.bfloat16 else 2**-10) * 4  # a few ulps of the output scale
    assert err <= tol * scale, f"max err {err:.3e} vs scale {scale:.3e}"


CASES = [(torch.bfloat16, "silu"), (torch.float16, "gelu_tanh")]


@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize(("dtype", "activation"), CASES)
def test_gemv_path_equals_reference(t: int, dtype: torch.dtype, activation: str) -> None:
    _check(t, 2, 5, dtype, activation, GEMV, seed=t)


@pytest.mark.parametrize(("t", "k", "split"), [(1, 1, 1), (1, 2, 3), (3, 2, 2), (2, 3, 1)])
def test_split_down_gemv_equals_reference(t: int, k: int, split: int) -> None:
    """The down GEMV split by pair and K chunk (a chunk past I included: 3 chunks of 32 columns for I = 40)."""
    tile = DenseGemvTile(BLOCK_N=16, BLOCK_K=32, DOWN_SPLIT=split)
    _check(t, k, 5, torch.bfloat16, "silu", tile, seed=10 * t + split)
    _check(t, k, 5, torch.float16, "gelu_tanh", tile, seed=10 * t + split + 1)


@pytest.mark.parametrize("t", [1, 17, 70])
@pytest.mark.parametrize(("dtype", "activation"), CASES)
def test_grouped_gemm_path_equals_reference(t: int, dtype: torch.dtype, activation: str) -> None:
    """At 70 tokens x top-3 of 6, most experts hold more than one 16-pair tile; expert 5 holds none."""
    _check(t, 3, 6, dtype, activation, GEMM, seed=100 + t)


@pytest.mark.parametrize("t", [5, 17, 70])
@pytest.mark.parametrize(("dtype", "activation"), CASES)
def test_grouped_mm_path_equals_reference(t: int, dtype: torch.dtype, activation: str) -> None:
    """Blocks at one stride (placement in expert order): from ``min_grouped_mm_tokens`` the config takes cuBLAS'
    grouped GEMM over the stacked views; experts without tokens are empty groups."""
    _check(t, 3, 6, dtype, activation, DenseMoEConfig(gemv=GEMV, gemm=GEMM), seed=200 + t, shuffle=False)


def test_grouped_mm_takes_the_tokens_the_config_gives_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """From ``min_grouped_mm_tokens`` tokens, and from 1 token for experts at least ``wide_inter`` wide, stacked
    experts go through cuBLAS' grouped GEMM; shuffled ones never do."""
    calls = []
    real = dense_mod.grouped_mm_moe
    monkeypatch.setattr(dense_mod, "grouped_mm_moe", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for cfg, t, shuffle, taken in ((DenseMoEConfig(gemv=GEMV, gemm=GEMM), 4, False, False),
                                   (DenseMoEConfig(gemv=GEMV, gemm=GEMM), 5, False, True),
                                   (DenseMoEConfig(gemv=GEMV, gemm=GEMM, wide_inter=INTER), 1, False, True),
                                   (DenseMoEConfig(gemv=GEMV, gemm=GEMM), 9, True, False)):
        calls.clear()
        _check(t, 2, 5, torch.bfloat16, "silu", cfg, seed=300 + t, shuffle=shuffle)
        assert bool(calls) == taken, (cfg, t, shuffle)


def test_grouped_mm_only_where_it_runs_in_one_launch() -> None:
    """On CUDA, torch's grouped GEMM syncs with the host (and breaks graph capture) except for bf16 on sm90 /
    sm100: fp16 (Gemma-4's kernel wiring) and older GPUs keep the Triton paths."""
    assert grouped_mm_runs_without_sync(torch.bfloat16, "cuda", (9, 0))
    assert grouped_mm_runs_without_sync(torch.bfloat16, "cuda", (10, 0))
    assert not grouped_mm_runs_without_sync(torch.float16, "cuda", (9, 0))
    assert not grouped_mm_runs_without_sync(torch.bfloat16, "cuda", (8, 0))
    assert grouped_mm_runs_without_sync(torch.float16, "cpu", None)


def test_stacked_views_only_for_one_aligned_stride() -> None:
    pool = torch.arange(4096, dtype=torch.bfloat16)
    g, d = stacked_views(pool, [0, 64, 128, 192], 8, 2)  # E = 2, I = 2, H = 8: gate_up 32, down 16 elements
    assert g.shape == (2, 4, 8) and d.shape == (2, 8, 2)
    assert torch.equal(g[1].flatten(), pool[128:160]) and torch.equal(d[1].flatten(), pool[192:208])
    assert stacked_views(pool, [0, 64, 128, 200], 8, 2) is None  # down of expert 1 elsewhere
    assert stacked_views(pool, [4, 68, 132, 196], 8, 2) is None  # 8-byte aligned starts
    assert stacked_views(pool, [0, 64], 8, 2) is not None  # one expert (a shared expert)


def test_config_picks_the_path_by_token_count() -> None:
    large = DenseGemmTile(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16)
    cfg = DenseMoEConfig(gemv=GEMV, gemm=GEMM, gemm_large=large, max_gemv_tokens=4, min_large_tokens=5)
    assert cfg.pick(1) is GEMV and cfg.pick(4) is GEMV and cfg.pick(5) is large
    assert DenseMoEConfig(gemv=GEMV, gemm=GEMM, max_gemv_tokens=4).pick(5) is GEMM
    ex = _experts(3, torch.bfloat16, 7)
    x = torch.randn(5, HIDDEN).to(torch.bfloat16).to(DEV)
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2], [1, 0]], device=DEV)
    w = torch.rand(5, 2).to(DEV)
    want = dense_moe_ref(x, ids, w, ex)
    for n in (1, 5):  # the first n tokens: the GEMV path, then the large-tile GEMM path
        got = dense_moe(x[:n], ids[:n], w[:n], ex, cfg)
        assert (got.float() - want[:n].float()).abs().max() <= 2**-5 * want.float().abs().max()
    assert dense_moe(x[:0], ids[:0], w[:0], ex).shape == (0, HIDDEN)


def test_bad_inputs_and_configs_are_refused() -> None:
    ex = _experts(3, torch.bfloat16, 3)
    x = torch.randn(2, HIDDEN).to(DEV)
    ids, w = torch.zeros(2, 1, dtype=torch.int64, device=DEV), torch.ones(2, 1, device=DEV)
    with pytest.raises(ValueError, match="16-bit dtype"):
        dense_moe(x, ids, w, ex)  # fp32 activations
    with pytest.raises(ValueError, match=r"\[T, 72\]"):
        dense_moe(x[:, :10].to(torch.bfloat16), ids, w, ex)
    with pytest.raises(ValueError, match="activation"):
        dense_moe(x.to(torch.bfloat16), ids, w, ex, activation="relu")
    for bad in (lambda: DenseGemvTile(BLOCK_N=24), lambda: DenseGemvTile(DOWN_SPLIT=-1),
                lambda: DenseGemmTile(BLOCK_M=8), lambda: DenseMoEConfig(max_gemv_tokens=-1),
                lambda: DenseMoEConfig(min_large_tokens=1.5)):
        with pytest.raises(ValueError):
            bad()
