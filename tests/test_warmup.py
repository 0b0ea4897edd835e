"""Ahead-of-time compile of the decode MoE kernels (``kernels/warmup.py``): which token counts need their own
compile, which expert shapes a model has, and on a GPU that the warmed kernels are the ones the decode step uses."""

from __future__ import annotations

import pytest
import torch

from kernels.warmup import MoEShape, decode_token_counts, precompile_decode
from pwrun.data import default_model_dir
from pwrun.engine.serve import moe_shapes
from pwrun.model.loader import load_model


def test_decode_token_counts_are_the_padded_token_counts() -> None:
    assert decode_token_counts(1) == [1]
    assert decode_token_counts(2) == [1, 2]
    assert decode_token_counts(3) == [1, 2, 4]  # 3 tokens run the kernels padded to 4
    assert decode_token_counts(5) == [1, 2, 4, 8]
    # past 8 tokens the word-first path runs chunks of 8 and the rest: 9..16 tokens pad the rest to 1, 2, 4, 8
    assert decode_token_counts(9) == [1, 2, 4, 8, 9]
    assert decode_token_counts(11) == [1, 2, 4, 8, 9, 10, 12]
    assert decode_token_counts(16) == decode_token_counts(64) == [1, 2, 4, 8, 9, 10, 12, 16]


def test_moe_shapes_of_the_bundled_model() -> None:
    model = load_model(default_model_dir(), device="cpu", dtype="bfloat16")
    spec = model.spec
    shapes = moe_shapes(model)
    moe = [ls.moe for ls in spec.layers if ls.moe is not None]
    assert len(shapes) == len({(m.expert_intermediate, m.top_k, m.shared_intermediate) for m in moe}) >= 1
    s = shapes[0]
    assert (s.hidden, s.inter, s.topk, s.shared_inter, s.dtype) == (
        spec.hidden_size, moe[0].expert_intermediate, moe[0].top_k, moe[0].shared_intermediate, "bfloat16")


def test_precompile_without_cuda_does_nothing() -> None:
    if torch.cuda.is_available():
        pytest.skip("CPU machines only")
    assert precompile_decode([MoEShape(64, 32, 2)], 4, workers=2) == []


def test_bad_shapes_and_worker_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        MoEShape(0, 32, 2)
    with pytest.raises(ValueError, match="positive"):
        MoEShape(64, 32, 2, shared_inter=-5)
    for bad in (-3, 2.5, True):
        with pytest.raises(ValueError, match="workers"):
            precompile_decode([MoEShape(64, 32, 2)], 4, workers=bad)  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_precompile_on_cuda_compiles_without_errors_and_only_once() -> None:
    shape = MoEShape(256, 96, 2, 128)
    assert precompile_decode([shape], 1, workers=1) == []
    # a second call finds the job done in this process and starts no worker
    assert precompile_decode([shape], 1, workers=1) == []


def test_engine_config_refuses_a_negative_worker_count() -> None:
    from pwrun.engine.engine import EngineConfig

    assert EngineConfig(precompile_workers=0).precompile_workers == 0
    for bad in (-2, 2.5, True):
        with pytest.raises(ValueError, match="precompile_workers"):
            EngineConfig(precompile_workers=bad)  # type: ignore[arg-type]
