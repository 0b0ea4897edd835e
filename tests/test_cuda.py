"""CUDA path of the lean runtime (skipped on machines without a GPU; run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from pwrun.core.policy import Policy
from pwrun.core.request import SamplingParams
from pwrun.data import default_model_dir, read_text
from pwrun.generate import generate
from pwrun.model.loader import load_model, load_tokenizer
from pwrun.ppl import perplexity

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MODEL = default_model_dir()


def test_cuda_bf16_perplexity_matches_cpu_fp32() -> None:
    tok = load_tokenizer(MODEL)
    ids = tok(read_text("wikitext2"), add_special_tokens=False, verbose=False).input_ids
    cpu = perplexity(load_model(MODEL, device="cpu"), ids, 512, max_windows=16).ppl
    gpu = perplexity(load_model(MODEL, device="cuda"), ids, 512, max_windows=16).ppl
    assert abs(gpu / cpu - 1) < 0.01  # bf16 vs fp32


def test_cuda_generate_greedy_and_sampled() -> None:
    tok = load_tokenizer(MODEL)
    model = load_model(MODEL, device="cuda")
    prompts = ["The war ended", "In 1900 the city"]
    greedy, stats = generate(model, tok, prompts, SamplingParams(max_new_tokens=20))
    assert all(g.new_tokens > 0 and g.text for g in greedy) and stats.decode_tokens > 0
    a, _ = generate(model, tok, prompts, SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=4))
    b, _ = generate(model, tok, prompts, SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=4))
    assert [x.text for x in a] == [x.text for x in b]


def test_cuda_fused_step_kernels_match_the_eager_ops(calibrated_artifacts) -> None:  # type: ignore[no-untyped-def]
    """Served with the fused residual+RMSNorm / RoPE+KV write / routing kernels, teacher-forced real text scores
    the same perplexity as with the eager ops (bf16 logits: per-token log-probabilities differ by rounding only)."""
    import numpy as np

    from pwrun.core.config import EngineConfig
    from pwrun.data import document_prompts
    from pwrun.engine.build import ServeConfig, build_engine

    tok = load_tokenizer(MODEL)
    toks = [tok(t).input_ids for t in document_prompts("c4", 6, 1200)]
    prompts, forced = [x[:96] for x in toks], [x[96:160] for x in toks]
    lps = {}
    for fused in (False, True):
        cfg = ServeConfig(2**30, Policy.named("uniform", 8), EngineConfig(fused_kernels=fused))
        e = build_engine(MODEL, calibrated_artifacts, cfg, SamplingParams(max_new_tokens=64), prompts, set(),
                         device="cuda", forced=forced)
        outs = e.run_until_done()
        lps[fused] = np.concatenate([np.asarray(o.logprobs) for o in outs.values()])
    ratio = float(np.exp(lps[False].mean() - lps[True].mean()))
    assert abs(ratio - 1) < 0.01, f"perplexity fused / eager = {ratio:.4f}"
    assert float(np.abs(lps[True] - lps[False]).mean()) < 0.1


def test_cuda_engine_build_waits_for_the_initial_upload(calibrated_artifacts,  # type: ignore[no-untyped-def]
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The initial placement's copies are done when ``place`` returns: the first step must not count them."""
    from pwrun.engine.build import ServeConfig, build_engine
    from pwrun.runner.experts import store as experts

    idle: list[bool] = []
    real = experts.ExpertStore.place

    def place(self, q_bits):  # type: ignore[no-untyped-def]
        real(self, q_bits)
        idle.append(torch.cuda.current_stream().query())

    monkeypatch.setattr(experts.ExpertStore, "place", place)
    e = build_engine(MODEL, calibrated_artifacts, ServeConfig(2**30, Policy.named("uniform", 8)),
                     SamplingParams(max_new_tokens=2), [[5, 6, 7]], set(), device="cuda")
    assert idle == [True], "the initial plane copies were still queued when place() returned"
    e.run_until_done()
