"""The paper's headline experiment (SPEC section 8) at a seed model's real size, one command.

One device budget in which the 16-bit weights fit but leave little room for KV (default 40 GiB for
Qwen1.5-MoE-A2.7B, whose weights take 28.6 GB), KV-heavy traffic arriving over time (``--requests`` windows of
``--lo``..``--hi`` tokens of the bundled QMSum meeting transcripts, Poisson arrivals at ``--request-rate``
requests/s, ``--gen`` new tokens each), and the systems FP16 (the checkpoint's 16-bit experts in the page pool,
static), uniform 8 / 4 / 3 bits, static mixed precision and PagedWeight, each served by the same engine on the same
requests and arrival times (random weights: ``bench.common``; quality comes from the bundled model's evaluation in
``docs/eval/``). A system whose weights leave no room for the longest request records its error and the next runs.

One JSON line per system in ``bench/results/headline.jsonl``: output tokens/s over the run, TTFT / TPOT / queueing
p50 and p99, goodput, preemptions, the time-averaged committed bits and expert bytes (share of their 16-bit bytes),
the time-averaged KV bytes, and the ratios against FP16 and uniform 4-bit of the same run. ``--figure`` draws the
memory split (expert weights vs KV) over time of FP16 and PagedWeight.

Usage (GPU machine, repository root)::

    python -m bench.headline --figure docs/figures/headline_qwen.png
    python -m bench.headline --config-dir tests/fixtures/configs/mistralai__Mixtral-8x7B-v0.1 --layers 8
        --gpu-memory 30GiB --figure docs/figures/headline_mixtral.png    # (one command line)
    python -m bench.render

A cut model wants a budget of its own: Mixtral's first 8 layers take 21.0 GiB of 16-bit experts, 1.1 GiB of other
weights and 5.3 GiB of step workspace at 2,048 step tokens (its experts are 14,336 wide), so FP16 needs 27.7 GiB
before any KV; 30 GiB leaves it ~2.3 GiB, ~75k tokens at 32 KiB per token, about the KV room in tokens that 40 GiB
leaves the whole Qwen1.5-MoE (192 KiB per token). At 40 GiB every system would hold the whole workload's KV and
nothing would press on the weights.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    BENCH_PLANNER,
    BENCH_POLICY,
    POLICY_VARIANTS,
    QWEN,
    HostExperts,
    SyntheticAP,
    environment,
    policy_variant,
    random_model,
    synthetic_table,
    write_records,
)
from bench.serving_runs import reset_peak
from bench.workloads import phase_times, w2
from pweval.figures import memory_split_figure
from pwformat.errors import PagedWeightError
from pwrun.core.arrivals import ArrivalSchedule
from pwrun.core.config import GPU_MAX_BATCH, GPU_STEP_TOKENS, EngineConfig
from pwrun.core.policy import Policy
from pwrun.core.request import SamplingParams
from pwrun.engine.budget import parse_size
from pwrun.engine.build import ServeConfig, assemble_engine, strip_experts
from pwrun.engine.build_dense import assemble_dense_engine
from pwrun.engine.llm_engine import LLMEngine
from pwrun.engine.report import summarize
from pwrun.model.lean import LeanMoEModel

SYSTEMS = {  # name -> (policy, uniform bits); "fp16" is the 16-bit engine; the ratios' bases first
    "fp16": ("16-bit", None), "uniform4": ("uniform", 4), "pagedweight": ("pagedweight", None),
    "uniform3": ("uniform", 3), "uniform8": ("uniform", 8), "static": ("static", None),
    "pagedweight-peak": ("pagedweight", None), "pagedweight-cap4.25": ("pagedweight", None)}  # POLICY_VARIANTS
DEFAULT_SYSTEMS = [s for s in SYSTEMS if s not in POLICY_VARIANTS]
PAPER = {"fp16_throughput_x": 1.94, "uniform_overhead_pct": 4.1, "memory_saving_pct": 72.0}


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help: the module docstring as written, and every option's default."""


