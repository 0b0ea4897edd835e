"""End-to-end serving suite at a seed model's real size (default Qwen1.5-MoE-A2.7B, 14.3B parameters).

Two parts, one JSON line per measurement in ``bench/results/serving.jsonl``:

* **decode table** (default): the lean model of the config with random bf16 weights, random AP planes and LUTs and a
  synthetic calibration table (``bench.common``), served in this process at each batch of ``--batches``: our 16-bit
  lean reference (reference expert loop, eager); the 16-bit engine (``--policy 16-bit``: the model's own experts in
  the page pool, 16-bit MoE kernels, CUDA graphs); uniform ``--bits`` with a budget larger than everything (no page
  moves), serving the PagedWeight run's requests; PagedWeight under a budget that makes the planner demote during the
  first ``b`` long requests and reload while the ``b`` short ones decode; uniform at the highest of 4 / 3 bits that
  serves in that same budget (equal total memory); transformers' eager bf16 ``generate``. Each row: prefill and decode
  tokens/s (decode leaves out CUDA-graph capture steps; a 3-token run of the same prompts first keeps Triton's JIT out
  of the timing), the bandwidth floor (``common.decode_step_bytes`` / copy bandwidth), planner time, bytes reloaded,
  mean bits, peak memory.
* **real workloads** (``--workload w1,w2``, ``bench.workloads``): real prompts through the engine in one budget,
  all at once or arriving at ``--request-rate`` requests/s; throughput, TTFT / TPOT / queueing p50 and p99, goodput.
* **HTTP** (``--http``, ``bench.serving_http``): the W1 workload (real C4 prompts, all at once) through the ``pwrun
  serve`` server against the same engine in-process: generated tokens/s of both and their ratio.
* **user path** (``--user-path``): what a user runs, timed stage by stage: a random-weight Hugging Face checkpoint
  at the real shape -> ``pwcal quantize`` -> ``pwcal sensitivity`` (random weights: the tables' values mean
  nothing, their cost is real) -> ``pwrun generate`` on ``--user-requests`` prompts, read from its summary JSON.

Each system's run is timed by ``bench.serving_runs``. ``--label`` names the build in the records;
``--compare-commit REV`` then runs the serving benchmark of REV (a git revision, or a directory holding its tree)
with the same decode-table options in a fresh process, ``--compare-rounds N`` times in turn with ours, its rows
labelled REV (a directory: its name without a leading dot); ``python -m bench.render --compare REV LABEL`` prints
both side by side. On a machine without the git history,
extract REV's code beside the tree first::

    git archive <REV> pwrun pwcal pwkernels bench tests/fixtures/configs | (mkdir -p .base && tar -x -C .base)
    export COMMIT=<HEAD> COMPARE_COMMIT=<REV>   # the commits the records name
    python -m bench.serving --batches 1,4,16 --bits 4 --skip-hf --skip-lean16 --label main
        --compare-commit .base --compare-rounds 2    # (one command line)
    python -m bench.render --compare base main

Usage (GPU machine, repository root)::

    python -m bench.serving --batches 1,4,16 --bits 3,4,5,8 [--interleave 2] [--config-dir ...Mixtral-8x7B-v0.1]
    python -m bench.serving --user-path --skip-table
    python -m bench.serving --http --skip-table [--http-policy uniform]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    GEMMA4,
    MIXTRAL,
    POLICY_VARIANTS,
    QWEN,
    HostExperts,
    SyntheticAP,
    copy_bandwidth,
    decode_step_bytes,
    environment,
    kv_bytes,
    prompts,
    random_model,
    read_records,
    seed_spec,
    synthetic_table,
    table_at,
    write_random_checkpoint,
    write_records,
)
from bench.compare import EQUAL_MEMORY, compare_commit
from bench.render import serving_table
from bench.serving_runs import dense_run, engine_run, hf_run, lean16_run, non_expert_bytes, reset_peak
from bench.workloads import workload_rows
from pwformat.errors import BudgetTooSmall
from pwrun.core.policy import POLICIES
from pwrun.engine.budget import workspace_bytes
from pwrun.engine.build import strip_experts
from pwrun.model.inventory import host_memory
from pwrun.model.lean import LeanMoEModel

EQUAL_MEMORY_BITS = (4, 3)  # uniform bitwidths tried in PagedWeight's budget, highest first
MODELS = {"qwen1.5-moe": QWEN, "mixtral-8x7b": MIXTRAL, "gemma-4-26b-a4b": GEMMA4}


def pressure_setup(spec: Any, stripped: LeanMoEModel, table: Any, b: int, prompt_len: int, gen: int,
                   device: str) -> tuple[list[list[int]], int]:
    """(requests, budget bytes) of PagedWeight under pressure at batch b: b long prompts then b of 256 tokens
    (max_batch b); budget = 16-bit weights + workspace + every block at 4 bits + 70% of the long requests' KV, so
    the long ones force demotions and the short ones decode while planes reload."""
    reqs = prompts(b, prompt_len, spec.vocab_size, 7 + b) + prompts(b, 256, spec.vocab_size, 9 + b)
    longest = max(prompt_len, 256) + gen
    work = workspace_bytes(spec, 2048, b, longest, 2, cuda=device == "cuda")
    at4 = int(sum(table_at(table, spec, 4)))
    return reqs, int(stripped.weights.num_bytes() + work + at4 + 0.7 * b * kv_bytes(spec, longest))


def highest_that_fits(bits: tuple[int, ...], run: Any) -> tuple[int, dict[str, Any]]:
    """(q, run(q)) for the first q of ``bits`` (highest first) whose run does not raise ``BudgetTooSmall``; the
    last one's ``BudgetTooSmall`` propagates."""
    for q in bits[:-1]:
        try:
            return q, run(q)
        except BudgetTooSmall:
            continue
    return bits[-1], run(bits[-1])


