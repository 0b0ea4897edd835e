"""pwkernels/warmup: the decode GEMV warm-up covers every kernel specialization a linear meets in 1..max_batch
tokens with the fewest calls, compiles it on a small stand-in weight of the same Triton int class, and lists the
linears a CUDA decode step runs (``pwrun.engine.build.linear_shapes``)."""

from __future__ import annotations

import pytest
import torch

from pwkernels.dense_gemv import CONFIGS
from pwkernels.warmup import (
    LinearShape,
    gemv_key,
    linear_token_counts,
    precompile_gemv,
    stand_in_rows,
    triton_int_class,
)
from pwrun.data import default_model_dir
from pwrun.engine.build import linear_shapes
from pwrun.model.loader import load_model
from pwrun.model.weights import fuse_qkv

ROUTER, QKV = LinearShape(61, 2048, False), LinearShape(6144, 2048, True)


def test_token_counts_by_hand() -> None:
    """T_PAD 1 / 2 / 4 / 8 / 16 and the int classes of the count (1, a multiple of 16, other): 1 is its own class,
    3 and 4 share T_PAD 4, 16 is a multiple of 16 beside 9..15 (worked out by hand, not by the code)."""
    assert CONFIGS["max_tokens_by_shape"]["61x2048"] == 16 and CONFIGS["max_tokens"] == 1
    assert linear_token_counts(ROUTER, 16) == [1, 2, 3, 5, 9, 16]
    assert linear_token_counts(ROUTER, 32) == [1, 2, 3, 5, 9, 16]  # the router's GEMV stops at 16 tokens
    assert linear_token_counts(ROUTER, 4) == [1, 2, 3]
    assert linear_token_counts(ROUTER, 1) == [1]
    assert linear_token_counts(QKV, 16) == [1]  # big weights: cuBLAS from 2 tokens
    assert linear_token_counts(LinearShape(8, 4096, False), 16) == [1, 2, 3]  # Mixtral's router: up to 4


def test_precompile_gemv_covers_mixed_steps_past_max_batch(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Given max_step_tokens, the GEMV warm-up takes every count a step can hand a linear (the router up to its 16
    tokens at max_batch 4); without it, up to max_batch. The job list is read through a stand-in runner (no GPU)."""
    import pwkernels.warmup as wg

    seen: list = []
    monkeypatch.setattr(wg, "compile_in_workers", lambda fn, jobs, done, workers, what: seen.append(jobs) or [])
    assert wg.precompile_gemv([ROUTER], 4, workers=2, max_step_tokens=2048) == []
    assert wg.precompile_gemv([ROUTER], 4, workers=2) == []
    assert [j[-1] for j in seen[0]] == [1, 2, 3, 5, 9, 16] and [j[-1] for j in seen[1]] == [1, 2, 3]
    assert wg.precompile_gemv([ROUTER], 4, workers=2, max_step_tokens=6) == []
    assert [j[-1] for j in seen[2]] == [1, 2, 3, 5]


@pytest.mark.parametrize("max_batch", [1, 3, 8, 16, 40])
def test_chosen_counts_launch_every_specialization_of_the_range(max_batch: int) -> None:
    counts = linear_token_counts(ROUTER, max_batch)
    every = {gemv_key(t) for t in range(1, min(max_batch, 16) + 1)}
    assert {gemv_key(t) for t in counts} == every and len(counts) == len(every)
    assert all(gemv_key(t)[0] >= t > gemv_key(t)[0] // 2 for t in range(1, 17))  # T_PAD: next power of 2


def test_stand_in_weight_keeps_the_int_class() -> None:
    for n in [1, 2, 8, 15, 16, 17, 18, 61, 64, 2048, 6144, 151936, 151937]:
        r = stand_in_rows(n)
        assert triton_int_class(r) == triton_int_class(n) and 1 <= r <= min(n, 17), (n, r)


def test_linear_shapes_of_the_bundled_model() -> None:
    model = load_model(default_model_dir(), device="cpu", dtype="bfloat16")
    spec = model.spec
    for lw in model.weights.layers:
        fuse_qkv(lw.attn)
    shapes = linear_shapes(model)
    a, h = spec.layers[0].attention, spec.hidden_size
    moe = next(ls.moe for ls in spec.layers if ls.moe is not None)
    has_gate = any(lw.moe is not None and lw.moe.shared_gate is not None for lw in model.weights.layers)
    qkv_bias = model.weights.layers[0].attn.qkv_bias is not None
    want = {LinearShape((a.num_heads + 2 * a.num_kv_heads) * a.head_dim, h, qkv_bias),
            LinearShape(h, a.num_heads * a.head_dim, False),
            LinearShape(moe.num_experts + has_gate, h, False),
            LinearShape(spec.vocab_size, h, False)}
    assert set(shapes) == want and len(shapes) == len(want)


def test_without_cuda_nothing_runs_and_bad_input_is_refused() -> None:
    if not torch.cuda.is_available():
        assert precompile_gemv([ROUTER], 16, workers=2) == []
    for n in (0, 1.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            LinearShape(n, 64, False)  # type: ignore[arg-type]
    for bad in (-1, 1.5, False):
        with pytest.raises(ValueError, match="workers"):
            precompile_gemv([ROUTER], 4, workers=bad)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_precompile_on_cuda_compiles_without_errors_and_only_once() -> None:
    shapes = [LinearShape(61, 2048, False), LinearShape(6144, 2048, True)]
    assert precompile_gemv(shapes, 16, workers=2) == []
    assert precompile_gemv(shapes, 16, workers=2) == []
