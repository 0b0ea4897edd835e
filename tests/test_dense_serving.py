"""16-bit experts served by the engine from the page pool (``--policy 16-bit``): greedy tokens equal transformers'
on the bundled model and on tiny random configs of every family, under budgets that leave room for few KV blocks
(requests are preempted and still complete in full); pages are conserved; the budget's minimum is exact and a budget
below it is refused in one line; the kernel path (Triton's interpreter on the CPU, native on a GPU) scores what the
reference path scores."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_kernel_wiring import _save_tiny
from test_parity import _save
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from pwformat.errors import BudgetTooSmall
from pwrun.cli import app
from pwrun.core.config import EngineConfig
from pwrun.core.policy import Policy
from pwrun.core.pool import KV, WEIGHT
from pwrun.core.request import SamplingParams
from pwrun.data import default_model_dir
from pwrun.engine.build import ServeConfig, add_requests, strip_experts
from pwrun.engine.build_dense import assemble_dense_engine, build_dense_engine, dense_expert_bytes
from pwrun.engine.llm_engine import LLMEngine
from pwrun.engine.report import summarize
from pwrun.model.inventory import expert_blocks, kv_layout
from pwrun.model.loader import load_model, load_spec
from pwrun.model.streamed import StreamedExperts
from pwrun.runner.experts.dense import DenseExpertStore
from pwrun.serve.builder import build_serving_engine
from tests._tiny_gemma4 import save_tiny_gemma4

DENSE = Policy.named("16-bit")


def _greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (full forward per token, no EOS)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _minimum(path: Path, ecfg: EngineConfig, prompts: list[list[int]], new: int) -> int:
    with pytest.raises(BudgetTooSmall) as err:
        build_dense_engine(path, ServeConfig(1, DENSE, ecfg), SamplingParams(max_new_tokens=new), prompts, set(),
                           "cpu", "float32")
    return err.value.minimum


def _serve_tight(path: Path, prompts: list[list[int]], new: int, extra_blocks: int, exact: bool = False
                 ) -> LLMEngine:
    """The engine under the minimum budget plus ``extra_blocks`` KV blocks, run to completion, pages checked;
    ``exact``: also check that the minimum leaves the longest request's KV and no more, and a byte less is refused."""
    ecfg = EngineConfig(block_size=4, max_batch=len(prompts), max_step_tokens=32, debug_checks=True)
    params = SamplingParams(max_new_tokens=new)
    minimum = _minimum(path, ecfg, prompts, new)
    if exact:
        e = build_dense_engine(path, ServeConfig(minimum, DENSE, ecfg), params, prompts, set(), "cpu", "float32")
        ppb = e.core.layout.pages_per_block
        peak = e.core.layout.peak_pages(max(len(p) for p in prompts) + new, 4, 32)
        assert e.core.pool.num_free == -(-peak // ppb) * ppb
        with pytest.raises(BudgetTooSmall):
            build_dense_engine(path, ServeConfig(minimum - 1, DENSE, ecfg), params, prompts, set(), "cpu", "float32")
    e = build_dense_engine(path, ServeConfig(minimum + extra_blocks * kv_block_bytes(path, 4), DENSE, ecfg), params,
                           prompts, set(), "cpu", "float32")
    pool = e.core.pool
    weight_pages = pool.count(WEIGHT)
    assert weight_pages * pool.cfg.page_bytes == dense_expert_bytes(e.runner.model, pool.cfg.page_bytes)
    e.run_until_done()
    assert pool.count(WEIGHT) == weight_pages and pool.count(KV) == 0
    assert pool.num_free == pool.cfg.num_pages - weight_pages
    return e


def kv_block_bytes(path: Path, block_size: int) -> int:
    """B_KV of the fp32 model in ``path``."""
    layout = kv_layout(load_spec(path)[0])
    return layout.pages_per_block * layout.page_bytes(block_size, 4)


def test_bundled_model_greedy_equals_transformers_under_a_tight_budget() -> None:
    path = default_model_dir()
    hf = AutoModelForCausalLM.from_pretrained(path).float().eval()
    g = torch.Generator().manual_seed(0)
    vocab = load_spec(path)[0].vocab_size
    prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (9, 23, 4, 15)]
    e = _serve_tight(path, prompts, 10, extra_blocks=2)
    assert e.core.scheduler.preemptions > 0  # the KV pool could not hold them all
    for rid, p in enumerate(prompts):
        assert list(e.outputs[rid].token_ids) == _greedy(hf, p, 10), f"request {rid}"
    s = summarize(e)
    assert (s.policy, s.bits, s.mean_bits, s.final_mean_bits, s.demoted_blocks) == ("16-bit", None, 16.0, 16.0, 0)
    assert s.final_bits_hist == {16: len(expert_blocks(e.runner.model.spec))}
    assert s.initial_expert_bytes == 2 * s.expert_bytes_16bit  # fp32 on the CPU: twice the 16-bit bytes
    assert s.weight_bytes_min == s.weight_bytes_max == e.core.pool.count(WEIGHT) * s.page_bytes


FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gemma4"]


@pytest.mark.parametrize("family", FAMILIES)
def test_families_greedy_equal_transformers_under_a_tight_budget(tmp_path: Path, family: str) -> None:
    hf = save_tiny_gemma4(tmp_path) if family == "gemma4" else _save(tmp_path, family)[0]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 7, 3)]
    # all admitted, then their decodes outgrow the pool
    e = _serve_tight(tmp_path, prompts, 12, extra_blocks=1, exact=family == "qwen2_moe")
    assert e.core.scheduler.preemptions > 0
    for rid, p in enumerate(prompts):
        assert list(e.outputs[rid].token_ids) == _greedy(hf, p, 12), f"{family} request {rid}"


def test_cli_refuses_a_small_budget_in_one_line_and_serves_at_a_larger_one(tmp_path: Path) -> None:
    runner = CliRunner()
    base = ["generate", "--prompt", "The river", "--max-new-tokens", "4", "--policy", "16-bit", "--device", "cpu"]
    r = runner.invoke(app, [*base, "--gpu-memory", "20MiB"])
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --gpu-memory 20.00 MiB is too small: the 16-bit experts")
    assert "give at least --gpu-memory" in lines[0]
    out = tmp_path / "s.json"
    r = runner.invoke(app, [*base, "--gpu-memory", "120MiB", "--summary-json", str(out), "--max-batch", "2"])
    assert r.exit_code == 0, r.stderr
    assert '"policy": "16-bit"' in out.read_text()
    r = runner.invoke(app, [*base, "--gpu-memory", "120MiB", "--artifacts", str(tmp_path)])
    assert r.exit_code == 2 and "drop --artifacts" in r.stderr