def decode_table(args: argparse.Namespace, emit: Any) -> None:
    """The decode table's rows, each passed to ``emit`` as soon as it is measured."""
    dev, t_start = args.device, time.time()
    bw = copy_bandwidth(dev)
    model = random_model(args.config_dir, torch.bfloat16, dev)
    spec = model.spec
    src = SyntheticAP(spec, torch.bfloat16, dev)
    table = synthetic_table(spec)
    batches = [int(b) for b in args.batches.split(",")]
    bit_list = [int(x) for x in args.bits.split(",")]
    ctx = args.prompt_len + args.gen // 2
    base = {"model": args.config_dir.name, "prompt_len": args.prompt_len, "gen": args.gen,
            "copy_bandwidth_TBps": round(bw / 1e12, 3)}
    ne = non_expert_bytes(model)

    def floor(bits: float | None, b: int) -> float:
        return b * bw / decode_step_bytes(spec, ne, bits, b, ctx)

    def over() -> bool:
        return time.time() - t_start > args.time_limit

    def row(system: str, b: int, rep: int, run: Any, *run_args: Any) -> None:
        """One row, ``run(*run_args)``; a failure (out of memory, a refused budget) becomes the row's error and the
        run goes on."""
        if over():
            return
        try:
            emit({**base, "system": system, "batch": b, "rep": rep, **run(*run_args)})
        except Exception as exc:  # recorded and printed; the other rows still run
            emit({**base, "system": system, "batch": b, "rep": rep, "error": f"{type(exc).__name__}: {exc}"[:300]})
            reset_peak(dev)

    def lean16(b: int) -> dict[str, Any]:
        reqs = prompts(b, args.prompt_len, spec.vocab_size, b)
        return {**lean16_run(model, reqs, min(args.gen, 32), dev), "floor_tps": floor(None, b)}

    if not (args.only_pressure or args.skip_lean16):
        for b in batches:
            row("ours 16-bit (lean reference)", b, 0, lean16, b)
    experts = HostExperts(model) if not (args.only_pressure or args.skip_dense16) else None
    stripped = strip_experts(model, torch.device(dev))  # the 16-bit experts leave the device
    reset_peak(dev)

    def dense16(b: int) -> dict[str, Any]:
        assert experts is not None
        reqs = prompts(b, args.prompt_len, spec.vocab_size, b)
        s = dense_run(stripped, experts, int(args.big_budget_gib * 2**30), reqs, args.gen, b, dev)
        return {"policy": "16-bit", "requests": len(reqs), **s, "floor_tps": floor(None, b)}

    if experts is not None:
        for b in batches:
            row("ours 16-bit", b, 0, dense16, b)
        del experts

    def uniform(b: int, q: int) -> dict[str, Any]:
        reqs = (pressure_setup(spec, stripped, table, b, args.prompt_len, args.gen, dev)[0]
                if args.uniform_workload == "same" else prompts(b, args.prompt_len, spec.vocab_size, b))
        s = engine_run(stripped, src, table, "uniform", q, int(args.big_budget_gib * 2**30), reqs, args.gen, b, dev)
        return {"policy": "uniform", "bits": q, "requests": len(reqs), **s, "floor_tps": floor(q, b)}

    def pressure(b: int) -> dict[str, Any]:
        reqs, budget = pressure_setup(spec, stripped, table, b, args.prompt_len, args.gen, dev)
        s = engine_run(stripped, src, table, "pagedweight", None, budget, reqs, args.gen, b, dev)
        return {"policy": "pagedweight", "requests": len(reqs), **s,
                "floor_tps": floor(s.get("mean_bits", 4.0), b)}

    def equal_memory(b: int) -> dict[str, Any]:
        reqs, budget = pressure_setup(spec, stripped, table, b, args.prompt_len, args.gen, dev)
        q, s = highest_that_fits(EQUAL_MEMORY_BITS, lambda q: engine_run(stripped, src, table, "uniform", q, budget,
                                                                         reqs, args.gen, b, dev))
        return {"policy": "uniform", "bits": q, "requests": len(reqs), **s, "floor_tps": floor(q, b)}

    for rep in range(0 if args.skip_ap else max(args.interleave, 1)):
        for b in batches:
            for q in [] if args.only_pressure else bit_list:
                row(f"ours uniform {q}-bit", b, rep, uniform, b, q)
            row("PagedWeight under pressure", b, rep, pressure, b)
            if args.equal_memory and not args.only_pressure:
                row(f"uniform{EQUAL_MEMORY}", b, rep, equal_memory, b)
    if not args.skip_hf and dev == "cuda":
        del model, stripped, src
        reset_peak(dev)
        for b in batches:
            row("transformers eager bf16", b, 0, hf_run, args.config_dir, b, args.prompt_len, min(args.gen, 32))


