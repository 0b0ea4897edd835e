"""The serving runtime end to end on the real tiny MoE (CPU pool, synchronous copies).

- A budget larger than everything: outputs identical to the 8-bit static model's, no page moves.
- A budget that forces pressure: every request completes with its full output, q <= resident
  planes and page conservation after every step (debug checks), demotions happen, peak pool use
  stays within the pool, reloads happen once pressure eases.
- A demotion followed by a reload restores bit-identical MoE outputs; the cached per-layer kernel views
  (``KernelTables.experts``) follow the in-place table updates.
- Bad input: a budget below the floors states the minimum; another model's artifacts are refused;
  a malformed prompts file names its bad line.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from pwformat.ap import dequantize
from pwformat.errors import PagedWeightError
from pwkernels.moe.experts import APExperts
from pwkernels.moe.ref import ap_moe_ref
from pwrun.ap.artifact import APArtifact
from pwrun.ap.dense import dense_model
from pwrun.cli import app
from pwrun.core.config import EngineConfig
from pwrun.core.planner.runtime import PlannerConfig
from pwrun.core.pool import WEIGHT
from pwrun.core.request import SamplingParams
from pwrun.core.weight_policy import WeightPolicy
from pwrun.data import default_model_dir, read_text
from pwrun.engine.build import ServeConfig, build_engine
from pwrun.engine.llm_engine import LLMEngine
from pwrun.engine.report import process_age_seconds, summarize, summary_schema, summary_table
from pwrun.generate import generate
from pwrun.model.inventory import SHARED_EXPERT
from pwrun.model.loader import load_model, load_tokenizer
from pwrun.runner.experts.store import ExpertStore
from pwrun.runner.model_runner import ModelRunner
from pwrun.runner.prefill import prefill_logits

MODEL = default_model_dir()
runner = CliRunner()


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return load_tokenizer(MODEL)


def _prompts(tok, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:  # type: ignore[no-untyped-def]
    ids = tok(read_text("wikitext2")[:200_000], add_special_tokens=False, verbose=False).input_ids
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(lo, hi + 1))
        start = int(rng.integers(0, len(ids) - length))
        out.append(ids[start:start + length])
    return out


def test_big_budget_equals_static_8bit_and_moves_nothing(calibrated_artifacts: Path, tok) -> None:  # type: ignore[no-untyped-def]
    texts = ["The history of the city begins", "In 1990 the band released", "The river"]
    params = SamplingParams(max_new_tokens=12)
    base = load_model(MODEL, device="cpu")
    ref, _ = generate(dense_model(APArtifact(calibrated_artifacts), base, 8), tok, texts, params)
    ids = [tok(t).input_ids for t in texts]
    e = build_engine(MODEL, calibrated_artifacts, ServeConfig(2**30, engine=EngineConfig(debug_checks=True)),
                     params, ids, {0}, device="cpu")
    assert e.info["initial_mean_bits"] == 8.0
    outs = e.run_until_done()
    got = [tok.decode(list(outs[i].token_ids), skip_special_tokens=True) for i in range(len(texts))]
    assert got == [r.text for r in ref]
    s = summarize(e)
    assert s.demoted_blocks == s.promoted_blocks == 0 and s.bytes_host_to_device == 0
    row, d = summary_table([s]).to_pylist()[0], s.to_dict()  # the Arrow row holds what the JSON summary holds
    assert list(row) == summary_schema().names and row["policy"] == s.policy == "pagedweight"
    assert all(row[k] == (list(v.items()) if isinstance(v, dict) else v) for k, v in d.items() if k in row)
    assert all(row[k] is None for k in row if k not in d)  # fields that do not apply (e.g. no CUDA peak on the CPU)
    assert e.trace[-1].shared_bits == e.trace[-1].routed_bits == 8.0


def test_make_room_is_all_or_nothing_and_remembers_a_failure(calibrated_artifacts: Path, tok) -> None:  # type: ignore[no-untyped-def]
    """Room that lowering cannot make is refused without demoting anything (a partial demotion for a request that
    still does not fit only feeds the reloads), and the same request is not planned again while nothing that
    decides it changed; a request that fits plans and lowers."""
    reqs = _prompts(tok, 2, 20, 40)
    c = build_engine(MODEL, calibrated_artifacts, ServeConfig(2**30), SamplingParams(max_new_tokens=4), reqs,
                     set(), device="cpu").core
    assert c.planner is not None and c.wpt is not None and c.weights is not None
    calls = []
    take = c.planner.take
    c.planner.take = lambda *a, **kw: calls.append(1) or take(*a, **kw)  # type: ignore[method-assign]
    q0 = c.wpt.q.copy()
    huge = c.alloc.num_free + c.pool.cfg.num_pages  # more KV blocks than the whole pool holds
    assert not c.make_room(huge)
    assert (c.wpt.q == q0).all() and c.weights.demoted_blocks == 0 and len(calls) >= 1
    n = len(calls)
    assert not c.make_room(huge) and not c.make_room(huge + 3) and len(calls) == n  # remembered: no planning
    assert c.make_room(c.alloc.num_free + 1)  # fewer blocks missing: planned again, and it fits
    assert len(calls) > n and c.weights.demoted_blocks > 0 and (c.wpt.q <= q0).all()
    assert (c.wpt.q < q0).any()


def test_pressure_completes_every_request_within_the_pool(calibrated_artifacts: Path, tok) -> None:  # type: ignore[no-untyped-def]
    reqs = _prompts(tok, 12, 40, 160)
    params = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=3)
    probe = build_engine(MODEL, calibrated_artifacts, ServeConfig(2**30), params, reqs, set(), device="cpu").info
    # room for the experts near their floors plus a few requests' KV: the planner must demote
    budget = (probe["fixed_bytes"] + probe["workspace_bytes"] + probe["floor_expert_bytes"]
              + 60 * probe["kv_block_bytes"])
    cfg = ServeConfig(budget, engine=EngineConfig(debug_checks=True, max_batch=12, max_step_tokens=256))
    e = build_engine(MODEL, calibrated_artifacts, cfg, params, reqs, set(), device="cpu")
    # every trace row's weight figures (cached between changes of the page table) equal ones derived afresh
    checked = []
    trace_row = e._trace

    def fresh_trace(*args):  # type: ignore[no-untyped-def]
        row, wpt, page = trace_row(*args), e.core.wpt, e.core.pool.cfg.page_bytes
        assert wpt is not None
        assert row.mean_bits == wpt.q.mean() and row.bits_hist == np.bincount(wpt.q, minlength=9).tolist()
        assert row.weight_bytes == wpt.weight_pages() * page
        assert row.committed_weight_bytes == wpt.pages_at(wpt.q).sum() * page
        checked.append(row.mean_bits)
        return row

    e._trace = fresh_trace  # type: ignore[method-assign]
    outs = e.run_until_done()  # debug_checks: pool conservation and q <= resident planes asserted after every step
    assert len(checked) == len(e.trace) and len(set(checked)) > 2  # the bits changed during the run
    assert all(len(o.token_ids) == 24 and o.finish == "length" for o in outs.values())
    s = summarize(e)  # every demotion plan was taken, ready-made or made on the critical path
    c, w = e.core, e.core.weights
    assert w is not None and c.wpt is not None
    assert s.demoted_blocks == w.demoted_blocks > 0
    assert c.pool.peak_used <= c.pool.cfg.num_pages
    assert s.promoted_blocks == w.promoted_blocks > 0  # pressure eased at the end: planes came back
    assert c.planner is not None and (s.planner_plans_prepared or 0) + (s.planner_plans_fresh or 0) >= 1
    # tokens computed = every prompt and fed token once (the last sampled one is never fed) + what preemptions
    # discarded (0 when there were none)
    served = sum(q.prompt_tokens + len(q.token_ids) - 1 for q in outs.values())
    assert s.prefill_tokens + s.decode_tokens == served + s.recomputed_tokens
    assert s.recomputed_tokens == 0 or s.preemptions > 0
    trace = e.trace
    # the steps' planner seconds add up to the run's (each step's share is what the serving bench reports per decode
    # step); the planner ran on some steps' critical path
    assert sum(r.planner_seconds for r in trace) == pytest.approx(w.planner_seconds, rel=1e-9, abs=1e-12)
    assert sum(r.planner_overlapped_seconds for r in trace) == pytest.approx(w.planner_overlapped_seconds,
                                                                              rel=1e-9, abs=1e-12)
    assert max(r.planner_seconds for r in trace) > 0
    assert sum(r.demoted_blocks for r in trace) == s.demoted_blocks
    assert sum(r.promoted_blocks for r in trace) == s.promoted_blocks
    # the KV cache grew into pages the initial weights held: it could not have fit without demotions
    assert max(r.kv_pages for r in trace) > c.pool.cfg.num_pages - e.info["initial_weight_pages"]
    assert min(r.mean_bits for r in trace) < e.info["initial_mean_bits"]
    # bits per weight of the blocks every token reads (shared experts) vs the routed ones, by a plain loop
    store = e.runner.experts
    assert store is not None
    sums = {True: [0.0, 0.0], False: [0.0, 0.0]}
    for (_, expert, _), i in store.moe.index.items():
        n, k = store.moe.shape[i]
        sums[expert < 0][0] += int(c.wpt.q[i]) * n * k
        sums[expert < 0][1] += n * k
    assert sums[True][1] > 0  # the bundled model has a shared expert
    assert trace[-1].shared_bits == pytest.approx(sums[True][0] / sums[True][1])
    assert trace[-1].routed_bits == pytest.approx(sums[False][0] / sums[False][1])
    # host time by phase: the steps that started reloads spent time planning and starting them, within the step
    phases = ("poll", "refresh", "raise_plan", "raise_start", "prepare")
    started = [r for r in trace if r.reload_started_blocks > 0]
    assert started and all(r.raise_plan_seconds > 0 and r.raise_start_seconds > 0 for r in started)
    assert all(r.raise_start_seconds == 0 for r in trace if r.pressure_bytes > 0)  # lowering, no reload
    assert all(0 <= sum(getattr(r, f"{p}_seconds") for p in phases) <= r.seconds for r in trace)
    # the same workload with its seed gives the same outputs (per-request generators)
    again = build_engine(MODEL, calibrated_artifacts, cfg, params, reqs, set(), device="cpu").run_until_done()
    assert [o.token_ids for o in again.values()] == [o.token_ids for o in outs.values()]


def _parts(e: LLMEngine) -> tuple[ExpertStore, WeightPolicy]:
    assert e.runner.experts is not None and e.core.weights is not None
    return e.runner.experts, e.core.weights


def _lower_all(e: LLMEngine, bits: int) -> None:
    """Every block to ``bits`` through the engine core's page table, mirrored by the runner."""
    store, w = _parts(e)
    w.lower(np.arange(w.wpt.n), np.full(w.wpt.n, bits))
    store.apply(e.core.take_moves())


