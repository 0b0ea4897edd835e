"""The benchmark suites as a user runs them (``python -m bench.<suite>`` in a subprocess: tests never import bench):
the renderer picks the latest run of each measurement, and the serving suite runs end to end on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _record(date: str, label: str, batch: int, tps: float, **extra: object) -> dict[str, object]:
    return {"suite": "serving", "commit": label, "label": label, "gpu": "G", "date": date, "command": f"run {label}",
            "model": "m", "system": "ours uniform 4-bit", "batch": batch, "decode_tps_measured": tps, **extra}


def test_render_shows_the_latest_run_of_each_measurement(tmp_path: Path) -> None:
    """Batch 1 was measured twice (the later run, two repeats, wins: their median); batch 4 only by the earlier run;
    a failed row and a comparison baseline (though later) are left out; --compare puts two labels side by side."""
    rows = [_record("2026-01-01T00:00:00Z", "old", 1, 100.0), _record("2026-01-01T00:00:00Z", "old", 4, 300.0),
            _record("2026-02-01T00:00:00Z", "new", 1, 110.0, rep=0), _record("2026-02-01T00:00:00Z", "new", 1, 130.0,
                                                                              rep=1),
            _record("2026-02-01T00:00:00Z", "new", 4, 0.0, error="OutOfMemoryError: x"),
            _record("2026-03-01T00:00:00Z", "base", 1, 90.0, baseline=True)]  # a --compare-commit baseline
    (tmp_path / "serving.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "performance.md"
    _run("bench.render", "--results", str(tmp_path), "--out", str(out))
    text = out.read_text()
    assert "| m | ours uniform 4-bit | 120 | 300 |" in text  # decode tok/s per batch: median of the new run; old b4
    assert "commit new" in text and "commit old" in text and "OutOfMemoryError" not in text
    cmp = _run("bench.render", "--results", str(tmp_path), "--compare", "old", "new")
    assert "| m | ours uniform 4-bit | 1 | 100 (100..100, n=1) | 120 (110..130, n=2) | 1.200 |" in cmp
    assert "| m | ours uniform 4-bit | 1 | 90 (90..90, n=1) | 120 (110..130, n=2) | 1.333 |" in _run(
        "bench.render", "--results", str(tmp_path), "--compare", "base", "new")


def _shrunken_qwen(tmp_path: Path, vocab_size: int = 1000) -> None:
    cfg = json.loads((ROOT / "tests/fixtures/configs/Qwen__Qwen1.5-MoE-A2.7B/config.json").read_text())
    cfg.update(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=256,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=8,
               num_experts_per_tok=2, vocab_size=vocab_size)
    (tmp_path / "config.json").write_text(json.dumps(cfg))


def test_serving_suite_on_a_shrunken_config(tmp_path: Path) -> None:
    """The serving suite on a shrunken Qwen1.5-MoE config on the CPU: uniform serves PagedWeight's requests (equal
    work on both sides of the ratio), uniform in PagedWeight's budget fits at 4 bits, each record carries the run's
    environment, and served tokens/s counts each prompt and generated token once."""
    _shrunken_qwen(tmp_path)
    out = tmp_path / "serving.jsonl"
    _run("bench.serving", "--device", "cpu", "--config-dir", str(tmp_path), "--skip-hf", "--skip-lean16",
         "--batches", "2", "--bits", "4", "--prompt-len", "64", "--gen", "4", "--big-budget-gib", "1",
         "--label", "t", "--out", str(out))
    rows = {r["system"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"ours 16-bit", "ours uniform 4-bit", "PagedWeight under pressure",
                         "uniform, PagedWeight's budget"}
    d16 = rows.pop("ours 16-bit")  # the 16-bit engine: its own requests (b prompts of --prompt-len)
    assert "error" not in d16 and d16["policy"] == "16-bit" and d16["requests"] == 2 and d16["mean_bits"] == 16
    assert abs(d16["served_tokens_per_second"] * d16["seconds"] - (2 * 64 + 2 * 4)) < 1e-6
    assert d16["decode_tps_measured"] > 0 and d16["preemptions"] == 0
    pw, eq = rows["PagedWeight under pressure"], rows["uniform, PagedWeight's budget"]
    assert "error" not in eq and eq["bits"] == 4 and eq["gpu_memory"] == pw["gpu_memory"]
    assert rows["ours uniform 4-bit"]["requests"] == pw["requests"] == eq["requests"] == 4
    for r in rows.values():
        assert r["label"] == "t" and r["gpu"] == "cpu" and r["command"].startswith("python -m bench.serving")
        # 2 x 64 + 2 x 256 prompt tokens + 4 x 4 generated
        assert abs(r["served_tokens_per_second"] * r["seconds"] - (2 * 64 + 2 * 256 + 4 * 4)) < 1e-6
        assert r["decode_tps_measured"] > 0


def test_user_path_times_cold_and_warm_starts_and_keeps_host_memory(tmp_path: Path) -> None:
    """``--user-path`` on a shrunken Qwen1.5-MoE config cut to one layer: checkpoint -> pwcal quantize -> three
    ``pwrun generate`` runs on a Triton cache of their own; each start-up is its phases (the process's start to the
    first step) and the rest of the wall time outside the run follows it; every stage's peak RSS is recorded beside
    the bound; the rendered table has the row with its layer count."""
    _shrunken_qwen(tmp_path, vocab_size=4096)  # the checkpoint gets the bundled tokenizer (4,096 ids)
    out = tmp_path / "serving.jsonl"
    _run("bench.serving", "--device", "cpu", "--config-dir", str(tmp_path), "--user-path", "--skip-table",
         "--user-policy", "uniform", "--user-requests", "2", "--gen", "3", "--user-gpu-memory", "256MiB",
         "--user-samples", "2", "--user-seq-len", "32", "--user-layers", "1", "--workdir", str(tmp_path),
         "--label", "t", "--out", str(out))
    (r,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert "error" not in r and r["layers"] == 1 and set(r["starts"]) == {"cold", "warm", "user"}
    for s in r["starts"].values():
        phases = s["phases_s"]
        assert {"before_build", "kernel_precompile", "experts", "warm_up"} <= set(phases)
        assert abs(s["startup_s"] - sum(phases.values())) <= 0.05 * len(phases) + 0.1  # rounded per phase
        assert s["after_run_s"] >= -0.2 and s["startup_s"] + s["after_run_s"] <= s["wall_s"] + 0.2
        assert s["host_peak_rss_bytes"] == r["generate_rss_bytes"] or s is not r["starts"]["user"]
    assert r["startup_warm_s"] == r["starts"]["warm"]["startup_s"] and r["startup_cold_s"] > 0
    assert r["quantize_rss_bytes"] > 0 and r["generate_rss_bytes"] > 0 and r["host_rss_baseline_bytes"] > 0
    assert 0 < r["host_rss_bound_bytes"] and r["artifact_bytes"] <= r["host_rss_bound_bytes"]
    md = tmp_path / "performance.md"
    _run("bench.render", "--results", str(tmp_path), "--out", str(md))
    assert f"| {tmp_path.name} | 1 | cpu | uniform | 256MiB |" in md.read_text()


def test_real_workload_rows_account_for_every_token(tmp_path: Path) -> None:
    """``--workload w2`` on the shrunken config: both policies serve every request; the prefill, mixed and decode
    steps' seconds add up to the run, their prompt tokens to the workload's, and a long prompt under a small step
    budget runs chunks beside decodes (mixed steps)."""
    _shrunken_qwen(tmp_path)
    out = tmp_path / "serving.jsonl"
    _run("bench.serving", "--device", "cpu", "--config-dir", str(tmp_path), "--skip-table", "--workload", "w2",
         "--workload-requests", "3", "--workload-gen", "3", "--workload-max-batch", "2", "--workload-step-tokens",
         "512", "--workload-gpu-memory", "1GiB", "--workload-policies", "pagedweight,uniform,transformers",
         "--hf-requests", "0", "--label", "t", "--out", str(out))
    *rows, hf = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["workload"], r["policy"]) for r in rows] == [("w2", "pagedweight"), ("w2", "uniform")]
    # transformers' batched generate on the same prompts (ragged, left-padded): every token counted, none dropped
    assert hf["policy"] == "transformers" and "error" not in hf and hf["max_batch"] == 2
    assert hf["requests"] == 3 and hf["generated_tokens"] == 9 and hf["prompt_tokens"] == rows[0]["prompt_tokens"]
    assert abs(hf["tokens_per_second"] * hf["seconds"] - (hf["prompt_tokens"] + 9)) < 1e-6 * hf["prompt_tokens"]
    for r in rows:
        assert "error" not in r and r["requests"] == 3 and r["generated_tokens"] == 9
        assert 3 * 2048 <= r["prompt_tokens"] <= 3 * 4096
        kinds = ("prefill", "mixed", "decode")
        assert abs(sum(r[f"{k}_s"] for k in kinds) - r["seconds"]) < 0.05 * r["seconds"] + 0.05
        prompt = sum(r[f"{k}_prompt_tps"] * r[f"{k}_s"] for k in kinds)
        assert abs(prompt - r["prompt_tokens"]) < 1e-3 * r["prompt_tokens"]
        assert r["mixed_steps"] > 0 and r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["seconds"]


def test_real_workload_arriving_at_a_request_rate(tmp_path: Path) -> None:
    """``--workload w1 --request-rate R``: Poisson arrivals through the engine's run loop; every request is served
    in full, the record carries the offered rate and the serving times, the steps' seconds add up to the engine's
    busy time, and the rendered table has a row per rate."""
    _shrunken_qwen(tmp_path)
    out = tmp_path / "serving.jsonl"
    _run("bench.serving", "--device", "cpu", "--config-dir", str(tmp_path), "--skip-table", "--workload", "w1",
         "--workload-requests", "6", "--workload-gen", "3", "--workload-max-batch", "4", "--workload-step-tokens",
         "512", "--workload-gpu-memory", "1GiB", "--workload-policies", "uniform", "--request-rate", "40",
         "--arrival-seed", "1", "--slo-ttft-ms", "60000", "--label", "t", "--out", str(out))
    (r,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert "error" not in r and r["requests"] == 6 and r["generated_tokens"] == 18
    assert r["request_rate"] == 40 and r["arrival_seed"] == 1 and r["slo_ttft_ms"] == 60000
    assert 0 <= r["queue_p50_s"] <= r["queue_p99_s"] and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] <= r["seconds"]
    assert r["requests_met_slo"] == 6 and r["goodput_rps"] > 0 and r["busy_s"] <= r["seconds"]
    assert abs(sum(r[f"{k}_s"] for k in ("prefill", "mixed", "decode")) - r["busy_s"]) < 1e-6 * r["busy_s"] + 1e-6
    md = tmp_path / "performance.md"
    _run("bench.render", "--results", str(tmp_path), "--out", str(md))
    assert "| w1 | 40 | 1 | uniform |" in md.read_text()  # workload, rate, budget GiB, policy


def test_serving_http_mode_serves_w1_through_the_server(tmp_path: Path) -> None:
    """``bench.serving --http`` on the shrunken config: W1 in-process and through the server with the engine in a
    process and on a thread, every requested token on every side (no stop token), their ratio, and a table of its
    own in the rendered section (a row per engine)."""
    _shrunken_qwen(tmp_path)
    out = tmp_path / "serving.jsonl"
    _run("bench.serving", "--device", "cpu", "--config-dir", str(tmp_path), "--skip-table", "--http",
         "--workload-requests", "4", "--workload-gen", "4", "--workload-max-batch", "2", "--workload-step-tokens",
         "512", "--workload-gpu-memory", "1GiB", "--label", "t", "--out", str(out))
    records = list(map(json.loads, out.read_text().splitlines()))
    assert [r["engine"] for r in records] == ["process", "thread"]
    for r in records:
        assert r["system"] == "W1 over HTTP" and r["requests"] == 4
        assert r["in_process_tokens"] == r["http_tokens"] == 16
        assert r["context"] <= 1024 + 4 and r["prompt_tokens"] <= 4 * 1024
        assert abs(r["http_over_in_process"] - r["http_tps"] / r["in_process_tps"]) < 1e-9
        # step counts differ either way with when the requests reach the server (spread arrivals can pack better)
        assert r["ttft_p50_s"] <= r["ttft_p99_s"] and r["tpot_p50_ms"] > 0
        assert r["http_steps"] > 0 and r["in_process_steps"] > 0  # the process's steps reach the server's metrics
        # every request reached the engine before the run ended, and no token came back before its request did
        assert 0 < r["all_accepted_s"] < r["http_s"] and r["first_token_s"] <= r["ttft_p50_s"]
        # the engine's own time during the burst, split: no more than the burst (the metrics are read around it)
        assert r["http_idle_s"] > 0 and r["http_between_s"] > 0
        assert r["http_step_s"] + r["http_idle_s"] + r["http_between_s"] <= r["http_s"] + 0.5
    _run("bench.render", "--results", str(tmp_path), "--out", str(tmp_path / "perf.md"))
    perf = (tmp_path / "perf.md").read_text()
    for engine in ("process", "thread"):
        assert f"| {tmp_path.name} | pagedweight | 1GiB | 2 | True | {engine} | 4 | 4 |" in perf
    assert f"| {tmp_path.name} | W1 over HTTP |" not in perf  # not in the decode tables


def test_decode_profile_sums_kernels_and_busy_time() -> None:
    """Busy time is the union of device intervals (overlaps and gaps counted once / not at all), kernels are
    ranked by time and counted per step, host events are left out."""
    from bench.decode_profile import kernel_summary
    ev = [{"cat": "kernel", "name": "a", "ts": 0.0, "dur": 100.0}, {"cat": "kernel", "name": "b", "ts": 50.0,
          "dur": 100.0}, {"cat": "gpu_memcpy", "name": "copy", "ts": 400.0, "dur": 20.0},
          {"cat": "kernel", "name": "a", "ts": 1000.0, "dur": 30.0}, {"cat": "cpu_op", "name": "aten::mm", "ts": 0.0,
          "dur": 5000.0}]
    s = kernel_summary(ev, steps=2)
    assert s["gpu_busy_ms"] == (150 + 20 + 30) / 2 / 1e3
    assert s["kernel_sum_ms"] == 250 / 2 / 1e3 and s["kernels_per_step"] == 2.0
    assert s["kernels"] == [["a", 65.0, 1.0], ["b", 50.0, 0.5], ["copy", 10.0, 0.5]]


def test_decode_profile_runs_on_a_shrunken_config(tmp_path: Path) -> None:
    """``bench.decode_profile`` on the CPU: decode steps only, the engine's step times, a rendered row."""
    _shrunken_qwen(tmp_path)
    out = tmp_path / "decode_profile.jsonl"
    _run("bench.decode_profile", "--device", "cpu", "--config-dir", str(tmp_path), "--batches", "2",
         "--prompt-len", "40", "--steps", "3", "--gpu-memory-gib", "1", "--eager", "--label", "t", "--out", str(out))
    (r,) = map(json.loads, out.read_text().splitlines())
    assert r["batch"] == 2 and r["steps"] == 3 and not r["graphs"]
    assert 0 < r["model_ms"] <= r["step_ms"] and r["kernels_per_step"] == 0  # no device activity on the CPU
    _run("bench.render", "--results", str(tmp_path), "--out", str(tmp_path / "perf.md"))
    lines = (tmp_path / "perf.md").read_text().splitlines()
    row = next(line for line in lines if line.startswith(f"| {tmp_path.name} |"))
    # after the GPU: phase, batch, graphs, step tokens at most, policy, bits, prompt tokens, tokens per step
    assert row.split(" | ")[2:10] == ["decode", "2", "False", "2048", "uniform", "4", "40", "2"]