def _run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Run ``cmd`` (``env``: its environment, default ours): its wall seconds and peak resident host memory (bytes,
    from ``wait4``). Raises on a non-zero exit."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return time.perf_counter() - t, usage.ru_maxrss * 1024


def _cli(*argv: str, rss: dict[str, int] | None = None, env: dict[str, str] | None = None) -> float:
    """Run ``python -m argv...`` from the repository root; its wall seconds, its peak host RSS in ``rss[argv[1]]``
    (the stage's name). Raises on a non-zero exit."""
    wall, peak = _run([sys.executable, "-m", *argv], env)
    if rss is not None:
        rss[argv[1]] = peak
    return wall


def host_rss_bound(config_dir: Path, device: str) -> tuple[int, int]:
    """The host-memory target of the user path (``pwformat.cost.HostMemory.bound``: the artifact of every bitwidth
    3..8 plus the non-expert weights in bf16, plus 10%) and the baseline it sits on: the peak RSS of a process that
    imports the CLI and puts a tensor on ``device`` (a CUDA context) (bytes)."""
    spec, _ = seed_spec(config_dir)
    _, base = _run([sys.executable, "-c", f"import torch, pwrun.cli, pwcal.cli; torch.zeros(1, device='{device}')"])
    return host_memory(spec, list(range(3, 9)), 2).bound(), base


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return int(text)