def _raise_all(e: LLMEngine, bits: int) -> tuple[list[int], list[int]]:
    """Every block to ``bits`` by a reload (started, copied, committed); the blocks started and those committed."""
    store, w = _parts(e)
    started = w.begin_raise(np.arange(w.wpt.n), np.full(w.wpt.n, bits))
    store.apply(e.core.take_moves())
    done = w.commit(store.finished_reloads())
    store.apply(e.core.take_moves())
    return started, done


def test_startup_phases_add_up_to_the_build(calibrated_artifacts: Path) -> None:
    """The summary's start-up phases name every step of the build, each timed once: together no longer than the
    build measured around them, and most of it; before it, the process's age when the build began."""
    t = time.perf_counter()
    e = build_engine(MODEL, calibrated_artifacts, ServeConfig(2**30), SamplingParams(max_new_tokens=2), [[1, 2, 3]],
                     set(), device="cpu")
    wall = time.perf_counter() - t
    age = process_age_seconds()
    phases = summarize(e).startup_seconds
    assert phases is not None
    before = phases.pop("before_build")
    assert age is not None and age - wall - 0.1 <= before <= age - wall + 0.1
    assert set(phases) == {"artifact_checks", "non_expert_weights", "tables", "kernel_precompile", "pool", "experts",
                           "warm_up"}
    assert all(v >= 0 for v in phases.values()) and 0.5 * wall <= sum(phases.values()) <= wall


