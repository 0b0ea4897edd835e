"""Serving-time evaluation (pweval) on the real tiny MoE: scores, footprints, retrieval, results table, CLI,
and the analysis notebooks executed on small artifacts.

- A uniform-8 run at a large budget scores exactly what the dense 8-bit model scores on the same tokens.
- Uniform b at its footprint U<b> serves the workload without preemption; a little less memory forces queueing.
- The static policy at the runtime's minimum budget completes without overflowing the pool.
- The retrieval scorer ranks by PMI and picks the passage the context holds; windows are seeded and disjoint.
- The results table round-trips its schema and refuses foreign files; bad CLI input gives one-line errors.
- `pwrun eval sweep --quick` writes the table, figures and markdown; every notebook runs on them.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from pweval.cli import app
from pweval.meetings import meeting_texts, qmsum_workload
from pweval.results import SCHEMA, append_rows, read_results, read_scores, rename, request_scores
from pweval.retrieval import RetrievalItem, RetrievalSpec, build_items, retrieval_workload, scores
from pweval.retrieval import accuracy as retrieval_accuracy
from pweval.runs import Evaluator, TextSpec
from pweval.scoring import reference_logprobs
from pweval.tables import paired_change, targets
from pweval.workload import Request, Workload, text_workload
from pwformat.cost import kv_block_bytes
from pwformat.errors import PagedWeightError
from pwrun.data import default_model_dir

MODEL = default_model_dir()
runner = CliRunner()
SMALL = TextSpec(per_dataset=3, prompt_tokens=40, continuation_tokens=8, max_batch=6, max_step_tokens=128)


@pytest.fixture(scope="module")
def ev(calibrated_artifacts: Path) -> Evaluator:
    return Evaluator(MODEL, calibrated_artifacts)


def test_uniform8_at_a_large_budget_equals_the_dense_8bit_model(ev: Evaluator) -> None:
    suite = ev.text_suite(SMALL)
    big = ev.footprint(suite, 8).total + 2**20
    row = ev.run(suite, "uniform", big, bits=8)
    runtime_lps = ev.last.logprobs
    ref = ev.reference(suite, bits=8)
    assert row["demoted_blocks"] == row["promoted_blocks"] == 0
    for task in ("wikitext2", "c4"):
        assert row[f"{task}_tokens"] == ref[f"{task}_tokens"] == 3 * 8
        assert row[f"{task}_ppl"] == pytest.approx(ref[f"{task}_ppl"], rel=2e-4)
    for a, b in zip(runtime_lps, ev.last.logprobs, strict=True):
        np.testing.assert_allclose(a, b, atol=3e-4)
    # 16-bit reference: not the 8-bit model's numbers, and charged the 16-bit expert bytes
    r16 = ev.reference(suite)
    assert r16["expert_bytes_mean"] == r16["expert_bytes_16bit"] and r16["wikitext2_ppl"] != ref["wikitext2_ppl"]


def test_uniform_footprint_is_tight_and_static_runs_at_the_minimum(ev: Evaluator) -> None:
    suite = ev.text_suite(SMALL)
    kv = ev.measure_peak_kv(suite)
    assert 0 < kv <= ev.footprint(suite, 16).kv
    fp = ev.footprint(suite, 4)
    at = ev.run(suite, "uniform", fp.total, "U4", bits=4)
    assert at["preemptions"] == 0 and at["expert_bytes_mean"] == fp.experts
    full = ev.last.trace
    spec, a = ev.model.spec, ev.model.spec.layers[0].attention
    kv_block = kv_block_bytes(spec.num_layers, suite.engine.block_size, a.num_kv_heads, a.head_dim,
                              ev.model.dtype.itemsize)
    less = ev.run(suite, "uniform", fp.total - 2 * kv_block, "custom", bits=4)
    trace = ev.last.trace
    assert full is not None and trace is not None
    assert less["preemptions"] > 0 or trace.running.max() < full.running.max()  # it had to queue
    assert less["wikitext2_ppl"] == pytest.approx(at["wikitext2_ppl"], rel=1e-5)  # static weights: same scores
    low = ev.minimum(suite, "static")
    row = ev.run(suite, "static", low, "min")
    assert math.isfinite(row["wikitext2_ppl"])
    bad = ev.run(suite, "pagedweight", low // 2, "custom", infeasible_ok=True)
    assert bad["note"].startswith("infeasible") and "wikitext2_ppl" not in bad


def test_text_windows_are_seeded_disjoint_and_interleaved(ev: Evaluator) -> None:
    a = text_workload(ev.tokenizer, ("wikitext2", "c4"), 5, 30, 10, seed=3, max_context=2048)
    b = text_workload(ev.tokenizer, ("wikitext2", "c4"), 5, 30, 10, seed=3, max_context=2048)
    c = text_workload(ev.tokenizer, ("wikitext2", "c4"), 5, 30, 10, seed=4, max_context=2048)
    assert a == b and a != c
    assert [r.task for r in a.requests[:4]] == ["wikitext2", "c4", "wikitext2", "c4"]
    assert all(len(r.prompt) == 30 and len(r.continuation) == 10 for r in a.requests)
    wiki = [r.prompt + r.continuation for r in a.requests if r.task == "wikitext2"]
    assert len(set(wiki)) == 5
    with pytest.raises(PagedWeightError, match="exceeds the model's context"):
        text_workload(ev.tokenizer, ("c4",), 1, 2000, 100, seed=0, max_context=2048)
    with pytest.raises(PagedWeightError, match="room for"):
        text_workload(ev.tokenizer, ("c4",), 10**6, 30, 10, seed=0, max_context=2048)


def test_qmsum_meetings_are_long_real_text(ev: Evaluator) -> None:
    texts = meeting_texts()
    assert len(texts) == 35 and min(len(t) for t in texts) > 10_000 and ": " in texts[0][:100]
    wl = qmsum_workload(ev.tokenizer, 3, 2, 200, 20, seed=0)
    assert len(wl.requests) == 6 and {r.task for r in wl.requests} == {"qmsum"}


def test_retrieval_scorer_uses_pmi_and_picks_the_passage_in_context(ev: Evaluator) -> None:
    # constructed scores: raw likelihood favours passage 1, the context raises passage 0 the most
    item = RetrievalItem((5, 6, 7), (7,), ((1, 2), (3, 4), (8, 9)), answer=0)
    reqs = retrieval_workload([item]).requests
    lp = {(0, "retrieval"): -4.0, (0, "retrieval-prior"): -9.0, (1, "retrieval"): -2.0,
          (1, "retrieval-prior"): -2.5, (2, "retrieval"): -8.0, (2, "retrieval-prior"): -8.0}
    logprobs = [np.array([lp[(r.candidate, r.task)] / 2] * 2) for r in reqs]
    np.testing.assert_allclose(scores([item], reqs, logprobs), [[5.0, 0.5, 0.0]])
    assert retrieval_accuracy([item], reqs, logprobs) == 1.0
    # the real model: a context that holds just the passage (twice) makes it the clear winner
    spec = RetrievalSpec(questions=6, context_tokens=240, candidates=3, answer_tokens=12, seed=1)
    items = build_items(ev.tokenizer, spec)
    assert all(len(it.context) <= 240 and len(it.candidates) == 3 for it in items)
    assert all(len(set(it.candidates)) == 3 for it in items)
    for it in items:  # the answer's passage is the opening of a context paragraph, verbatim
        ans = it.candidates[it.answer]
        assert any(it.context[i:i + len(ans)] == ans for i in range(len(it.context)))
    easy = [RetrievalItem((*it.candidates[it.answer], *it.separator) * 2, it.separator, it.candidates, it.answer)
            for it in items]
    wl = retrieval_workload(easy)
    assert retrieval_accuracy(easy, wl.requests, reference_logprobs(ev.model, wl).logprobs) == 1.0
    with pytest.raises(PagedWeightError):
        RetrievalSpec(context_tokens=64, candidates=4, answer_tokens=24)


def test_results_table_round_trip_and_refusals(tmp_path: Path) -> None:
    path = tmp_path / "r.parquet"
    row = {"suite": "text", "policy": "uniform", "bits": 4, "budget": "U4", "gpu_memory": 123, "wikitext2_ppl": 1.5,
           "c4_ppl": math.nan, "preemptions": 2}
    append_rows(path, [row])
    append_rows(path, [{**row, "bits": None, "policy": "pagedweight", "note": "x"}])
    df = read_results(path)
    assert list(df.columns) == SCHEMA.names and len(df) == 2
    assert df.bits.iloc[0] == 4 and pd.isna(df.bits.iloc[1]) and pd.isna(df.c4_ppl.iloc[0])
    assert df.wikitext2_ppl.tolist() == [1.5, 1.5] and df.note.iloc[1] == "x"
    assert not list(tmp_path.glob("*.tmp"))
    assert read_scores(path).empty
    sc = request_scores("b", ["c4", "c4", "wikitext2"], [np.array([-1.0, -2.0]), np.array([-3.0]), np.array([-1.0])])
    append_rows(path, [{**row, "run_id": "b"}], sc)
    got = read_scores(path)
    assert got.nll.tolist() == [3.0, 3.0, 1.0] and got.tokens.tolist() == [2, 1, 1] and set(got.run_id) == {"b"}
    rename(path, tmp_path / "final.parquet")
    assert len(read_results(tmp_path / "final.parquet")) == 3 and len(read_scores(tmp_path / "final.parquet")) == 3
    with pytest.raises(ValueError, match="outside the schema"):
        append_rows(path, [{**row, "colour": "red"}])
    foreign = tmp_path / "f.parquet"
    pd.DataFrame({"a": [1]}).to_parquet(foreign)
    with pytest.raises(PagedWeightError, match="not an eval results table"):
        append_rows(foreign, [row])
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(PagedWeightError, match="not a readable Parquet"):
        read_results(tmp_path / "junk.parquet")


def test_paired_change_of_two_runs() -> None:
    rng = np.random.default_rng(0)
    base = rng.normal(4.0, 1.0, size=200)
    rows = [{"run_id": run, "request": k, "task": "c4", "nll": 10 * (base[k] + shift + rng.normal(0, 0.01)),
             "tokens": 10} for run, shift in (("a", 0.02), ("b", 0.0)) for k in range(200)]
    df = pd.DataFrame(rows)
    point, lo, hi = paired_change(df, "a", "b", "c4")  # type: ignore[misc]
    assert point == pytest.approx(math.expm1(0.02), abs=2e-3) and lo < point < hi and lo > 0
    assert paired_change(df, "a", "zz", "c4") is None


def _eval(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, list(args))
    return r.exit_code, r.stderr


@pytest.mark.parametrize("args, message", [
    (["run", "--out", "x.csv"], "must end in .parquet"),
    (["run", "--out", "{tmp}/r.parquet", "--suite", "poem"], "unknown --suite"),
    (["run", "--out", "{tmp}/r.parquet", "--policy", "uniform", "--gpu-memory", "64MiB"], "needs --bits"),
    (["run", "--out", "{tmp}/r.parquet", "--policy", "fast", "--gpu-memory", "64MiB"], "unknown --policy"),
    (["run", "--out", "{tmp}/r.parquet", "--gpu-memory", "lots"], "cannot read the size"),
    (["run", "--out", "{tmp}/r.parquet", "--gpu-memory", "U9"], "unknown budget"),
    (["run", "--out", "{tmp}/r.parquet", "--gpu-memory", "1MiB"], "give at least --gpu-memory"),
    (["run", "--out", "{tmp}/r.parquet", "--gpu-memory", " , "], "needs at least one budget"),
    (["run", "--out", "{tmp}/r.parquet", "--policy", "16-bit", "--bits", "4"], "no --bits"),
    (["run", "--out", "{tmp}/r.parquet", "--policy", "16-bit", "--gpu-memory", "1MiB"], "--gpu-memory or --trace"),
    (["run", "--out", "{tmp}/r.parquet", "--policy", "bogus"], "uniform, static, 16-bit"),
    (["run", "--out", "{tmp}/r.parquet", "--prompt-tokens", "4000"], "exceeds the model's context"),
    (["run", "--out", "{tmp}/missing/r.parquet"], "/missing does not exist; create it"),
    (["report", "--results", "{tmp}/none.parquet"], "does not exist"),
    (["run", "--out", "{tmp}/r.parquet", "--reload-reserve", "soon"], "--reload-reserve 'soon' is not allowed"),
    (["run", "--out", "{tmp}/r.parquet", "--damage", "{tmp}/none.parquet"], "no such file"),
    (["run", "--out", "{tmp}/r.parquet", "--damage", "{tmp}", "--gpu-memory", "U4"], "no such file"),
    (["sweep", "--out", "{tmp}/s", "--oracle", "{tmp}/none.parquet"], "no such file"),
    (["sweep", "--out", "{tmp}/s", "--oracle", "pyproject.toml"], "cannot read the damage table"),
    (["run", "--out", "{tmp}/r.parquet", "--policy", "no-sensitivity", "--damage", "pyproject.toml"],
     "does not rank blocks"),
    (["run", "--out", "{tmp}/r.parquet", "--gpu-memory", "U4,5"], "is 5 bytes"),
    (["run", "--out", "{tmp}/r.parquet", "--gpu-memory", "U4.0"], "written as U4 or U4.5"),
    (["run", "--out", "{tmp}/r.parquet", "--gpu-memory", "U\u0664"], "unknown budget"),
])
def test_cli_bad_input_gives_one_line_errors(calibrated_artifacts: Path, tmp_path: Path, args: list[str],
                                             message: str) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    extra = ["--artifacts", str(calibrated_artifacts), "--requests", "2", "--continuation-tokens", "4"] \
        if args[0] == "run" else ["--artifacts", str(calibrated_artifacts)] if args[0] == "sweep" else []
    code, err = _eval(*args, *extra)
    assert code == 2 and message in err and "Traceback" not in err
    assert err.count("\n") == 1, err


def test_cli_run_appends_rows_and_writes_a_trace(calibrated_artifacts: Path, tmp_path: Path) -> None:
    out, trace = tmp_path / "r.parquet", tmp_path / "t.parquet"
    small = ["--requests", "2", "--prompt-tokens", "32", "--continuation-tokens", "6", "--concurrency", "4",
             "--artifacts", str(calibrated_artifacts)]
    code, err = _eval("run", "--out", str(out), "--gpu-memory", "U5,64MiB", "--trace", str(trace), *small)
    assert code == 0, err
    code, err = _eval("run", "--out", str(out), "--policy", "16-bit", *small)
    assert code == 0, err
    df = read_results(out)
    assert df.policy.tolist() == ["pagedweight", "pagedweight", "16-bit"]
    assert df.budget.tolist() == ["U5", "custom", "FP16"] and df.gpu_memory.iloc[1] == 64 * 2**20
    assert (df.wikitext2_tokens == 12).all() and df.c4_ppl.notna().all()
    sens = pd.read_parquet(calibrated_artifacts / "sensitivity.parquet").rename(columns={"sensitivity": "kl"})
    sens.to_parquet(tmp_path / "damage.parquet")
    for policy in ("static", "pagedweight"):
        code, err = _eval("run", "--out", str(tmp_path / "o.parquet"), "--policy", policy, "--damage",
                          str(tmp_path / "damage.parquet"), "--gpu-memory", "U4", *small)
        assert code == 0, err
    assert read_results(tmp_path / "o.parquet").policy.tolist() == ["oracle", "pagedweight+oracle"]
    for extra in (["--reload-reserve", "last"], ["--reload-reserve", "32"],
                  ["--reload-reserve", "16", "--damage", str(tmp_path / "damage.parquet")]):
        code, err = _eval("run", "--out", str(tmp_path / "v.parquet"), "--gpu-memory", "U4", *extra, *small)
        assert code == 0, err
    assert read_results(tmp_path / "v.parquet").policy.tolist() == [  # the default 32 is plain pagedweight
        "pagedweight+reservelast", "pagedweight", "pagedweight+oracle+reserve16"]
    t = pd.read_parquet(trace)
    assert {"free_blocks", "pressure_bytes", "mean_bits", "bits_hist"} <= set(t.columns)
    pd.DataFrame({"a": [1]}).to_parquet(tmp_path / "foreign.parquet")
    code, err = _eval("run", "--out", str(tmp_path / "foreign.parquet"), *small)
    assert code == 2 and "not an eval results table" in err


@pytest.fixture(scope="module")
def quick_sweep(calibrated_artifacts: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    # a stand-in damage table: the sensitivities reversed in rank within each bitwidth, so that the oracle's static
    # allocation differs from the Hessian's
    sens = pd.read_parquet(calibrated_artifacts / "sensitivity.parquet")
    sens["kl"] = 1.0 / sens.sensitivity.clip(lower=1e-30) * 1e-6 / (sens.bits - 2.0) ** 3
    sens[["layer", "expert", "unit", "bits", "kl"]].to_parquet(out / "damage.parquet")
    code, err = _eval("sweep", "--quick", "--out", str(out), "--artifacts", str(calibrated_artifacts), "--oracle",
                      str(out / "damage.parquet"))
    assert code == 0, err
    return out


def test_quick_sweep_writes_the_table_figures_and_markdown(quick_sweep: Path) -> None:
    names = {p.name for p in quick_sweep.iterdir()}
    assert {"results.parquet", "quality_memory.png", "expert_memory.png", "long_context.png", "quality_memory.md",
            "long_context.md", "ablations.md", "targets.md", "trace_text.parquet"} <= names
    df = read_results(quick_sweep / "results.parquet")
    text = df[df.suite == "text"]
    assert set(text.policy) == {"16-bit", "uniform", "pagedweight", "static", "no-routing", "residual",
                                "no-movement", "no-sensitivity", "oracle"}
    oracle, static = text[text.policy == "oracle"], text[text.policy == "static"]
    assert sorted(oracle.budget) == sorted(b for b in static.budget if b != "min")
    assert oracle.note.isna().all() and (df[df.suite == "long"].policy != "oracle").all()
    # ranked by the other table, the oracle's allocation is another one at some budget
    both = oracle.merge(static, on="budget", suffixes=("_o", "_s"))
    assert (both.mean_bits_o != both.mean_bits_s).any() or (both.wikitext2_ppl_o != both.wikitext2_ppl_s).any()
    assert text[text.policy == "uniform"].preemptions.eq(0).all()
    assert set(df.suite) == {"text", "long"} and df[df.suite == "long"].retrieval_acc.notna().all()
    md = (quick_sweep / "targets.md").read_text()
    assert "## (a)" in md and ("the oracle at" in md or "never within 1%" in md)
    mem = text[text.policy == "pagedweight"].set_index("budget").gpu_memory
    assert abs(mem["U3.5"] - (mem["U3"] + mem["U4"]) / 2) <= 1  # a fractional label interpolates
    assert "w/o routing" in (quick_sweep / "ablations.md").read_text()


def test_targets_without_uniform_runs_say_not_evaluated(quick_sweep: Path) -> None:
    df = read_results(quick_sweep / "results.parquet")
    md = targets(df[df.policy != "uniform"])
    assert "**not evaluated: no uniform run" in md and "no uniform run | | | n/a" in md
    assert "met at every budget" not in md
    assert "not evaluated: no uniform run" not in targets(df)  # with the uniform runs the verdicts are there


def test_notebooks_run_on_small_artifacts(calibrated_artifacts: Path, quick_sweep: Path, tmp_path: Path) -> None:
    pytest.importorskip("nbclient")
    from pweval.notebooks import execute_all

    pngs = execute_all(calibrated_artifacts, quick_sweep / "results.parquet", quick_sweep / "trace_text.parquet",
                       tmp_path)
    assert {p.name for p in pngs} >= {"routing_mass.png", "sensitivity.png", "residual_heads.png",
                                      "quality_memory.png", "runtime_timeline.png"}


def test_workload_refuses_empty_requests() -> None:
    with pytest.raises(PagedWeightError):
        Workload("x", (Request((1,), (), "c4"),))