def user_path(args: argparse.Namespace, emit: Any) -> None:
    """Checkpoint -> pwcal quantize -> pwcal sensitivity -> pwrun generate, as a user runs them; one record. ``pwrun
    generate`` runs three times with a Triton cache of its own: with ``--no-verify`` on the empty cache (cold
    start-up), with ``--no-verify`` again (warm) and as a user runs it (the artifact re-hashed at start-up); ``pwcal
    verify`` alone is timed too. Every stage's peak host RSS is kept beside the target (``host_rss_bound``)."""
    dev = args.device
    rss: dict[str, int] = {}
    with tempfile.TemporaryDirectory(dir=args.workdir) as d:
        ckpt, art, p = Path(d) / "ckpt", Path(d) / "art", Path(d) / "prompts.jsonl"
        t = time.perf_counter()
        write_random_checkpoint(args.config_dir, ckpt, dev, args.user_layers)
        rec: dict[str, Any] = {"model": args.config_dir.name, "system": "user path", "policy": args.user_policy,
                               "layers": seed_spec(ckpt)[0].num_layers,
                               "checkpoint_s": round(time.perf_counter() - t, 1)}
        cal = ["--samples", str(args.user_samples), "--seq-len", str(args.user_seq_len), "--device", dev]
        rec["quantize_s"] = round(_cli("pwcal", "quantize", str(ckpt), "--out", str(art), *cal, rss=rss), 1)
        print(f"user path: checkpoint {rec['checkpoint_s']} s, quantize {rec['quantize_s']} s", flush=True)
        if args.user_policy != "uniform":  # uniform bits read no calibration table
            rec["sensitivity_s"] = round(_cli("pwcal", "sensitivity", str(ckpt), "--artifacts", str(art), *cal,
                                              rss=rss), 1)
        if args.user_search:  # its defaults, as a user runs it (held-out windows of the sensitivity's --seq-len)
            rec["search_buckets_s"] = round(_cli("pwcal", "search-buckets", str(ckpt), "--artifacts", str(art),
                                                 "--device", dev), 1)
            stage = json.loads((art / "manifest.json").read_text())["stages"]["search-buckets"]
            rec |= {"search_buckets_stage_s": stage.get("seconds"), "search_dtype": stage.get("dtype"),
                    "search_allocation_windows": stage.get("allocation_windows_scored")}
            print(f"user path: search-buckets {rec['search_buckets_s']} s", flush=True)
        if args.user_requests == 0:  # the offline stages only
            rec["artifact_bytes"] = sum(f.stat().st_size for f in art.rglob("*") if f.is_file())
            emit(rec)
            return
        text = "The paged weights of a mixture of experts are moved between host and device memory. " * 40
        p.write_text("".join(json.dumps({"prompt": text[: 400 + 37 * i]}) + "\n" for i in range(args.user_requests)))
        summary = Path(d) / "summary.json"
        policy = ["--policy", "uniform", "--bits", "4"] if args.user_policy == "uniform" else []

        env = {**os.environ, "TRITON_CACHE_DIR": str(Path(d) / "triton")}  # empty: the first start-up is cold
        starts: dict[str, dict[str, Any]] = {}

        def generate(name: str, *extra: str) -> None:
            """``pwrun generate`` as run ``name``: wall seconds, start-up (the process's start to the run's first
            step; earlier records: the whole wall time outside the run, its exit included), its phases, what
            followed the run (writing the outputs, the exit) and its peak host RSS."""
            wall = _cli("pwrun", "generate", "--model", str(ckpt), "--artifacts", str(art), "--prompts", str(p),
                        "--output", str(Path(d) / "out.jsonl"), "--gpu-memory", args.user_gpu_memory,
                        "--max-new-tokens", str(args.gen), "--max-batch", str(args.user_max_batch), "--device", dev,
                        "--summary-json", str(summary), *policy, *extra, rss=rss, env=env)
            s = json.loads(summary.read_text())
            phases = s.get("startup_seconds") or {}
            outside = wall - float(s["wall_seconds"])  # everything but the run: start-up, outputs, the exit
            # start-up: the process's start to the first step, where the build says when it began (before_build)
            startup = sum(phases.values()) if "before_build" in phases else outside
            starts[name] = {"wall_s": round(wall, 1), "startup_s": round(startup, 1),
                            "phases_s": {k: round(v, 1) for k, v in phases.items()},
                            "after_run_s": round(outside - startup, 1) if "before_build" in phases else None,
                            "host_peak_rss_bytes": rss["generate"]}
            print(f"user path: generate {name}: {starts[name]}", flush=True)

        rec["verify_s"] = round(_cli("pwcal", "verify", str(art)), 1)
        generate("cold", "--no-verify")
        generate("warm", "--no-verify")
        generate("user")  # the artifact's checksums are re-hashed at every start unless --no-verify
        bound, base = host_rss_bound(ckpt, dev)
        rec |= {"starts": starts, "generate_s": starts["user"]["wall_s"], "startup_s": starts["user"]["startup_s"],
                "startup_cold_s": starts["cold"]["startup_s"], "startup_warm_s": starts["warm"]["startup_s"],
                "startup_no_verify_s": starts["warm"]["startup_s"],
                "artifact_bytes": sum(f.stat().st_size for f in art.rglob("*") if f.is_file()),
                "host_rss_bound_bytes": bound, "host_rss_baseline_bytes": base,
                **{f"{k}_rss_bytes": v for k, v in rss.items()}}
        s = json.loads(summary.read_text())
        rec |= {"requests": args.user_requests, "max_batch": args.user_max_batch, "gpu_memory": args.user_gpu_memory,
                **{k: s[k] for k in ("tokens_per_second", "decode_tokens_per_second", "prefill_tokens_per_second",
                                     "mean_bits", "demoted_blocks", "promoted_blocks", "preemptions",
                                     "seconds") if k in s},
                "startup_phases_s": s.get("startup_seconds")}
        emit(rec)