def test_decode_profile_mixed_phase(tmp_path: Path) -> None:
    """``--phase mixed``: only steps that run prompt chunks beside decodes are profiled, at each ``--step-tokens``;
    the records carry the host's CPU ops and the planner's bits under ``--policy pagedweight``."""
    _shrunken_qwen(tmp_path)
    out = tmp_path / "decode_profile.jsonl"
    _run("bench.decode_profile", "--device", "cpu", "--config-dir", str(tmp_path), "--batches", "24",
         "--prompt-len", "40", "--steps", "2", "--gpu-memory-gib", "1", "--eager", "--phase", "mixed",
         "--policy", "pagedweight", "--step-tokens", "64,96", "--label", "t", "--out", str(out))
    recs = list(map(json.loads, out.read_text().splitlines()))
    assert [r["step_tokens_max"] for r in recs] == [64, 96]
    for r in recs:
        assert r["phase"] == "mixed" and r["policy"] == "pagedweight" and r["bits"] is None
        assert 0 < r["prefill_tokens"] < r["step_tokens"] <= r["step_tokens_max"]
        assert 3 <= r["mean_bits"] <= 8 and r["cpu_ops_self_ms"] and r["group_ms"] == {}


def test_headline_runs_every_system_on_the_same_arrivals(tmp_path: Path) -> None:
    """``bench.headline`` on the shrunken config (its first 2 layers): the seven systems (the default six and
    pagedweight-peak) serve the same requests in full in one budget, FP16 at 16 bits and the uniform ones at theirs,
    the ratios are each system's throughput over FP16's and uniform 4-bit's, the figure is written and the renderer
    gives a row per system."""
    _shrunken_qwen(tmp_path)
    out, png = tmp_path / "headline.jsonl", tmp_path / "memory.png"
    _run("bench.headline", "--device", "cpu", "--config-dir", str(tmp_path), "--layers", "1", "--requests", "4",
         "--lo", "300", "--hi", "600", "--gen", "3", "--request-rate", "20", "--max-batch", "4", "--step-tokens",
         "256", "--gpu-memory", "40MiB", "--label", "t", "--out", str(out), "--figure", str(png), "--systems",
         "fp16,uniform4,pagedweight,uniform3,uniform8,static,pagedweight-peak")
    rows = {r["system"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(rows) == ["fp16", "uniform4", "pagedweight", "uniform3", "uniform8", "static",
                          "pagedweight-peak"]  # bases first
    assert rows["pagedweight"]["reload_reserve_tokens"] == 32
    assert rows["pagedweight-peak"]["reload_reserve_tokens"] is None
    assert {r["prompt_tokens"] for r in rows.values()} == {rows["fp16"]["prompt_tokens"]}
    assert rows["fp16"]["x_vs_uniform4"] is None  # written before uniform 4-bit ran: each record as it ends
    for r in rows.values():
        assert "error" not in r and r["completed"] == 4 and r["generated_tokens"] == 12 and r["layers"] == 1, r
        assert r["x_vs_fp16"] == r["output_tokens_per_second"] / rows["fp16"]["output_tokens_per_second"]
        if r["system"] != "fp16":
            assert r["x_vs_uniform4"] == r["output_tokens_per_second"] / rows["uniform4"]["output_tokens_per_second"]
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and r["kv_bytes_mean"] > 0
    assert rows["fp16"]["mean_bits"] == 16 and [rows[f"uniform{b}"]["mean_bits"] for b in (8, 4, 3)] == [8, 4, 3]
    assert png.stat().st_size > 10_000
    # the table keeps runs whole: a later run of FP16 alone adds its row beside this run's seven; an earlier run
    # whose every system was measured again since is left out
    later = {**rows["fp16"], "label": "t2", "date": rows["fp16"]["date"] + "9"}
    earlier = {**rows["uniform8"], "label": "t0", "date": rows["fp16"]["date"][:-1]}
    with out.open("a") as f:
        f.write(json.dumps(later) + "\n" + json.dumps(earlier) + "\n")
    md = tmp_path / "performance.md"
    _run("bench.render", "--results", str(tmp_path), "--out", str(md))
    text = md.read_text()
    assert "## Headline experiment" in text and sum(f"| 0.04 | 20 | t | {s} |" in text for s in rows) == 7, text
    assert "| 0.04 | 20 | t2 | fp16 |" in text and "| t0 |" not in text, text


@pytest.mark.parametrize("policies", ["nonsense", "pagedweight,,uniform", "pagedweight-peak,pagedweight-peak"])
def test_workload_policies_are_checked_before_anything_runs(policies: str) -> None:
    """An unknown, empty or repeated --workload-policies name is an argument error naming the choices, not an error
    row per workload after the model was built; so is a workload other than w1 and w2."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "bench.serving", "--device", "cpu", "--skip-table", "--workload",
                           "w1", "--workload-policies", policies], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 2 and not done.stdout
    assert f"--workload-policies {policies}: give each of pagedweight," in done.stderr
    assert "pagedweight-peak, pagedweight-cap4.25 at most once" in done.stderr and "Traceback" not in done.stderr
    if policies == "nonsense":
        done = subprocess.run([sys.executable, "-m", "bench.serving", "--device", "cpu", "--skip-table", "--workload",
                               "w9"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 2 and "--workload w9: give w1, w2 or w1,w2" in done.stderr
