"""Ahead-of-time compile of the decode MoE kernels (``pwkernels/warmup.py``): which token counts need their own
compile, which expert shapes a model has, and on a GPU that the warmed kernels are the ones the decode step uses."""

from __future__ import annotations

import pytest
import torch

from pwkernels.moe.launch import parse_config
from pwkernels.warmup import MoEShape, decode_token_counts, precompile_decode
from pwrun.data import default_model_dir
from pwrun.engine.build import moe_shapes
from pwrun.model.loader import load_model

MID = {"path": "mid", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}


def dec(block_n: int, slots: int = 0) -> dict:
    """A decode config (JSON form); ``block_n`` only tells configs apart."""
    return {"path": "decode", "gate_up": {"BLOCK_N": block_n, "BLOCK_K": 64}, "down": {"BLOCK_N": 32, "BLOCK_K": 64},
            "SLOTS": slots}


def test_decode_token_counts_cover_every_kernel_specialization() -> None:
    """One token count per kernel specialization that 1..max_batch tokens launch: the decode path's token slots pad
    each chunk of 8 to a power of 2 (9 = 8 + 1, 10, 11 add chunks of 1, 2, 4 tokens), mid does not specialize; a
    bucket with its own config past 16 tokens adds the counts whose chunks it pads differently (17 = 8 + 8 + 1, 18,
    19)."""
    from pwkernels.warmup import kernels_at

    table = {"default": [{"min_tokens": 1, "config": dec(1)},
                         {"min_tokens": 2, "config": dec(2)},
                         {"min_tokens": 5, "config": dec(4)},
                         {"min_tokens": 16, "config": MID},
                         {"min_tokens": 17, "config": dec(8)}], "by_shape": {}}
    assert decode_token_counts(1, configs=table) == [1]
    assert decode_token_counts(4, configs=table) == [1, 2, 3]  # 3 tokens pad to 4, as 4 do
    assert decode_token_counts(16, configs=table) == [1, 2, 3, 5, 9, 10, 11, 16]  # 5..8 pad to 8
    assert decode_token_counts(64, configs=table) == [1, 2, 3, 5, 9, 10, 11, 16, 17, 18, 19]
    one = {"default": [{"min_tokens": 1, "config": dec(1)}], "by_shape": {}}
    assert decode_token_counts(40, configs=one) == [1, 2, 3, 5]  # past 8 the chunks reuse those kernels
    # the counts launch exactly the specializations of the whole range
    from pwkernels.moe.dispatch import launch_config

    def union(ts: list[int] | range) -> set:
        return set().union(*(kernels_at(t, launch_config(t, None, None, table)) for t in ts))

    assert union(decode_token_counts(40, configs=table)) == union(range(1, 41))
    # the shipped configs: the Qwen routed experts (2048 x 1408) at up to 16 tokens
    counts = decode_token_counts(16, 2048, 1408)
    assert counts[0] == 1 and union_shipped(counts) == union_shipped(range(1, 17))


@pytest.mark.parametrize("shape", [(4096, 14336, 2), (2048, 1408, 4), (2048, 5632, 1), (64, 32, 2)])
@pytest.mark.parametrize("max_batch", [1, 4, 16])
def test_step_token_limit_covers_every_step_a_mixed_batch_makes(shape: tuple[int, int, int], max_batch: int) -> None:
    """Chunked prefill puts a prompt's last piece beside the running decodes, so a step hands the MoE any count up
    to max_step_tokens: with max_step_tokens the warm-up counts launch every specialization of 1..2048 on the shipped
    configs (Mixtral, Qwen routed and shared, an untuned shape), including 5 for Mixtral; without it, decode
    counts only; never below max_batch, never above max_step_tokens."""
    from pwkernels.moe.dispatch import launch_config
    from pwkernels.warmup import kernels_at, step_token_limit

    h, i, k = shape

    def union(ts: list[int] | range) -> set:
        return set().union(*(kernels_at(t, launch_config(t, h, i), k) for t in ts))

    limit = step_token_limit(max_batch, 2048, h, i)
    counts = decode_token_counts(limit, h, i, topk=k)
    assert union(counts) == union(range(1, 2049))
    assert step_token_limit(max_batch, None, h, i) == max_batch
    assert step_token_limit(max_batch, 3, h, i) == max(max_batch, 3)
    if (h, i) == (4096, 14336):
        assert 5 in counts  # the 5..16-token bucket


