"""Sampling: greedy, top-p support and seeded reproducibility."""

from __future__ import annotations

import pytest
import torch

from pwrun.core.decision import ScheduledChunk, StepDecision, WeightMoves
from pwrun.core.request import SamplingParams
from pwrun.runner.model_runner import ModelRunner
from pwrun.runner.sampling import sample, sample_rows


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 50)
    assert torch.equal(sample(logits, SamplingParams(), None), logits.argmax(-1))


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(temperature=1.0, top_p=0.7)
    gen = torch.Generator().manual_seed(0)
    seen = {int(sample(logits, params, gen)) for _ in range(300)}
    assert seen == {0, 1}  # 0.5 + 0.3 >= 0.7; tokens 2 and 3 are outside the nucleus


def test_seeded_sampling_is_reproducible() -> None:
    logits = torch.randn(3, 100)
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=3)
    a = [sample(logits, p, torch.Generator().manual_seed(3)).tolist() for _ in range(2)]
    assert a[0] == a[1]


@pytest.mark.parametrize("kw", [{"max_new_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}])
def test_bad_params(kw: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_params_refuse_non_finite_temperature_and_nan_top_p() -> None:
    for kw in ({"temperature": float("inf")}, {"temperature": float("nan")}, {"top_p": float("nan")}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


def test_extreme_but_valid_options_sample_the_obvious_token() -> None:
    """A top_p below float32's range keeps only the most likely token; the smallest temperature is (nearly) greedy;
    neither may fail in the sampler."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=gen) * 5
    logits[torch.arange(6), torch.arange(6)] = 30.0  # a clear winner per row: 0.001 is then exactly greedy
    for params in (SamplingParams(temperature=1.0, top_p=1e-300), SamplingParams(temperature=1e-3)):
        assert torch.equal(sample(logits, params, gen), logits.argmax(-1))


def test_runner_samples_a_step_as_row_by_row() -> None:
    """``ModelRunner.sample`` (greedy rows in one argmax, forced rows in one log-softmax, sampled rows with their
    own generators) gives each chunk what sampling its row alone gives."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 300, generator=g) * 3
    kinds = ["greedy", "forced", "drawn", "partial", "greedy", "drawn", "forced"]
    params = {i: SamplingParams(temperature=0.8 if k == "drawn" else 0.0, top_p=0.9 if k == "drawn" else 1.0)
              for i, k in enumerate(kinds)}
    chunks = tuple(ScheduledChunk(rid=i, token_ids=(1,), start=0, slots=(0,), block_table=(0,), last=k != "partial",
                                  forced=17 + i if k == "forced" else None) for i, k in enumerate(kinds))
    decision = StepDecision(chunks, (), (), (), WeightMoves(), 1)
    runner = ModelRunner.__new__(ModelRunner)
    runner._params = params
    runner._gens = {i: torch.Generator().manual_seed(10 + i) for i in params}
    tokens, logprobs = runner.sample(decision, logits)
    for i, k in enumerate(kinds):
        row = logits[i]
        if k == "partial":
            assert tokens[i] is None and logprobs[i] is None
        elif k == "forced":
            assert tokens[i] == 17 + i
            assert logprobs[i] == pytest.approx(float(torch.log_softmax(row, -1)[17 + i]), abs=1e-6)
        elif k == "greedy":
            assert tokens[i] == int(row.argmax()) and logprobs[i] is None
        else:
            want = int(sample(row[None], params[i], torch.Generator().manual_seed(10 + i))[0])
            assert tokens[i] == want and logprobs[i] is None


def test_sample_rows_equals_sample_row_by_row() -> None:
    """Greedy rows (one argmax over the rows picked) and sampled rows (their own generators) of a subset of rows."""
    logits = torch.randn(6, 80, generator=torch.Generator().manual_seed(1)) * 2
    rows = [5, 0, 3, 2]
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.8), SamplingParams(),
              SamplingParams(temperature=1.3)]
    got = sample_rows(logits, rows, params, [torch.Generator().manual_seed(j) for j in range(4)])
    want = [int(sample(logits[r][None], p, torch.Generator().manual_seed(j))[0])
            for j, (r, p) in enumerate(zip(rows, params, strict=True))]
    assert got == want
    every = list(range(6))
    assert sample_rows(logits, every, [SamplingParams()] * 6, [None] * 6) == logits.argmax(-1).tolist()