def test_demote_then_reload_is_bit_identical(calibrated_artifacts: Path) -> None:
    params = SamplingParams(max_new_tokens=2)
    e = build_engine(MODEL, calibrated_artifacts, ServeConfig(2**30), params, [[1, 2, 3]], set(), device="cpu")
    store, w = _parts(e)
    spec = e.runner.model.spec
    x = torch.randn(9, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    before = [store.moe(x, layer) for layer in range(spec.num_layers)]
    free0 = e.core.pool.num_free
    _lower_all(e, 3)
    assert e.core.pool.num_free > free0
    lowered = store.moe(x, 0)
    assert not torch.equal(lowered, before[0])
    started, done = _raise_all(e, 8)
    assert started == done == list(range(w.wpt.n))
    e.core.check()
    assert e.core.pool.num_free == free0
    for layer in range(spec.num_layers):
        assert torch.equal(store.moe(x, layer), before[layer])


def test_cached_expert_views_follow_lower_and_raise(calibrated_artifacts: Path) -> None:
    """``ExpertStore.experts`` is cached per layer; the cached view reads the bits and offsets that lower and
    raise write in place: every block it addresses dequantizes to the store's dense weight (read through the
    page table, not through the view), and the kernel reference gives what a freshly built view gives."""
    params = SamplingParams(max_new_tokens=2)
    e = build_engine(MODEL, calibrated_artifacts, ServeConfig(2**30), params, [[1, 2, 3]], set(), device="cpu")
    (store, policy), layer = _parts(e), 0
    tables, spec = store.tables, e.runner.model.spec
    moe = spec.layers[layer].moe
    assert moe is not None
    kinds = ["routed", "shared"] if moe.shared_intermediate else ["routed"]
    views = {kind: tables.experts(layer, kind) for kind in kinds}
    x = torch.randn(5, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 3]]) % moe.num_experts
    w = torch.full(ids.shape, 0.5)

    def check(bits: int) -> torch.Tensor:
        for kind, ex in views.items():
            assert tables.experts(layer, kind) is ex
            experts = [SHARED_EXPERT] if kind == "shared" else range(moe.num_experts)
            for e_id in experts:
                for u, unit in enumerate(("gate_up", "down")):
                    i = store.moe.index[(layer, e_id, unit)]
                    planes, lut, _, k = ex.block(2 * (0 if kind == "shared" else e_id) + u)
                    assert planes.shape[0] == bits == int(policy.wpt.q[i])
                    assert torch.equal(dequantize(planes, lut, k, bits, e.runner.model.dtype), store.moe.dense(i))
        fresh = APExperts(tables.words, views["routed"].plane_offset.clone(), tables.lut_view,
                          views["routed"].lut_offset.clone(), views["routed"].bits.clone(), spec.hidden_size,
                          moe.expert_intermediate)
        y = ap_moe_ref(x, ids, w, views["routed"])
        assert torch.equal(y, ap_moe_ref(x, ids, w, fresh))
        return y

    y8 = check(8)
    _lower_all(e, 3)
    assert not torch.equal(check(3), y8)
    started, done = _raise_all(e, 8)
    assert started == done == list(range(policy.wpt.n))
    assert torch.equal(check(8), y8)
    tables.words = store.memory.view(torch.int32)  # a replaced tensor (same bytes): the view is rebuilt
    again = tables.experts(layer)
    assert again is not views["routed"] and again.pool is tables.words
    assert torch.equal(ap_moe_ref(x, ids, w, again), y8)