def test_sorted_slots_and_triton_int_specialization() -> None:
    """A decode config in the sorted-slots mode (SLOTS = S) launches T_PAD = S at every token count and passes the
    whole T (no chunks), on which Triton specializes (1, a multiple of 16, other): counts 2 and 16 stand for 2..32.
    The mid path passes T * top-k pairs: at top-4, 33 tokens (132 pairs) and 36 (144, a multiple of 16) differ."""

    table = {"default": [{"min_tokens": 1, "config": dec(1)},
                         {"min_tokens": 2, "config": dec(2, 2)},
                         {"min_tokens": 33, "config": MID}], "by_shape": {}}
    assert decode_token_counts(32, configs=table) == [1, 2, 16]
    assert decode_token_counts(64, configs=table) == [1, 2, 16, 33, 48]
    # top-4: the pair sort of the sorted slots takes 4 T pairs (16 at T = 4: its own compile), mid 4 T pairs
    assert decode_token_counts(64, configs=table, topk=4) == [1, 2, 4, 16, 33, 36]
    with pytest.raises(ValueError, match="SLOTS must be"):
        parse_config(dec(1, 3))


def test_int_classes_follow_triton() -> None:
    """``triton_int_class`` agrees with Triton's own specialization of int arguments (where this Triton exposes
    it): the warm-up's keys must split token counts exactly where Triton compiles another kernel."""
    from pwkernels.warmup import triton_int_class

    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        pytest.skip("this Triton does not expose native_specialize_impl")
    seen: dict[object, int] = {}
    for v in range(1, 130):
        spec = native_specialize_impl(BaseBackend, v, False, True, True)
        assert seen.setdefault(spec, triton_int_class(v)) == triton_int_class(v), (v, spec)
    assert len(seen) == len({triton_int_class(v) for v in range(1, 130)}) == 3


def union_shipped(ts: list[int] | range) -> set:
    from pwkernels.moe.dispatch import launch_config
    from pwkernels.warmup import kernels_at

    return set().union(*(kernels_at(t, launch_config(t, 2048, 1408)) for t in ts))


def test_moe_shapes_of_the_bundled_model() -> None:
    model = load_model(default_model_dir(), device="cpu", dtype="bfloat16")
    spec = model.spec
    shapes = moe_shapes(model)
    moe = [ls.moe for ls in spec.layers if ls.moe is not None]
    assert len(shapes) == len({(m.expert_intermediate, m.top_k, m.shared_intermediate) for m in moe}) >= 1
    s = shapes[0]
    assert (s.hidden, s.inter, s.topk, s.shared_inter, s.dtype, s.num_experts) == (
        spec.hidden_size, moe[0].expert_intermediate, moe[0].top_k, moe[0].shared_intermediate, "bfloat16",
        moe[0].num_experts)


