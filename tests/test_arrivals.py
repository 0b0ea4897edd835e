"""Requests arriving over time (``pwrun.core.arrivals``, ``LLMEngine.run_until_done``) on the real tiny MoE (CPU).

- A Poisson schedule from a seed: first at t=0, mean gap ~ 1/rate, gaps spread like an exponential's, the same
  seed the same times; rate inf is every request at t=0.
- A trace file's ``arrival_s``: read per line; a bad value or a file giving it on some lines only is refused
  naming file:line; the CLI refuses a file with times together with --request-rate.
- Requests arriving while others decode complete in full with the greedy text of all arriving at t=0; a request
  arriving when the KV pool is full waits and completes, never dropped or truncated; a rate of inf runs exactly
  the steps of the plain loop of before.
- The reported TTFT, TPOT, queueing and goodput agree with the per-request timestamps, recomputed here.
- The trace's wall clock (``t_s``) never goes back and covers the idle gaps between arrivals.
A fake clock (advanced by each step and by the engine's sleeps) keeps the engine runs fast and deterministic.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from _artifacts import one_error, quantize_fast
from typer.testing import CliRunner

from pwformat.errors import PagedWeightError
from pwrun.cli import app
from pwrun.core.arrivals import ArrivalSchedule, read_trace_arrivals
from pwrun.core.config import EngineConfig
from pwrun.core.engine_core import EngineCore
from pwrun.core.kv_blocks import blocks_needed
from pwrun.core.latency import SLO, RequestTimes, latency_stats
from pwrun.core.pool import PagePool, PoolConfig
from pwrun.core.request import SamplingParams
from pwrun.data import default_model_dir, read_jsonl_field
from pwrun.engine.build import add_requests, dense_engine
from pwrun.engine.llm_engine import LLMEngine
from pwrun.engine.report import wall_fields
from pwrun.engine.trace import trace_table
from pwrun.model.inventory import kv_layout
from pwrun.model.lean import LeanMoEModel
from pwrun.model.loader import load_model, load_tokenizer
from pwrun.runner.model_runner import ModelRunner

MODEL = default_model_dir()
runner = CliRunner()
TEXTS = ["The history of the city begins with a small settlement on the river bank, where the first",
         "In 1990 the band released their second album, which was recorded in a studio in London and",
         "The station opened in the nineteenth century and was rebuilt twice after fires destroyed the",
         "A new species of frog was described by scientists working in the forests of the northern"]
STEP_S = 0.01  # fake seconds per engine step


class FakeClock:
    """Seconds that pass only when the engine sleeps or its model runs (``STEP_S`` per step)."""

    def __init__(self) -> None:
        self.t = 100.0
        self.slept: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def _fake_time(e: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    clock = FakeClock()
    e.clock, e.sleep = clock.now, clock.sleep
    execute = e.runner.execute

    def timed(*args: Any) -> Any:  # a step's start (first scheduled) and its end (tokens) are STEP_S apart
        clock.t += STEP_S
        return execute(*args)

    monkeypatch.setattr(e.runner, "execute", timed)
    return clock


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def lm() -> LeanMoEModel:
    return load_model(MODEL, device="cpu")


@pytest.fixture(scope="module")
def ids(tok) -> list[list[int]]:  # type: ignore[no-untyped-def]
    out = [tok(t).input_ids for t in TEXTS]
    assert all(len(x) > 16 for x in out)  # each prompt fills more than one KV block (the tight-pool test)
    return out


PARAMS = SamplingParams(max_new_tokens=6)


@pytest.fixture(scope="module")
def at_once(lm: LeanMoEModel, ids: list[list[int]]) -> list[tuple[int, ...]]:
    """Greedy tokens of every request arriving at t=0 (no EOS: each runs its full length)."""
    outs = dense_engine(lm, PARAMS, ids, set()).run_until_done()
    assert all(len(o.token_ids) == PARAMS.max_new_tokens for o in outs.values())
    return [outs[i].token_ids for i in range(len(ids))]


# ---------------------------------------------------------------- schedules
def test_poisson_schedule_statistics_from_a_seed() -> None:
    rate, n = 4.0, 20_000
    s = ArrivalSchedule.poisson(n, rate, seed=7)
    t = np.array(s.times)
    gaps = np.diff(t)
    assert t[0] == 0 and (gaps >= 0).all() and len(t) == n and s.rate == rate
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)  # ~ 1/rate (sd of the mean ~0.7% here)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # an exponential's spread
    assert np.mean(gaps > 1 / rate) == pytest.approx(math.exp(-1), abs=0.02)  # P(gap > mean) = 1/e
    assert ArrivalSchedule.poisson(n, rate, seed=7) == s  # reproducible
    assert ArrivalSchedule.poisson(n, rate, seed=8).times != s.times
    inf = ArrivalSchedule.poisson(5, math.inf, seed=7)
    assert inf.times == (0.0,) * 5 and inf.all_at_once and math.isinf(inf.rate)
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="rate"):
            ArrivalSchedule.poisson(3, bad)
    with pytest.raises(ValueError, match="request 1"):
        ArrivalSchedule((0.0, -0.5), 1.0)
    tr = ArrivalSchedule.from_times([2.0, 0.0, 1.0, 1.0])
    assert tr.order() == [1, 2, 3, 0] and tr.rate == pytest.approx(3 / 2.0)


def test_trace_file_arrivals_are_validated(tmp_path: Path) -> None:
    def write(*rows: Any) -> Path:
        p = tmp_path / "t.jsonl"
        p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
        return p

    assert read_trace_arrivals(write({"prompt": "a", "arrival_s": 0}, "", {"prompt": "b", "arrival_s": 1.5})) == \
        [0.0, 1.5]
    assert read_trace_arrivals(write({"prompt": "a"}, {"prompt": "b"})) is None
    for bad, shown in ((-1, "-1"), ("3", '"3"'), (True, "true"), (None, "null")):
        with pytest.raises(PagedWeightError, match=re.escape(f"t.jsonl:3 has 'arrival_s': {shown};")):
            read_trace_arrivals(write({"prompt": "a", "arrival_s": 0}, "", {"prompt": "b", "arrival_s": bad}))
    # Python's json reads NaN and Infinity (an extension of JSON)
    with pytest.raises(PagedWeightError, match=re.escape("t.jsonl:2 has 'arrival_s': NaN")):
        read_trace_arrivals(write({"prompt": "a", "arrival_s": 0}, '{"prompt": "b", "arrival_s": NaN}'))
    with pytest.raises(PagedWeightError, match=re.escape("t.jsonl:2 has 'arrival_s': Infinity")):
        read_trace_arrivals(write({"prompt": "a", "arrival_s": 0}, '{"prompt": "b", "arrival_s": Infinity}'))
    with pytest.raises(PagedWeightError, match=re.escape("t.jsonl:2 has no 'arrival_s' but line 1 has one")):
        read_trace_arrivals(write({"prompt": "a", "arrival_s": 0}, {"prompt": "b"}))
    # a gzipped prompts file (which the prompt reader takes) gives its times too; a latin-1 one names its line
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"prompt": "a", "arrival_s": 0.5}\n\n{"prompt": "b", "arrival_s": 2}\n'))
    assert read_trace_arrivals(gz) == [0.5, 2.0] and read_jsonl_field(gz, "prompt") == ["a", "b"]
    latin = tmp_path / "l.jsonl"
    latin.write_bytes(b'{"prompt": "a", "arrival_s": 0}\n{"prompt": "caf\xe9", "arrival_s": 1}\n')
    with pytest.raises(PagedWeightError, match=re.escape("l.jsonl:2 (byte 0xe9) is not UTF-8 text")):
        read_trace_arrivals(latin)
    # the CLI: one error line, before any model is loaded
    base = ["generate", "--device", "cpu", "--max-new-tokens", "2", "--prompts"]
    p = write({"prompt": "a", "arrival_s": 0}, {"prompt": "b", "arrival_s": -2})
    one_error(runner.invoke(app, [*base, str(p)]), "t.jsonl:2", "arrival_s", ">= 0")
    p = write({"prompt": "a", "arrival_s": 0}, {"prompt": "b", "arrival_s": 1})
    one_error(runner.invoke(app, [*base, str(p), "--request-rate", "2"]), "drop --request-rate 2")
    one_error(runner.invoke(app, [*base, str(p), "--slo-ttft-ms", "0"]), "--slo-ttft-ms")
    p = write({"prompt": "a"})
    one_error(runner.invoke(app, [*base, str(p), "--request-rate", "0"]), "--request-rate 0", "> 0")
    # arrivals too far away to be meant (no overflowing sleep after the first requests ran), a negative seed, and
    # one file named by two options
    two = tmp_path / "two.jsonl"
    two.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    one_error(runner.invoke(app, [*base, str(two), "--request-rate", "1e-300"]), "--request-rate 1e-300")
    far = tmp_path / "far.jsonl"
    far.write_text('{"prompt": "a", "arrival_s": 0}\n{"prompt": "b", "arrival_s": 1e300}\n')
    one_error(runner.invoke(app, [*base, str(far)]), "far.jsonl", "1e+300 s")
    one_error(runner.invoke(app, [*base, str(p), "--request-rate", "5", "--arrival-seed", "-1"]), "--arrival-seed -1")
    same = tmp_path / "o.json"
    one_error(runner.invoke(app, [*base, str(p), "--output", str(same), "--policy", "16-bit", "--summary-json",
                                  str(same)]), "--output and --summary-json name the same file")
    one_error(runner.invoke(app, [*base, str(p), "--output", str(p)]), "--prompts and --output")
    assert "Requests per second" in runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "300"}).stdout


# ---------------------------------------------------------------- the run loop
def test_requests_arriving_while_others_decode_complete_in_full(lm: LeanMoEModel, ids: list[list[int]],
                                                                at_once: list[tuple[int, ...]],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    arrivals = ArrivalSchedule.from_times([0.0, 0.025, 0.031, 0.5])  # the last after the others finished
    e = dense_engine(lm, PARAMS, ids, set(), arrivals=arrivals)
    clock = _fake_time(e, monkeypatch)
    assert not e.idle and e.next_arrival == 0.025 and len(e.core.scheduler.waiting) == 1  # only t=0 is queued
    outs = e.run_until_done()
    assert [outs[i].token_ids for i in range(len(ids))] == at_once  # same greedy text, full length
    t = e.times
    assert all(t[i].arrival == arrivals.times[i] for i in range(len(ids)))
    # requests 1 and 2 arrived while request 0 decoded (after its first token, before its last)
    for i in (1, 2):
        assert t[0].first_token < t[i].arrival < t[0].finish  # type: ignore[operator]
        assert t[i].arrival <= t[i].scheduled < t[i].arrival + STEP_S  # type: ignore[operator]
        assert t[i].first_token == pytest.approx(t[i].scheduled + STEP_S)  # type: ignore[operator]
    # the engine went idle before request 3: it slept to its arrival (once), it did not spin
    assert len(clock.slept) == 1 and t[3].scheduled == pytest.approx(0.5)
    assert max(t[i].finish for i in range(3)) < 0.5  # type: ignore[type-var]
    assert e.idle and e.next_arrival is None


def test_a_request_arriving_when_the_pool_is_full_waits_and_completes(lm: LeanMoEModel, ids: list[list[int]],
                                                                      at_once: list[tuple[int, ...]],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A KV pool of one request's blocks: each later request waits for the one before to finish."""
    cfg = EngineConfig(max_batch=8, max_step_tokens=256, cuda_graphs=False, debug_checks=True)
    layout = kv_layout(lm.spec)
    page_bytes = layout.page_bytes(cfg.block_size, lm.dtype.itemsize)
    longest = max(len(r) for r in ids) + PARAMS.max_new_tokens
    num_pages = blocks_needed(longest, cfg.block_size) * layout.pages_per_block
    e = LLMEngine(EngineCore(cfg, PagePool(PoolConfig(num_pages, page_bytes)), layout),
                  ModelRunner(lm, cfg, num_pages, page_bytes))
    arrivals = ArrivalSchedule.from_times([0.0, 0.015, 0.016, 0.017])
    add_requests(e, PARAMS, ids, set(), arrivals=arrivals)
    _fake_time(e, monkeypatch)
    outs = e.run_until_done()
    assert [outs[i].token_ids for i in range(len(ids))] == at_once  # all complete, in full, none truncated
    assert all(o.finish == "length" and o.preemptions == 0 for o in outs.values())
    t = e.times
    for i in (1, 2, 3):  # arrived while request i-1 (or one before it) held the pool; ran only after it finished
        assert t[i].arrival < t[i - 1].finish <= t[i].scheduled  # type: ignore[operator]
        assert t[i].queueing > 0.03  # type: ignore[operator]
    assert e.core.pool.peak_used <= num_pages