def test_expert_views_start_16_byte_aligned(calibrated_artifacts: Path) -> None:
    """Every layer's kernel tables (bits, LUT offsets, plane offsets) start 16-byte aligned: Triton compiles a kernel
    per alignment class of its pointer arguments, so a misaligned layer compiled every decode kernel a second time
    inside serving (the warm-up's fresh tensors are aligned). The bundled model has 2 x 16 routed + 2 shared rows
    per layer, so unpadded, layer 1's routed bits started 136 bytes in."""
    e = build_engine(MODEL, calibrated_artifacts, ServeConfig(2**30), SamplingParams(max_new_tokens=2), [[1, 2, 3]],
                     set(), device="cpu")
    store, _ = _parts(e)
    seen = 0
    for layer, ls in enumerate(e.runner.model.spec.layers):
        if ls.moe is None:
            continue
        for kind in ["routed", "shared"] if ls.moe.shared_intermediate else ["routed"]:
            ex = store.tables.experts(layer, kind)
            for t in (ex.bits, ex.lut_offset, ex.plane_offset):
                assert t.data_ptr() % 16 == 0, (layer, kind, t.dtype)
            seen += 1
        for t in (store.moe.mass_acc[layer], store.moe.norm_acc[layer]):  # the routing kernel's live statistics rows
            assert t.data_ptr() % 16 == 0 and t.is_contiguous(), (layer, t.shape)
    assert seen >= 4