def test_no_budget_fits_the_run_and_equals_the_reference_generation() -> None:
    """``pwrun generate`` without --artifacts: the 16-bit engine under the budget the run needs (``gpu_memory`` 0),
    every request's KV at once (no preemption), greedy tokens equal to the reference twin (``pwrun.generate.generate``:
    the loaded model's own experts, every prompt in one prefill step) on ragged prompts, and no page to spare."""
    from pwrun.generate import generate
    from pwrun.model.loader import load_tokenizer

    path = default_model_dir()
    tok = load_tokenizer(path)
    texts = ["The river", "In 1905 the city council of", "Music is", "A long time ago, in a kingdom by the sea, there"]
    ids = [tok(t).input_ids for t in texts]
    ecfg = EngineConfig(block_size=4, max_batch=len(texts), max_step_tokens=16, debug_checks=True)
    e = build_dense_engine(path, ServeConfig(0, DENSE, ecfg), SamplingParams(max_new_tokens=9), ids, set(), "cpu",
                           "float32")
    assert e.info["budget_fitted"] and e.info["gpu_memory"] > 0
    layout, ppb = e.core.layout, e.core.layout.pages_per_block
    kv = sum(-(-layout.peak_pages(len(p) + 9, 4, 16) // ppb) * ppb for p in ids)
    assert e.core.pool.num_free == kv  # the experts and every request's KV, nothing more
    got = [list(o.token_ids) for o in e.run_until_done().values()]
    assert e.core.scheduler.preemptions == 0
    want, _ = generate(load_model(path, device="cpu", dtype="float32"), tok, texts, SamplingParams(max_new_tokens=9))
    assert [tok.decode(g, skip_special_tokens=True) for g in got] == [w.text for w in want]


@pytest.mark.parametrize("step_tokens", [2, 16])
def test_kernel_path_scores_what_the_reference_path_scores(tmp_path: Path, step_tokens: int) -> None:
    """bf16, a shared expert with its gate, mixed steps (chunks beside decodes): the 16-bit MoE kernels and the
    routing kernel against the reference expert loop over the same pool pages; steps of up to 2 tokens take the
    GEMV, longer ones cuBLAS' grouped GEMM over the stacked views."""
    _save_tiny(tmp_path)  # the kernels' smallest shapes, a shared expert with its gate
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = [list(range(3, 12)), [12, 13, 14], list(range(30, 37))]
    forced = [[20, 21], [30, 31], [40, 41]]
    lps = {}
    for kernels in (False, True):
        model = load_model(tmp_path, device=dev, dtype="bfloat16", experts="skip")
        spec, names = load_spec(tmp_path)
        source = StreamedExperts(tmp_path, spec, names, torch.bfloat16, torch.device("cpu"))
        cfg = ServeConfig(2**28, DENSE, EngineConfig(use_kernels=kernels, cuda_graphs=False, precompile_workers=0,
                                                     debug_checks=True, max_step_tokens=step_tokens))
        e = assemble_dense_engine(strip_experts(model, torch.device(dev)), source, cfg,
                                  SamplingParams(max_new_tokens=1), prompts, set(), forced)
        assert e.runner.use_kernels is kernels
        store = e.runner.experts
        assert isinstance(store, DenseExpertStore) and store.experts(0).stacked is not None  # expert order
        lps[kernels] = np.concatenate([o.logprobs for o in e.run_until_done().values()])
        assert lps[kernels].size == 6 and np.isfinite(lps[kernels]).all()
    np.testing.assert_allclose(lps[True], lps[False], atol=0.05)


def test_server_engine_serves_requests_that_arrive_later() -> None:
    """``pwrun serve --policy 16-bit``'s engine: no request at build, the budget provisions --max-batch requests of
    --max-model-len tokens; a request added later completes with the greedy tokens of ``pwrun generate``'s engine."""
    path = default_model_dir()
    ecfg = EngineConfig(block_size=4, max_batch=2, max_step_tokens=32, debug_checks=True)
    e = build_serving_engine(path, None, ServeConfig(64 * 2**20, DENSE, ecfg), 40, "cpu", "float32")
    assert e.info["policy"] == "16-bit" and e.core.idle and e.core.pool.count(WEIGHT) > 0
    add_requests(e, SamplingParams(max_new_tokens=5), [[7, 8, 9, 10]], set())
    got = e.run_until_done()[0].token_ids
    g = build_dense_engine(path, ServeConfig(64 * 2**20, DENSE, ecfg), SamplingParams(max_new_tokens=5),
                           [[7, 8, 9, 10]], set(), "cpu", "float32")
    assert len(got) == 5 and got == g.run_until_done()[0].token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_replay_what_eager_steps_compute(tmp_path: Path) -> None:
    """Decode steps of 1..10 sequences (the GEMV up to 2 tokens, cuBLAS' grouped GEMM from 3) replayed from the
    graphs the warm-up captured give the tokens eager steps give."""
    _save_tiny(tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 61, (n,), generator=g).tolist() for n in range(3, 13)]
    outs = {}
    for graphs in (False, True):
        ecfg = EngineConfig(max_batch=10, max_step_tokens=64, cuda_graphs=graphs, debug_checks=True)
        e = build_dense_engine(tmp_path, ServeConfig(2**30, DENSE, ecfg), SamplingParams(max_new_tokens=8), prompts,
                               set(), "cuda", "bfloat16")
        outs[graphs] = [o.token_ids for o in e.run_until_done().values()]
        if graphs:
            assert e.info["graphs_captured_at_start"] > 0 and not any(r.graph_captured for r in e.trace)
    assert outs[True] == outs[False]