def test_rate_inf_runs_the_plain_loop_of_before(lm: LeanMoEModel, ids: list[list[int]],
                                                at_once: list[tuple[int, ...]]) -> None:
    e = dense_engine(lm, PARAMS, ids, set(), arrivals=ArrivalSchedule.poisson(len(ids), math.inf, seed=3))
    slept: list[float] = []
    e.sleep = slept.append
    outs = e.run_until_done()
    plain = dense_engine(lm, PARAMS, ids, set())
    while not plain.core.idle:  # the loop every run had before arrival times
        plain.step()
    assert [outs[i].token_ids for i in range(len(ids))] == at_once == \
        [plain.outputs[i].token_ids for i in range(len(ids))]
    assert [r.step_tokens for r in e.trace] == [r.step_tokens for r in plain.trace] and not slept
    assert all(t.arrival == 0 for t in e.times.values())
    assert len({t.scheduled for t in e.times.values()}) == 1  # everything was scheduled in the first step


def test_a_request_aborted_before_it_arrives_never_runs(lm: LeanMoEModel, ids: list[list[int]],
                                                         at_once: list[tuple[int, ...]]) -> None:
    e = dense_engine(lm, PARAMS, ids[:2], set(), arrivals=ArrivalSchedule.from_times([0.0, 5.0]))
    slept: list[float] = []
    e.sleep = slept.append
    out = e.abort(1)
    assert out.finish == "abort" and out.token_ids == () and out.prompt_tokens == len(ids[1])
    outs = e.run_until_done()
    assert not slept and list(outs) == [0] and outs[0].token_ids == at_once[0] and 1 not in e.times