def test_budget_too_small_states_the_minimum(calibrated_artifacts: Path) -> None:
    with pytest.raises(PagedWeightError, match=r"give at least --gpu-memory \d+MiB"):
        build_engine(MODEL, calibrated_artifacts, ServeConfig(30 * 2**20), SamplingParams(max_new_tokens=8),
                     [[1] * 20], set(), device="cpu")
    r = runner.invoke(app, ["generate", "--prompt", "Hello", "--artifacts", str(calibrated_artifacts),
                            "--gpu-memory", "1MiB", "--device", "cpu"])
    assert r.exit_code == 2 and "give at least --gpu-memory" in r.stderr and "Traceback" not in r.output


def test_other_models_artifacts_refused(calibrated_artifacts: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(MODEL, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(cfg))
    r = runner.invoke(app, ["generate", "--prompt", "Hello", "--model", str(other), "--artifacts",
                            str(calibrated_artifacts), "--device", "cpu"])
    assert r.exit_code == 2 and "error:" in r.stderr and "Traceback" not in r.output


def test_malformed_prompts_file_names_the_line(calibrated_artifacts: Path, tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    r = runner.invoke(app, ["generate", "--prompts", str(f), "--artifacts", str(calibrated_artifacts),
                            "--device", "cpu"])
    assert r.exit_code == 2 and "p.jsonl:2 is not valid JSON" in r.stderr


def test_cli_serves_a_batch_with_trace_and_policies(calibrated_artifacts: Path, tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["The city", "A river", "In 1990"]))
    out, trace = tmp_path / "out.jsonl", tmp_path / "trace.parquet"
    for policy in (["--policy", "pagedweight"], ["--policy", "uniform", "--bits", "4"], ["--policy", "static"],
                   ["--policy", "no-movement"]):
        r = runner.invoke(app, ["generate", "--prompts", str(f), "--artifacts", str(calibrated_artifacts),
                                "--gpu-memory", "64MiB", "--max-new-tokens", "6", "--device", "cpu", "--output",
                                str(out), "--trace", str(trace), "--debug-checks", *policy])
        assert r.exit_code == 0, r.stderr
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        assert len(rows) == 3 and all(x["new_tokens"] == 6 or x["finish_reason"] == "eos" for x in rows)
        assert "demoted blocks" in r.stderr and "tokens/s" in r.stderr
        done = sum(x["finish_reason"] == "length" for x in rows)
        assert "3 of 3 requests completed (" in r.stderr and (not done or f"length: {done}" in r.stderr)
    import pandas as pd

    df = pd.read_parquet(trace)
    assert len(df) >= 6 and {"free_blocks", "pressure_bytes", "mean_bits", "bytes_in_flight"} <= set(df.columns)
    r = runner.invoke(app, ["generate", "--prompt", "x", "--artifacts", str(calibrated_artifacts), "--policy",
                            "uniform", "--device", "cpu"])
    assert r.exit_code == 2 and "--bits" in r.stderr


def test_teacher_forced_scoring_matches_the_static_model(calibrated_artifacts: Path, tok) -> None:  # type: ignore[no-untyped-def]
    """Forced continuations are scored with the precision in force: at a large budget (8 bits, no moves)
    the log-probs equal a one-shot forward of the 8-bit static model over prompt + continuation."""
    reqs = _prompts(tok, 3, 10, 30, seed=5)
    cont = _prompts(tok, 3, 5, 9, seed=6)
    outs = build_engine(MODEL, calibrated_artifacts, ServeConfig(2**30), SamplingParams(max_new_tokens=1), reqs,
                        set(), device="cpu", forced=cont).run_until_done()
    dense = dense_model(APArtifact(calibrated_artifacts), load_model(MODEL, device="cpu"), 8)
    for i, (p, c) in enumerate(zip(reqs, cont, strict=True)):
        logits = prefill_logits(dense, [p + c[:-1]])
        lp = torch.log_softmax(logits[len(p) - 1:], dim=-1)
        want = lp[torch.arange(len(c)), torch.tensor(c)]
        got = torch.tensor(outs[i].logprobs)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want.float(), atol=2e-4, rtol=0)