def cut_config(config_dir: Path, layers: int | None, into: Path) -> Path:
    """``config_dir``, or a copy of its ``config.json`` in ``into`` with only the first ``layers`` layers."""
    if not layers:
        return config_dir
    cfg = json.loads((config_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    for key in ("layer_types", "mlp_only_layers"):  # per-layer lists follow the cut
        if isinstance(cfg.get(key), list):
            cfg[key] = cfg[key][:layers]
    into.mkdir(parents=True, exist_ok=True)
    (into / "config.json").write_text(json.dumps(cfg))
    return into


def memory_series(engine: LLMEngine) -> dict[str, list[float]]:
    """Per step: the engine's busy seconds up to its end (idle gaps between arrivals left out), expert weight bytes
    and KV bytes in the pool."""
    page = engine.info["page_bytes"]
    t = 0.0
    out: dict[str, list[float]] = {"t": [], "weight_bytes": [], "kv_bytes": []}
    for r in engine.trace:
        t += r.seconds
        out["t"].append(t)
        out["weight_bytes"].append(float(r.weight_bytes or r.weight_pages * page))
        out["kv_bytes"].append(float(r.kv_pages * page))
    return out


def run_system(name: str, model: LeanMoEModel, experts: HostExperts | None, src: SyntheticAP, table: Any,
               reqs: list[list[int]], arrivals: ArrivalSchedule, args: argparse.Namespace
               ) -> tuple[dict[str, Any], dict[str, list[float]] | None]:
    """One system's timed run: its record and its memory series."""
    policy, bits = SYSTEMS[name]
    ecfg = EngineConfig(max_batch=args.max_batch, max_step_tokens=args.step_tokens, **policy_variant(name)[1])
    params = SamplingParams(max_new_tokens=args.gen)
    t = time.perf_counter()
    if policy == "16-bit":
        assert experts is not None
        e = assemble_dense_engine(model, experts, ServeConfig(args.budget, engine=ecfg), params, reqs, set(),
                                  arrivals=arrivals)
    else:
        cfg = ServeConfig(args.budget, Policy.named(policy, bits), ecfg, BENCH_PLANNER)
        e = assemble_engine(model, src, table, BENCH_POLICY, None, None, cfg, params, reqs, set(), arrivals=arrivals)
    startup = time.perf_counter() - t
    t = time.perf_counter()
    outs = e.run_until_done()
    wall = time.perf_counter() - t
    s = summarize(e).to_dict()
    generated = sum(len(o.token_ids) for o in outs.values())
    keep = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms", "queue_p50_s", "queue_p99_s", "goodput_rps",
            "preemptions", "recomputed_tokens", "mean_bits", "expert_share_16bit", "weight_bytes_mean",
            "kv_bytes_mean", "demoted_blocks", "promoted_blocks", "device_peak_bytes", "duration_s",
            "graph_captures_in_run", "warm_up_seconds")
    rec = {"system": name, "policy": policy, "bits": bits, "reload_reserve_tokens": ecfg.reload_reserve_tokens,
           "max_mean_bits": ecfg.max_mean_bits,
           "startup_s": startup, "seconds": wall,
           "completed": sum(o.finished for o in outs.values()), "generated_tokens": generated,
           "output_tokens_per_second": generated / wall, **{k: s.get(k) for k in keep}}
    rec.update(phase_times([asdict(r) for r in e.trace]))  # where the time went: prefill, mixed, decode, planner
    series = memory_series(e) if name in ("fp16", "pagedweight") else None
    del e
    return rec, series


def with_ratios(record: dict[str, Any], earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """``record`` with its throughput over FP16's and uniform 4-bit's among ``earlier`` records of the same run
    and itself (None where that system has not run or failed)."""
    tps = {r["system"]: r.get("output_tokens_per_second") for r in [*earlier, record] if "error" not in r}
    for base, key in (("fp16", "x_vs_fp16"), ("uniform4", "x_vs_uniform4")):
        own, ref = record.get("output_tokens_per_second"), tps.get(base)
        record[key] = own / ref if own and ref else None
    return record


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.headline", description=__doc__,
                                 formatter_class=Formatter)
    ap.add_argument("--config-dir", type=Path, default=QWEN, help="a seed model's config.json directory")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers (a model too large)")
    ap.add_argument("--gpu-memory", default="40GiB", help="the one device budget of every system, e.g. 40GiB, "
                    "38.5GB or bytes")
    ap.add_argument("--requests", type=int, default=64, help="requests in the workload")
    ap.add_argument("--lo", type=int, default=2048, help="shortest prompt, tokens")
    ap.add_argument("--hi", type=int, default=8192, help="longest prompt, tokens")
    ap.add_argument("--gen", type=int, default=256, help="new tokens per request")
    ap.add_argument("--request-rate", type=float, default=8.0,
                    help="Poisson arrivals, requests/s (inf: at once); the default saturates the 40 GiB budget: the "
                         "64 requests arrive within ~8 s, less than any system takes to serve them (at a rate whose "
                         "arrivals outlast the serving, every system's throughput is the offered load)")
    ap.add_argument("--arrival-seed", type=int, default=0, help="seed of the arrival times and prompt windows")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help="comma-separated, of " + ", ".join(SYSTEMS)
                    + " (pagedweight-peak: PagedWeight whose reloads leave room for every running request up to its "
                    "last token, not only its next 32 tokens; pagedweight-cap4.25: PagedWeight holding at most the "
                    "expert bytes of 4.25 bits per block, --max-mean-bits)")
    ap.add_argument("--max-batch", type=int, default=GPU_MAX_BATCH, help="running requests at most")
    ap.add_argument("--step-tokens", type=int, default=GPU_STEP_TOKENS, help="tokens per step at most")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (a shrunken config only)")
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 or float16: weights and activations")
    ap.add_argument("--figure", type=Path, default=None, help="PNG of the memory split over time")
    ap.add_argument("--out", type=Path, default=None, help="JSON lines (default bench/results/headline.jsonl)")
    ap.add_argument("--label", default=None, help="names the build in the records (default: the commit)")
    ap.add_argument("--time-limit", type=float, default=math.inf,
                    help="seconds; systems not started by then are left out (each finished one is recorded)")
    args = ap.parse_args()
    try:
        args.budget = parse_size(args.gpu_memory)
    except PagedWeightError as exc:
        ap.error(str(exc))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA device here; this benchmark runs at real size on a GPU "
                 "(--device cpu only with a shrunken --config-dir)")
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers {args.layers}: give at least 1")
    if not (args.request_rate > 0):
        ap.error(f"--request-rate {args.request_rate}: give requests/s > 0, or inf (all at once)")
    if args.arrival_seed < 0 or args.requests < 1 or args.gen < 1 or not 1 <= args.lo <= args.hi:
        ap.error("give --arrival-seed >= 0, --requests >= 1, --gen >= 1 and 1 <= --lo <= --hi")
    if args.dtype not in ("bfloat16", "float16"):
        ap.error(f"--dtype {args.dtype}: give bfloat16 or float16")
    if args.out is not None and args.out.is_dir():
        ap.error(f"--out {args.out} is a directory: give a .jsonl file path")
    if args.figure is not None and (args.figure.is_dir() or args.figure.suffix != ".png"):
        ap.error(f"--figure {args.figure}: give a .png file path")
    layers = json.loads((args.config_dir / "config.json").read_text())["num_hidden_layers"]
    if args.layers is not None and args.layers > layers:
        ap.error(f"--layers {args.layers}: {args.config_dir.name} has {layers} layers")
    systems = args.systems.split(",")
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or len(set(systems)) < len(systems):
        ap.error(f"--systems {args.systems}: give each of {', '.join(SYSTEMS)} at most once")
    env = environment(args.label)
    with tempfile.TemporaryDirectory() as tmp:
        config_dir = cut_config(args.config_dir, args.layers, Path(tmp) / "config")
        model = random_model(config_dir, getattr(torch, args.dtype), args.device)
    experts = HostExperts(model) if "fp16" in systems else None
    model = strip_experts(model, torch.device(args.device))
    src, table = SyntheticAP(model.spec, model.dtype, args.device), synthetic_table(model.spec)
    reset_peak(args.device)
    vocab = model.spec.vocab_size
    reqs = [[i % vocab for i in r] for r in w2(args.requests, args.lo, args.hi, seed=args.arrival_seed)]
    arrivals = (ArrivalSchedule.at_once(len(reqs)) if math.isinf(args.request_rate)
                else ArrivalSchedule.poisson(len(reqs), args.request_rate, args.arrival_seed))
    base = {"model": args.config_dir.name, "layers": args.layers or model.spec.num_layers,
            "gpu_memory": args.budget, "gpu_memory_gib": round(args.budget / 2**30, 2), "requests": len(reqs),
            "prompt_tokens": sum(map(len, reqs)),
            "lo": args.lo, "hi": args.hi, "gen": args.gen, "request_rate": args.request_rate,
            "arrival_seed": args.arrival_seed, "last_arrival_s": max(arrivals.times, default=0.0),
            "max_batch": args.max_batch, "step_tokens": args.step_tokens,
            "paper": PAPER}
    # an untimed run first, so the first system timed does not pay the process's one-off costs (allocator growth,
    # thread pools, lazy imports) that the later ones would not
    try:
        run_system(systems[-1], model, experts, src, table, reqs[:2], ArrivalSchedule.at_once(min(2, len(reqs))),
                   argparse.Namespace(**{**vars(args), "gen": min(args.gen, 4)}))
    except Exception:  # that system's own timed run records why it fails
        pass
    reset_peak(args.device)
    records: list[dict[str, Any]] = []
    series: dict[str, dict[str, list[float]]] = {}
    path = None
    t_start = time.perf_counter()
    for name in systems:
        if time.perf_counter() - t_start > args.time_limit:
            print(f"left out {name}: past --time-limit {args.time_limit:g} s", flush=True)
            continue
        try:
            rec, s = run_system(name, model, experts, src, table, reqs, arrivals, args)
            records.append(with_ratios({**base, **rec}, records))
            if s is not None:
                series[name] = s
        except Exception as exc:  # recorded (e.g. FP16 weights leave no room for the longest request)
            records.append({**base, "system": name, "error": f"{type(exc).__name__}: {exc}"[:1000]})
        path = write_records("headline", records[-1:], env, args.out)  # each system as it ends: none lost to a kill
        print(json.dumps({k: records[-1].get(k) for k in ("system", "output_tokens_per_second", "x_vs_fp16",
                                                          "x_vs_uniform4", "ttft_p50_s", "tpot_p50_ms",
                                                          "preemptions", "mean_bits", "error")}), flush=True)
        reset_peak(args.device)
    if path is not None:
        print(f"wrote {path}")
    if args.figure and series:
        title = (f"{args.config_dir.name}: {len(reqs)} requests of {args.lo}-{args.hi} tokens at "
                 f"{args.request_rate:g}/s, {args.gpu_memory}")
        memory_split_figure(series, args.budget, title, args.figure)
        print(f"wrote {args.figure}")
    if all("error" in r for r in records):
        raise SystemExit("error: every system failed (see the records' error fields): give a larger --gpu-memory "
                         "or fewer --requests")


if __name__ == "__main__":
    main()