def test_latency_stats_agree_with_the_timestamps() -> None:
    """Hand-made timestamps: percentiles by sorting, goodput by counting."""
    rng = np.random.default_rng(0)
    times = []
    for _ in range(37):
        a = float(rng.uniform(0, 5))
        s = a + float(rng.exponential(0.3))
        f1 = s + float(rng.uniform(0.01, 0.2))
        n = int(rng.integers(1, 20))
        times.append(RequestTimes(a, s, f1, f1 + (n - 1) * float(rng.uniform(0.005, 0.05)), n))

    def pct(xs: list[float], q: float) -> float:  # linear interpolation between closest ranks
        xs = sorted(xs)
        k = (len(xs) - 1) * q / 100
        lo = math.floor(k)
        return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)

    st = latency_stats(times, SLO(ttft_ms=300, tpot_ms=30))
    ttft = [x.first_token - x.arrival for x in times]  # type: ignore[operator]
    tpot = [1e3 * (x.finish - x.first_token) / (x.tokens - 1) for x in times if x.tokens > 1]  # type: ignore[operator]
    queue = [x.scheduled - x.arrival for x in times]  # type: ignore[operator]
    for got, want in ((st.ttft_p50_s, pct(ttft, 50)), (st.ttft_p99_s, pct(ttft, 99)),
                      (st.tpot_p50_ms, pct(tpot, 50)), (st.tpot_p99_ms, pct(tpot, 99)),
                      (st.queue_p50_s, pct(queue, 50)), (st.queue_p99_s, pct(queue, 99))):
        assert got == pytest.approx(want, rel=1e-12)
    met = sum(tt <= 0.3 and (x.tokens < 2 or (x.finish - x.first_token) / (x.tokens - 1) <= 0.03)  # type: ignore[operator]
              for tt, x in zip(ttft, times, strict=True))
    end = max(x.finish for x in times)  # type: ignore[type-var]
    assert 0 < met < len(times) and st.requests_met_slo == met and st.requests_completed == len(times)
    assert st.duration_s == end and st.goodput_rps == pytest.approx(met / end)
    assert latency_stats(times).goodput_rps == pytest.approx(len(times) / end)  # no SLO: every completed request