def _tight_budget(artifacts: Path, params: SamplingParams, reqs: list[list[int]], cont: list[list[int]],
                  kv_blocks: int) -> int:
    """Bytes of a budget with the experts near their floors and room for ``kv_blocks`` KV blocks (CPU engine)."""
    probe = build_engine(MODEL, artifacts, ServeConfig(2**28), params, reqs, set(), device="cpu", forced=cont).info
    return (probe["fixed_bytes"] + probe["workspace_bytes"] + probe["floor_expert_bytes"] + 6 * 10**6
            + kv_blocks * probe["kv_block_bytes"])


def test_prepared_plans_do_not_provision_past_the_last_token(calibrated_artifacts: Path, tok) -> None:  # type: ignore[no-untyped-def]
    """Near the end of its requests the planner lowers only what they can still use: the lookahead of the
    prepared plan stops at each request's last token, so no KV blocks sit free while experts were lowered."""
    reqs, cont = _prompts(tok, 4, 100, 100, seed=7), _prompts(tok, 4, 20, 20, seed=8)
    params = SamplingParams(max_new_tokens=1)
    budget = _tight_budget(calibrated_artifacts, params, reqs, cont, 32)
    cfg = ServeConfig(budget, engine=EngineConfig(max_batch=4, debug_checks=True))
    e = build_engine(MODEL, calibrated_artifacts, cfg, params, reqs, set(), device="cpu", forced=cont)
    e.run_until_done()
    trace = [r for r in e.trace if r.running == 4]
    s = summarize(e)
    assert s.demoted_blocks > 0 and min(r.mean_bits for r in trace) < 8
    assert max(r.free_blocks for r in trace) <= PlannerConfig().free_threshold + 2
    # the bytes in force during the decode (scored) tokens: each step runs what the step before it committed
    num = den = 0
    for prev, row in zip(e.trace, e.trace[1:], strict=False):
        num += prev.committed_weight_bytes * (row.step_tokens - row.prefill_tokens)
        den += row.step_tokens - row.prefill_tokens
    assert s.weight_bytes_decode_mean is not None and den > 0
    assert s.weight_bytes_decode_mean == pytest.approx(num / den)
    # the prompts' prefill (the first step) ran at the bytes placed at the start, the decodes at the lower ones of
    # the KV peak (not against the time-weighted mean: its weights depend on how busy the cores are)
    assert e.trace[0].prefill_tokens == 400 and e.trace[0].step_tokens == 400
    assert s.weight_bytes_min <= s.weight_bytes_decode_mean < e.trace[0].committed_weight_bytes


def test_overlapped_planner_work_is_one_planner_config_field(calibrated_artifacts: Path, tok) -> None:  # type: ignore[no-untyped-def]
    """``PlannerConfig.overlapped`` alone moves planner work into the window where the device computes: on CPU it
    resolves to off (planner work after sampling, none counted as overlapped); set on, the CPU engine runs the
    CUDA order (commit and start reloads, refresh d_hat after the launch) and still serves under pressure."""
    reqs, cont = _prompts(tok, 4, 100, 100, seed=7), _prompts(tok, 4, 20, 20, seed=8)
    params = SamplingParams(max_new_tokens=1)
    budget = _tight_budget(calibrated_artifacts, params, reqs, cont, 32)
    for overlapped in (None, True):
        cfg = ServeConfig(budget, engine=EngineConfig(max_batch=4, debug_checks=True),
                          planner=PlannerConfig(overlapped=overlapped))
        e = build_engine(MODEL, calibrated_artifacts, cfg, params, reqs, set(), device="cpu", forced=cont)
        assert e.core.planner is not None and e.core.planner.cfg.overlapped is bool(overlapped)
        assert e.core.overlapped is bool(overlapped)
        outs = e.run_until_done()
        s = summarize(e)
        assert all(len(o.logprobs) == 20 for o in outs.values()) and s.demoted_blocks > 0
        assert (s.planner_overlapped_ms_per_step > 0) == bool(overlapped)


