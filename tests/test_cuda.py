"""CUDA path of the lean runtime (skipped on machines without a GPU; run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from pwrun.data import default_model_dir, read_text
from pwrun.generate import generate
from pwrun.model.loader import load_model, load_tokenizer
from pwrun.ppl import perplexity
from pwrun.sampling import SamplingParams

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