def test_cli_summary_and_output_times_agree(tok, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``pwrun generate`` with a trace file under a budget (uniform 4 bits): the summary's numbers are the
    statistics of the --output lines' timestamps; the text equals that of all arriving at t=0."""
    art = tmp_path / "art"
    quantize_fast(art)
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"prompt": p, "arrival_s": 0.05 * i}) + "\n" for i, p in enumerate(TEXTS)))
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in TEXTS))
    common = ["generate", "--device", "cpu", "--max-new-tokens", "6", "--artifacts", str(art), "--policy", "uniform",
              "--bits", "4", "--gpu-memory", "48MiB", "--no-verify"]
    r = runner.invoke(app, [*common, "--prompts", str(trace), "--output", str(tmp_path / "o.jsonl"),
                            "--summary-json", str(tmp_path / "s.json"), "--slo-ttft-ms", "60000",
                            "--slo-tpot-ms", "0.001"])
    assert r.exit_code == 0, r.stderr
    assert "TTFT p50" in r.stderr and "goodput" in r.stderr
    r0 = runner.invoke(app, [*common, "--prompts", str(plain), "--output", str(tmp_path / "o0.jsonl"),
                             "--request-rate", "inf"])
    assert r0.exit_code == 0, r0.stderr
    rows = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    rows0 = [json.loads(x) for x in (tmp_path / "o0.jsonl").read_text().splitlines()]
    assert [x["text"] for x in rows] == [x["text"] for x in rows0]
    assert all(x["new_tokens"] == 6 or x["finish_reason"] == "eos" for x in rows)
    assert [x["arrival_s"] for x in rows] == [0.05 * i for i in range(len(TEXTS))]
    assert all(x["arrival_s"] == 0 for x in rows0)
    s = json.loads((tmp_path / "s.json").read_text())
    ttft = [x["first_token_s"] - x["arrival_s"] for x in rows]
    queue = [x["scheduled_s"] - x["arrival_s"] for x in rows]
    tpot = [1e3 * (x["finish_s"] - x["first_token_s"]) / (x["new_tokens"] - 1) for x in rows if x["new_tokens"] > 1]
    assert min(queue) >= 0 and min(ttft) > 0
    for key, xs in (("ttft", ttft), ("queue", queue)):
        for q in (50, 99):
            assert s[f"{key}_p{q}_s"] == pytest.approx(float(np.percentile(xs, q)), rel=1e-9)
    assert s["tpot_p50_ms"] == pytest.approx(float(np.percentile(tpot, 50)), rel=1e-9)
    assert s["tpot_p99_ms"] == pytest.approx(float(np.percentile(tpot, 99)), rel=1e-9)
    end = max(x["finish_s"] for x in rows)
    assert s["duration_s"] == pytest.approx(end) and s["requests_completed"] == len(TEXTS)
    # TTFT within a minute for all; TPOT <= 1 microsecond for none (except one-token requests)
    met = sum(x["new_tokens"] < 2 for x in rows)
    assert s["requests_met_slo"] == met and s["goodput_rps"] == pytest.approx(met / end)
    assert s["slo_ttft_ms"] == 60000 and s["slo_tpot_ms"] == 0.001
    assert s["request_rate"] == pytest.approx((len(TEXTS) - 1) / (0.05 * (len(TEXTS) - 1)))
    arrived = sorted(x["arrival_s"] for x in rows)
    assert s["realised_rate"] == pytest.approx((len(arrived) - 1) / (arrived[-1] - arrived[0]))