WORKLOAD_POLICIES = [p for p in POLICIES if p != "16-bit"] + ["transformers", *POLICY_VARIANTS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-dir", type=Path, default=QWEN, help="seed config (tests/fixtures/configs/...)")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--bits", default="3,4,8")
    ap.add_argument("--time-limit", type=float, default=520.0, help="seconds; later rows are skipped past it")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-lean16", action="store_true", help="no 16-bit lean reference rows")
    ap.add_argument("--skip-dense16", action="store_true", help="no rows of the 16-bit engine (--policy 16-bit)")
    ap.add_argument("--skip-ap", action="store_true", help="no rows of AP policies (uniform, PagedWeight)")
    ap.add_argument("--skip-table", action="store_true", help="no decode table (with --user-path: only that)")
    ap.add_argument("--uniform-workload", choices=("same", "long"), default="same",
                    help="requests of the uniform runs: the PagedWeight run's ('same') or only its b long prompts")
    ap.add_argument("--only-pressure", action="store_true", help="only the PagedWeight-under-pressure rows")
    ap.add_argument("--no-equal-memory", dest="equal_memory", action="store_false",
                    help="skip uniform in PagedWeight's budget after each PagedWeight run")
    ap.add_argument("--interleave", type=int, default=0, help="N > 0: the rows of each batch N times in turn")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--big-budget-gib", type=float, default=60.0, help="budget of the no-pressure runs (GiB)")
    ap.add_argument("--label", default=None, help="name of this build in the records (default: its commit)")
    ap.add_argument("--compare-commit", default=None,
                    help="also run the serving benchmark of REV (a git revision or a directory holding its tree) with "
                    "the same options, after ours, its rows labelled REV")
    ap.add_argument("--compare-rounds", type=int, default=1,
                    help="with --compare-commit: run (ours, REV's) this many times in turn (run-to-run spread)")
    ap.add_argument("--out", type=Path, default=None, help="JSONL to append to (default bench/results/serving.jsonl)")
    ap.add_argument("--out-md", type=Path, default=None, help="also render this run's records as markdown here")
    ap.add_argument("--user-path", action="store_true", help="time checkpoint -> pwcal -> pwrun generate")
    ap.add_argument("--user-samples", type=int, default=16, help="calibration windows of the user path")
    ap.add_argument("--user-seq-len", type=int, default=512)
    ap.add_argument("--user-requests", type=int, default=16, help="prompts of the user path's generate (0: none)")
    ap.add_argument("--user-search", action="store_true", help="also time `pwcal search-buckets` (its defaults)")
    ap.add_argument("--user-max-batch", type=int, default=16)
    ap.add_argument("--user-layers", type=_positive_int, default=None,
                    help="cut the checkpoint to its first N decoder layers (where the GPU or disk cannot hold it)")
    ap.add_argument("--user-gpu-memory", default="24GiB")
    ap.add_argument("--user-policy", choices=("pagedweight", "uniform"), default="pagedweight")
    ap.add_argument("--workdir", type=Path, default=None, help="where the user path writes its checkpoint")
    ap.add_argument("--workload", default="", help="real workloads to serve (w1, w2 or w1,w2; bench/workloads.py)")
    ap.add_argument("--workload-requests", type=int, default=0, help="requests per workload (0: W1 256, W2 64)")
    ap.add_argument("--workload-gen", type=int, default=256, help="new tokens per request of a workload")
    ap.add_argument("--workload-max-batch", type=int, default=64, help="running requests at most")
    ap.add_argument("--workload-step-tokens", type=int, default=2048, help="tokens per step at most (prefill chunks)")
    ap.add_argument("--workload-policies", default="pagedweight,uniform",
                    help="policies served per workload in the same budget, comma-separated (default "
                         "pagedweight,uniform), of " + ", ".join(WORKLOAD_POLICIES) + " (uniform: 4 bits; "
                         "transformers: its batched eager generate, --hf-batch, --hf-requests; pagedweight-peak: "
                         "PagedWeight whose reloads leave room for every running request up to its last token, not "
                         "only its next 32 tokens)")
    ap.add_argument("--hf-batch", type=int, default=0,
                    help="--workload-policies ...,transformers: prompts per generate call (0: --workload-max-batch)")
    ap.add_argument("--hf-requests", type=int, default=64,
                    help="--workload-policies ...,transformers: only the first N requests (0: all); its batches run "
                         "one after another, so a subset gives its tokens/s")
    ap.add_argument("--workload-gpu-memory", default="24GiB",
                    help="the one device budget of every --workload-policies run (e.g. 24GiB)")
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="--workload: requests/s arriving as a Poisson process (first at t=0); inf: all at once")
    ap.add_argument("--arrival-seed", type=int, default=0, help="seed of the --request-rate arrival times")
    ap.add_argument("--slo-ttft-ms", type=float, default=None,
                    help="--workload: goodput counts requests whose time to first token is at most this (ms)")
    ap.add_argument("--slo-tpot-ms", type=float, default=None,
                    help="--workload: goodput counts requests whose time per output token is at most this (ms)")
    ap.add_argument("--http", action="store_true", help="W1 through the pwrun serve server vs in-process, with the "
                    "--workload-* options (bench.serving_http)")
    ap.add_argument("--http-policy", choices=("pagedweight", "uniform"), default="pagedweight",
                    help="the --http run's policy (uniform: 4 bits)")
    ap.add_argument("--http-engines", default="process,thread",
                    help="--http: the server's engine modes to run, comma-separated (process: what pwrun serve runs)")
    ap.add_argument("--http-whole", action="store_true", help="--http: whole responses instead of streams")
    args = ap.parse_args()
    names = args.workload.split(",") if args.workload else []
    if any(n not in ("w1", "w2") for n in names) or len(set(names)) < len(names):
        ap.error(f"--workload {args.workload}: give w1, w2 or w1,w2")
    policies = args.workload_policies.split(",")
    if any(p not in WORKLOAD_POLICIES for p in policies) or len(set(policies)) < len(policies):
        ap.error(f"--workload-policies {args.workload_policies}: give each of {', '.join(WORKLOAD_POLICIES)} at most "
                 "once, comma-separated")
    env = environment(args.label)
    out = args.out or Path("bench/results/serving.jsonl")
    done: list[dict[str, Any]] = []

    def emit(rec: dict[str, Any]) -> None:
        write_records("serving", [rec], env, out)
        done.append({**env, **rec})
        print(json.dumps({k: v for k, v in rec.items() if not isinstance(v, dict)}, default=str), flush=True)

    for _ in range(args.compare_rounds if args.compare_commit else 1):  # ours, then REV's, in turn
        if not args.skip_table:
            decode_table(args, emit)
        if args.compare_commit:
            reset_peak(args.device)  # hand the cached device memory back before the other build's process starts
            compare_commit(args.compare_commit, sys.argv[1:], out)
    if args.user_path:
        user_path(args, emit)
    if args.workload:
        workload_rows(args, emit)
    if args.http:
        from bench.serving_http import http_vs_in_process  # the openai client and the server stack: only here

        http_vs_in_process(args, emit)
    if args.out_md:
        args.out_md.write_text(serving_table(read_records(out), env["date"]) + "\n")


if __name__ == "__main__":
    main()