def test_plan_prepared_while_the_device_computes_counts_the_blocks_of_finishing_requests(  # type: ignore[no-untyped-def]
        calibrated_artifacts: Path, tok, monkeypatch) -> None:
    """With overlapped planner work the next demotion is planned while the step runs, before the requests at their
    length limit have freed their blocks: the pressure it plans for must equal the one computed after sampling
    (before any lowering), on a workload where requests finish at different steps under KV pressure."""
    reqs, cont = _prompts(tok, 5, 60, 100, seed=3), _prompts(tok, 5, 10, 60, seed=4)
    params = SamplingParams(max_new_tokens=1)
    budget = _tight_budget(calibrated_artifacts, params, reqs, cont, 28)
    cfg = ServeConfig(budget, engine=EngineConfig(max_batch=4, lookahead_tokens=4, debug_checks=True),
                      planner=PlannerConfig(overlapped=True))
    e = build_engine(MODEL, calibrated_artifacts, cfg, params, reqs, set(), device="cpu", forced=cont)
    window: list[tuple[int, int, int]] = []
    after: list[int] = []
    while_computing, after_step = WeightPolicy.while_computing, WeightPolicy.after_step

    def record_window(self: WeightPolicy, running: list, finishing: list[int]) -> None:  # type: ignore[type-arg]
        gone = set(finishing)
        window.append((self._next_need([s for s in running if s.rid not in gone], gone), self._next_need(running),
                       len(gone)))
        while_computing(self, running, finishing)

    def record_after(self: WeightPolicy, running: list) -> None:  # type: ignore[type-arg]
        after.append(self._next_need(running))
        after_step(self, running)

    monkeypatch.setattr(WeightPolicy, "while_computing", record_window)
    monkeypatch.setattr(WeightPolicy, "after_step", record_after)
    outs = e.run_until_done()
    assert all(len(o.logprobs) == len(c) for o, c in zip(outs.values(), cont, strict=True))
    assert [w for w, _, _ in window] == after
    assert sum(1 for _, _, f in window if f) >= 3  # requests finished at different steps
    assert summarize(e).demoted_blocks > 0
    # counted as still held, the finishing requests' blocks would have made the window plan more
    assert any(naive > w for w, naive, f in window if f)


def test_warm_up_changes_nothing_a_run_computes(calibrated_artifacts: Path, tok, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The start-up warm-up (compiles and graph captures on CUDA; forced on here, where it runs the prefill and mixed
    forwards in a scratch KV block) leaves the pool, the routing statistics and every sampled token as they were."""
    reqs = _prompts(tok, 4, 20, 60, seed=11)
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.95, seed=2)
    cfg = ServeConfig(2**30, engine=EngineConfig(debug_checks=True, max_batch=4, max_step_tokens=64))
    runs = {}
    for warm in (False, True):
        monkeypatch.setattr(ModelRunner, "wants_warm_up", property(lambda self, w=warm: w))
        e = build_engine(MODEL, calibrated_artifacts, cfg, params, reqs, set(), device="cpu")
        assert ("warm_up_seconds" in e.info) is warm
        assert e.core.pool.num_free + e.core.pool.count(WEIGHT) == e.core.pool.cfg.num_pages  # scratch block freed
        assert e.runner.experts is not None
        assert not e.runner.experts.moe.mass_acc.any() and not e.runner.experts.moe.norm_acc.any()
        runs[warm] = [o.token_ids for o in e.run_until_done().values()]
    assert runs[True] == runs[False]