def test_a_later_arrival_is_slept_towards_in_slices(lm: LeanMoEModel, ids: list[list[int]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An arrival an hour away: the idle engine sleeps at most a minute at a time (no sleep overflows time_t), and
    says once (not per slice) that it waits, with the arrival time and the wait; a wait under a minute is not
    announced."""
    e = dense_engine(lm, PARAMS, ids[:3], set(), arrivals=ArrivalSchedule.from_times([0.0, 3600.0, 3630.0]))
    clock = _fake_time(e, monkeypatch)
    waits: list[tuple[float, float]] = []
    outs = e.run_until_done(on_wait=lambda arrival, wait: waits.append((arrival, wait)))
    assert sorted(outs) == [0, 1, 2] and all(outs[i].finished for i in (0, 1, 2))
    assert clock.slept and max(clock.slept) <= 60.0 and sum(clock.slept) >= 3630.0 - 20 * STEP_S
    assert len(clock.slept) > 60 and len(waits) == 1 and waits[0][0] == 3600.0
    assert waits[0][1] == pytest.approx(3600.0 - e.trace[PARAMS.max_new_tokens - 1].t_s)
    assert e.times[1].scheduled is not None and e.times[1].scheduled >= 3600.0


def test_trace_wall_clock_covers_idle_gaps(lm: LeanMoEModel, ids: list[list[int]],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The trace's ``t_s`` (the run's clock at each step's end) never goes back, jumps by the idle gap before a
    later arrival, ends at the last finish, and is a float column of the trace's Arrow table."""
    gap = 2.0
    e = dense_engine(lm, PARAMS, ids[:2], set(), arrivals=ArrivalSchedule.from_times([0.0, gap]))
    _fake_time(e, monkeypatch)
    e.run_until_done()
    t = [r.t_s for r in e.trace]
    assert t == sorted(t) and t[0] >= STEP_S
    jump = int(np.argmax(np.diff(t)))  # the idle wait: request 0 done, request 1 not arrived
    assert t[jump] <= (PARAMS.max_new_tokens + 1) * STEP_S and t[jump + 1] - t[jump] >= gap - t[jump]
    assert t[jump + 1] >= gap + STEP_S and e.times[1].scheduled is not None and e.times[1].scheduled >= gap
    assert t[-1] == pytest.approx(max(x.finish for x in e.times.values() if x.finish is not None))
    table = trace_table(e.trace)
    assert table.schema.field("t_s").type == pa.float64() and table.column("t_s").to_pylist() == t


def test_printed_tokens_per_second_says_busy_and_wall(tmp_path: Path) -> None:
    """With idle seconds between arrivals (more than a loaded CPU takes for the first request), the printed rates
    say which time they divide by: busy (summed step time, the summary's ``seconds`` and ``tokens_per_second``) and
    wall (idle waits included, ``wall_seconds`` and ``wall_tokens_per_second``); the wall rate is the lower one.
    Also without an artifact or a budget."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"prompt": p, "arrival_s": t}) + "\n" for p, t in zip(TEXTS[:2], (0.0, 3.0),
                                                                                                strict=True)))
    common = ["generate", "--device", "cpu", "--max-new-tokens", "4", "--prompts", str(trace), "--output",
              str(tmp_path / "o.jsonl")]
    s_json = tmp_path / "s.json"
    r = runner.invoke(app, [*common, "--policy", "16-bit", "--gpu-memory", "120MiB", "--summary-json", str(s_json)])
    assert r.exit_code == 0, r.stderr
    s = json.loads(s_json.read_text())
    m = re.search(r"steps in ([\d.]+) s busy \(([\d.]+) s wall, idle waits for arrivals included\): .* = "
                  r"([\d.]+) tokens/s busy, ([\d.]+) tokens/s wall;", r.stderr)
    assert m is not None, r.stderr
    busy_s, wall_s, busy, wall = map(float, m.groups())
    assert (busy_s, wall_s) == (round(s["seconds"], 2), round(s["wall_seconds"], 2))
    assert (busy, wall) == (round(s["tokens_per_second"], 1), round(s["wall_tokens_per_second"], 1))
    assert s["wall_seconds"] >= 3.0 and s["wall_seconds"] > s["seconds"] and wall < busy
    assert s["wall_tokens_per_second"] == pytest.approx((s["prefill_tokens"] + s["decode_tokens"]) / s["wall_seconds"])
    r = runner.invoke(app, common)  # no artifact, no budget: the same engine and summary, sized to the run
    assert r.exit_code == 0, r.stderr
    m = re.search(r"steps in ([\d.]+) s busy \(([\d.]+) s wall, idle waits for arrivals included\): .* = "
                  r"([\d.]+) tokens/s busy, ([\d.]+) tokens/s wall;", r.stderr)
    assert m is not None and "what this run needs" in r.stderr, r.stderr
    busy_s, wall_s, busy, wall = map(float, m.groups())
    assert wall_s >= 3.0 and wall < busy and busy_s < wall_s


def test_trace_counts_each_arrival_once_at_the_step_after_it(lm: LeanMoEModel, ids: list[list[int]],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``arrived``: requests queued since the previous step; each request counted once, in the first step that
    starts at or after its arrival time (t=0 ones in step 0)."""
    arrivals = ArrivalSchedule.from_times([0.0, 0.0, 0.025, 0.5])
    e = dense_engine(lm, PARAMS, ids, set(), arrivals=arrivals)
    _fake_time(e, monkeypatch)
    e.run_until_done()
    got = [r.arrived for r in e.trace]
    starts = [r.t_s - STEP_S for r in e.trace]  # on the fake clock only the model's steps and the sleeps take time
    want = [0] * len(starts)
    for at in arrivals.times:
        want[next(i for i, t in enumerate(starts) if t >= at - 1e-9)] += 1
    assert got == want and sum(got) == len(ids) and got[0] == 2 and max(got[1:]) == 1
    assert trace_table(e.trace).column("arrived").to_pylist() == got


def test_a_stopped_run_counts_wall_seconds_to_the_stop(lm: LeanMoEModel, ids: list[list[int]],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during an idle wait for a later arrival: ``wall_seconds`` runs to the stop, not to the last step."""
    e = dense_engine(lm, PARAMS, ids[:2], set(), arrivals=ArrivalSchedule.from_times([0.0, 50.0]))
    clock = _fake_time(e, monkeypatch)

    def sleep(s: float) -> None:
        clock.t += 7.0  # seven seconds into the wait, the user stops the run
        raise KeyboardInterrupt

    e.sleep = sleep
    with pytest.raises(KeyboardInterrupt):
        e.run_until_done()
    wall = wall_fields(e)["wall_seconds"]
    assert e.stopped_s is not None and wall == pytest.approx(e.stopped_s) == pytest.approx(e.trace[-1].t_s + 7.0)