def test_the_warm_up_routes_over_the_models_expert_count(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The mid path's expert alignment compiles per expert count (its power of 2 is a constant): warm-up calls run
    on as many random experts as the layer has (over only top-k of them, a mixed step of a 60-expert model would
    compile the alignment inside a run), the shared expert on one."""
    import pwkernels.warmup as wg

    seen: list[tuple] = []
    monkeypatch.setattr(wg, "compile_in_workers", lambda fn, jobs, done, n, what: seen.extend(jobs) or [])
    wg.precompile_decode([MoEShape(64, 32, 4, shared_inter=48, num_experts=60), MoEShape(64, 16, 2)], 8, workers=2,
                         max_step_tokens=512)
    experts = {(j[1], j[2]): j[5] for j in seen}
    assert experts == {(32, 4): 60, (48, 1): 1, (16, 2): 2}
    assert {j[6] for j in seen if j[1] == 32} >= {1, 16, 17}  # decode and mid counts, each on the 60 experts
    with pytest.raises(ValueError, match="positive"):
        MoEShape(64, 32, 2, num_experts=-1)


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
    from pwrun.core.config import EngineConfig

    assert EngineConfig(precompile_workers=0).precompile_workers == 0
    for bad in (-2, 2.5, True):
        with pytest.raises(ValueError, match="precompile_workers"):
            EngineConfig(precompile_workers=bad)  # type: ignore[arg-type]


def test_a_warm_cache_starts_no_workers(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Jobs that compiled are recorded beside Triton's cache: a later process (a fresh ``done`` set) skips them,
    a new GPU, kernel source or a failed run does not (the workers are a stand-in: no GPU here)."""
    import pwkernels.warmup as wg

    runs: list[list] = []
    fail = [False]
    monkeypatch.setattr(wg.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(wg, "gpu_name", lambda: "H100 sm_90")
    monkeypatch.setattr(wg, "triton_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(wg, "run_in_workers",
                        lambda fn, jobs, n: runs.append(list(jobs)) or (["boom"] if fail[0] else []))
    jobs = [(64, 32, 2, "bfloat16", "silu", 8, t) for t in (1, 2, 5)]
    fail[0] = True
    assert wg.compile_in_workers(wg._warm, jobs, set(), 2, "x") == ["boom"]
    fail[0] = False
    assert wg.compile_in_workers(wg._warm, jobs, set(), 2, "x") == []  # the failed run recorded nothing
    assert runs == [jobs, jobs]
    new = (64, 32, 2, "bfloat16", "silu", 8, 9)
    assert wg.compile_in_workers(wg._warm, [*jobs, new], set(), 2, "x") == []
    assert runs[-1] == [new]  # only the new job
    assert wg.compile_in_workers(wg._warm_gemv, jobs, set(), 2, "x") == []  # another worker: its own records
    assert runs[-1] == jobs
    n = len(runs)
    assert wg.compile_in_workers(wg._warm, jobs, set(), 2, "x") == [] and len(runs) == n
    monkeypatch.setattr(wg, "gpu_name", lambda: "H200 sm_90")
    assert wg.compile_in_workers(wg._warm, jobs, set(), 2, "x") == [] and runs[-1] == jobs
    wg.kernels_fingerprint.cache_clear()
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")  # a compile setting: other kernels, no record yet
    assert wg.compile_in_workers(wg._warm, jobs, set(), 2, "x") == [] and runs[-1] == jobs
    n = len(runs)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "elsewhere"))  # only where the cache lives: same records
    wg.kernels_fingerprint.cache_clear()
    assert wg.compile_in_workers(wg._warm, jobs, set(), 2, "x") == [] and len(runs) == n

    def unreadable(self):  # type: ignore[no-untyped-def]
        raise PermissionError(13, "Permission denied")

    is_file = wg.Path.is_file
    monkeypatch.setattr(wg.Path, "is_file", unreadable)  # a records folder this user cannot read: compile again
    assert wg.compile_in_workers(wg._warm, jobs, set(), 2, "x") == [] and len(runs) == n + 1
    monkeypatch.setattr(wg.Path, "is_file", is_file)
    assert wg.compile_in_workers(wg._warm, jobs, set(), 2, "x") == [] and len(runs) == n + 1
    monkeypatch.setattr(wg, "kernels_fingerprint", lambda: "another-source")
    assert wg.compile_in_workers(wg._warm, jobs, set(), 2, "x") == [] and len(runs) == n + 2
    blocked = tmp_path / "file"
    blocked.write_text("")
    wg.mark_warm(wg._warm, jobs, "H100 sm_90", root=blocked)  # cannot write: no error, nothing recorded
    assert not wg.warm_record(wg._warm, jobs[0], "H100 sm_90", root=blocked).exists()

