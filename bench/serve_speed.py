"""Benchmark: end-to-end serving speed at a seed model's real size (issue 8), on the GPU machine.

What it does, in one run: builds the full-size model of a seed architecture (default
Qwen1.5-MoE-A2.7B, 14.3B parameters) with random bf16 weights, synthesizes its Any-Precision
bit-planes and LUTs (random codes and sorted random centroids: timing only, the values do not
matter; the real quantizer's speed at this shape is ``bench/results/quantize_h200.md``) and its
calibration tables (monotone random sensitivities, Dirichlet routing mass), then serves a
``--prompt-len``-token prompt plus ``--gen`` generated tokens at each batch size with:

* our runtime at 16-bit (the lean model over a paged KV cache, reference expert loop);
* our runtime (page pool + fused AP kernel + Triton paged-decode attention) at uniform 3, 4, 8 bits
  with a budget larger than everything (no page moves), serving the same requests as the PagedWeight run
  (``--uniform-workload same``, the default since the thirteenth session; before, only its b long prompts);
* PagedWeight under a budget that makes the planner demote during the first batch and reload when
  it finishes (2 x batch requests, ``max_batch`` = batch), so copies overlap the second batch;
* uniform in that same budget (equal total memory, fifteenth session; ``--no-equal-memory`` skips it), at the
  highest of 4 and 3 bits that serves: unable to lower its weights, it queues or preempts requests where
  PagedWeight demotes;
* ``transformers`` eager bf16 ``generate`` (what a user has today).

For each it reports prefill and decode tokens/s, peak device memory, and the bandwidth floor: bytes
one decode step must read (non-expert weights, the experts the batch routes to at their committed
bits with LUTs, the KV cache) / measured copy bandwidth. For PagedWeight also planner time per step,
bytes copied, and decode step time with copies in flight vs without. Writes JSON + markdown.

Usage::

    python bench/serve_speed.py --out-md bench/results/serve_h200.md [--batches 1,4] [--gen 128]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from serve_report import EQUAL_MEMORY, render  # bench/ sibling: the markdown report of these rows
from serve_synthetic import SyntheticAP, random_model, synthetic_table, table_at  # bench/ sibling
from triton_cache import first_uses, kernel_names, missed_specializations, triton_cache_dirs  # bench/ sibling

from pwrun.engine.budget import workspace_bytes
from pwrun.engine.engine import HOST_PHASES, EngineConfig
from pwrun.engine.report import summarize
from pwrun.engine.serve import ServeConfig, assemble_engine, strip_experts
from pwrun.errors import BudgetTooSmall
from pwrun.model.lean import LeanMoEModel
from pwrun.planner.buckets import BucketPolicy
from pwrun.planner.runtime import PlannerConfig
from pwrun.planner.tables import BlockTable
from pwrun.runner import ModelRunner
from pwrun.sampling import SamplingParams

DEV = "cuda"  # --device cpu gives a slow dry run of the whole script (tiny configs) on a machine without GPU


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def peak() -> int:
    return int(torch.cuda.max_memory_allocated()) if DEV == "cuda" else 0


def reset_peak() -> None:
    """Free what earlier engines held (reference cycles included) and restart the peak-memory count."""
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def copy_bandwidth() -> float:
    x = torch.empty(2**30 if DEV == "cuda" else 2**26, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync()
    return 2 * 10 * x.numel() / (time.perf_counter() - t)


def floor_tokens_per_s(spec: Any, model: LeanMoEModel, bits: float | None, batch: int, ctx: int, bw: float) -> float:
    """B / (bytes one decode step reads / bandwidth): non-expert weights (no embedding table), experts the
    batch routes to (expected distinct experts), KV of every sequence."""
    w = model.weights
    non_expert = sum(t.numel() * t.element_size() for lw in w.layers for t in lw.attn.tensors()) \
        + w.lm_head.numel() * w.lm_head.element_size()
    experts = 0.0
    for ls in spec.layers:
        m = ls.moe
        per = 3 * spec.hidden_size * m.expert_intermediate
        distinct = m.num_experts * (1 - (1 - m.top_k / m.num_experts) ** batch)
        shared = 3 * spec.hidden_size * m.shared_intermediate
        rows = 2 * m.expert_intermediate + spec.hidden_size
        srows = 2 * m.shared_intermediate + spec.hidden_size
        if bits is None:
            experts += (distinct * per + shared) * 2
        else:
            experts += (distinct * (per * bits / 8 + rows * 2**bits * 2) + shared * bits / 8 + srows * 2**bits * 2)
        non_expert += m.num_experts * spec.hidden_size * 2
    a = spec.layers[0].attention
    kv = batch * ctx * 2 * spec.num_layers * a.num_kv_heads * a.head_dim * 2
    return batch * bw / (non_expert + experts + kv)


def bits_read_per_token(spec: Any, steps: list[dict[str, Any]]) -> float:
    """Committed bits per expert weight that one decode token reads (median over ``steps``): every layer's
    shared expert at its blocks' bits plus top-k routed experts at the routed blocks' mean bits (the timed
    router is random, so each routed expert is equally likely). Unlike the mean over all blocks, this is
    what sets the expert bytes a decode step moves."""
    if not steps:
        return math.nan
    shared = sum(3 * spec.hidden_size * ls.moe.shared_intermediate for ls in spec.layers if ls.moe is not None)
    routed = sum(3 * spec.hidden_size * ls.moe.expert_intermediate * ls.moe.top_k for ls in spec.layers
                 if ls.moe is not None)
    per = [(shared * r["shared_bits"] if shared else 0.0) + routed * r["routed_bits"] for r in steps]
    return float(np.median(per)) / (shared + routed)


def prompts(batch: int, n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 100, (n,), generator=g).tolist() for _ in range(batch)]


def pressure_setup(spec: Any, stripped: LeanMoEModel, table: BlockTable, b: int, prompt_len: int,
                   gen: int) -> tuple[list[list[int]], int]:
    """(requests, budget in bytes) of the PagedWeight-under-pressure run at batch b: b long requests, then b short
    ones (max_batch b): the long ones force demotions (budget = 16-bit weights + workspace + every block at 4
    bits + 70% of the long requests' KV); once they finish the short ones leave room, so planes are reloaded
    while the short ones decode (copies in flight)."""
    reqs = prompts(b, prompt_len, spec.vocab_size, 7 + b) + prompts(b, 256, spec.vocab_size, 9 + b)
    a = spec.layers[0].attention
    # the longest request's KV (the short prompts are 256 tokens: longer than a --prompt-len below 256)
    kv_req = (max(prompt_len, 256) + gen) * 2 * spec.num_layers * a.num_kv_heads * a.head_dim * 2
    fixed = stripped.weights.num_bytes()
    work = workspace_bytes(spec, 2048, b, max(prompt_len, 256) + gen, 2, cuda=DEV == "cuda")
    at4 = int(sum(table_at(table, spec, 4)))
    return reqs, int(fixed + work + at4 + 0.7 * b * kv_req)


EQUAL_MEMORY_BITS = (4, 3)  # uniform bitwidths tried in PagedWeight's budget, highest first
PRESSURE_POLICY = BucketPolicy((0.5, 0.85), (1.0, 1.0, 1.0), ((4, 5, 6), (3, 4, 5)), (2, 2, 2))
PLANNER = PlannerConfig(free_threshold=4, reload_threshold=16)


def highest_that_fits(bits: tuple[int, ...], run: Any) -> tuple[int, dict[str, Any]]:
    """(q, run(q)) for the first q of ``bits`` (highest first) whose run does not raise ``BudgetTooSmall``; the last
    one's ``BudgetTooSmall`` propagates (nothing fits). Other errors propagate at once."""
    for q in bits[:-1]:
        try:
            return q, run(q)
        except BudgetTooSmall:
            continue
    return bits[-1], run(bits[-1])


def engine_run(model: LeanMoEModel, src: SyntheticAP, table: BlockTable, policy: str, bits: int | None,
               budget: int, reqs: list[list[int]], gen: int, max_batch: int, fused: bool = True,
               warmup: bool = True) -> dict[str, Any]:
    """One timed serving run. ``warmup``: first serve the same prompts for 3 tokens in a throw-away engine,
    so that Triton's JIT compilation (a one-off per kernel config and process) is not timed; the steps that
    capture a CUDA graph (a one-off per engine and batch size) are left out of the decode statistics."""
    pol = PRESSURE_POLICY
    cfg = ServeConfig(budget, policy, bits, EngineConfig(max_batch=max_batch, max_step_tokens=2048,
                                                         fused_kernels=fused), PLANNER)
    if warmup:
        w = assemble_engine(model, src, table, pol, None, None, cfg, SamplingParams(max_new_tokens=3), reqs, set())
        w.engine.run()
        del w
    reset_peak()
    built = assemble_engine(model, src, table, pol, None, None, cfg, SamplingParams(max_new_tokens=gen), reqs, set())
    e = built.engine
    cached = triton_cache_dirs()
    with first_uses() as uses:
        e.run()
    s = summarize(e, built.info)
    new = triton_cache_dirs() - cached
    s["triton_compiles_in_run"] = len(new)
    s["triton_kernels_compiled_in_run"] = kernel_names(new)  # which ones the warm-up missed
    s["triton_specializations_compiled_in_run"] = missed_specializations(uses, s["triton_kernels_compiled_in_run"])
    s["triton_first_uses_in_run"] = uses  # every specialization the 3-token run before did not launch (disk or JIT)
    # tokens served per second of the whole run: each prompt and generated token once (summarize's tokens_per_second
    # also counts the prompt chunks a preempted request computes again)
    s["served_tokens_per_second"] = sum(len(q.prompt) + len(q.out) for q in e.seqs.values()) / max(e.totals.seconds,
                                                                                                  1e-9)
    tr = e.totals.trace
    dec_all = [r for r in tr if r["step_tokens"] == r["running"] and r["running"] > 0 and r["preempted"] == 0]
    dec = [r for r in dec_all if not r.get("graph_captured")]
    pre = [r for r in tr if r not in dec_all]
    s["graph_capture_steps"] = len(dec_all) - len(dec)
    s["slowest_steps"] = [  # where a run's outlier time sits (fourteenth/fifteenth sessions: first-run prefill)
        {"step": i, **{k: r.get(k) for k in ("step_tokens", "running", "seconds", "model_seconds", "graph_captured")}}
        for i, r in sorted(enumerate(tr), key=lambda ir: -ir[1]["seconds"])[:3]]
    s["decode_tps_incl_capture"] = sum(r["step_tokens"] for r in dec_all) / max(sum(r["seconds"] for r in dec_all),
                                                                               1e-9)
    s["decode_step_ms_median"] = 1e3 * float(np.median([r["seconds"] for r in dec])) if dec else math.nan
    s["decode_model_ms_median"] = 1e3 * float(np.median([r["model_seconds"] for r in dec])) if dec else math.nan
    s["decode_tps_measured"] = sum(r["step_tokens"] for r in dec) / max(sum(r["seconds"] for r in dec), 1e-9)
    s["prefill_tps_measured"] = sum(r["step_tokens"] for r in pre) / max(sum(r["seconds"] for r in pre), 1e-9)
    moving = [r["seconds"] for r in dec if r["bytes_in_flight"] > 0]
    still = [r["seconds"] for r in dec if r["bytes_in_flight"] == 0]
    s["decode_step_ms_moving"] = 1e3 * float(np.median(moving)) if moving else math.nan
    s["decode_step_ms_still"] = 1e3 * float(np.median(still)) if still else math.nan
    s["steps_moving"] = len(moving)
    for name, rs in (("moving", [r for r in dec if r["bytes_in_flight"] > 0]),
                     ("still", [r for r in dec if r["bytes_in_flight"] == 0])):
        if rs:  # where a step's host time goes (medians, ms)
            s[f"breakdown_{name}_ms"] = {k: round(1e3 * float(np.median([r[k] for r in rs])), 3) for k in (
                "seconds", "model_seconds", "reload_seconds", "after_seconds", "sync_seconds",
                *(f"{p}_seconds" for p in HOST_PHASES))}
    s["bits_read_per_token"] = bits_read_per_token(e.model.spec, dec)
    if dec:  # planner time of the decode steps alone (the run's planner_ms_per_step also counts prefill steps)
        s["planner_ms_per_decode_step"] = 1e3 * float(np.mean([r["planner_seconds"] for r in dec]))
        s["planner_share_of_decode_step"] = sum(r["planner_seconds"] for r in dec) / max(
            sum(r["seconds"] for r in dec), 1e-9)
    s["device_peak_bytes"] = peak()
    del e, built
    reset_peak()
    return s


def lean16_run(model: LeanMoEModel, reqs: list[list[int]], gen: int) -> dict[str, Any]:
    bs = 16
    nb = sum(-(-(len(r) + gen) // bs) for r in reqs)
    reset_peak()
    runner = ModelRunner(model, num_blocks=nb, block_size=bs)
    sync()
    t0 = time.perf_counter()
    logits = runner.run(dict(enumerate(reqs)))
    nxt = logits.argmax(-1).tolist()
    sync()
    t1 = time.perf_counter()
    for _ in range(gen - 1):
        logits = runner.run({i: [t] for i, t in enumerate(nxt)})
        nxt = logits.argmax(-1).tolist()
    sync()
    t2 = time.perf_counter()
    return {"prefill_tps_measured": sum(map(len, reqs)) / (t1 - t0),
            "decode_tps_measured": len(reqs) * (gen - 1) / (t2 - t1), "device_peak_bytes": peak()}


def hf_run(config_dir: Path, batch: int, plen: int, gen: int) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(config_dir))
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(100, cfg.vocab_size - 100, (batch, plen), device="cuda")
    out = {}
    with torch.inference_mode():
        m.generate(ids, max_new_tokens=2, do_sample=False, min_new_tokens=2)
        times = {}
        for n in (1, gen):
            torch.cuda.synchronize()
            t = time.perf_counter()
            m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            torch.cuda.synchronize()
            times[n] = time.perf_counter() - t
    out["prefill_tps_measured"] = batch * plen / times[1]
    out["decode_tps_measured"] = batch * (gen - 1) / (times[gen] - times[1])
    out["peak_device_bytes"] = int(torch.cuda.max_memory_allocated())
    del m
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config-dir", type=Path, default=Path("tests/fixtures/configs/Qwen__Qwen1.5-MoE-A2.7B"))
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--bits", default="3,4,8")
    ap.add_argument("--out-md", type=Path, required=True)
    ap.add_argument("--time-limit", type=float, default=520.0, help="seconds; later rows are skipped past it")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-lean16", action="store_true", help="no 16-bit lean reference rows")
    ap.add_argument("--uniform-workload", choices=("same", "long"), default="same",
                    help="requests of the uniform runs: 'same' = the PagedWeight run's (b prompts of --prompt-len, "
                         "then b of 256 tokens), so both sides of the PagedWeight-vs-uniform ratio serve equal work; "
                         "'long' = only the b long prompts (the thirteenth session's call 3 and earlier results)")
    ap.add_argument("--only-pressure", action="store_true",
                    help="only the PagedWeight-under-pressure rows (no uniform rows, the equal-memory one included)")
    ap.add_argument("--no-equal-memory", dest="equal_memory", action="store_false",
                    help="skip the uniform run (4 bits, else 3) under PagedWeight's budget (equal total memory) after "
                         "each PagedWeight run")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--big-budget-gib", type=float, default=60.0, help="budget of the no-pressure runs (GiB)")
    ap.add_argument("--compare-unfused", action="store_true",
                    help="also run uniform 4-bit with the eager elementwise ops (EngineConfig.fused_kernels=False)")
    ap.add_argument("--interleave", type=int, default=0,
                    help="N > 0: run (uniform at each of --bits, PagedWeight under pressure) N times in turn per batch "
                         "and report PagedWeight's decode tok/s against uniform's per repeat (the run-to-run spread)")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    t_start = time.time()
    rows: list[dict[str, Any]] = []
    import transformers
    import triton

    meta = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__,
            "triton": triton.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "config": str(args.config_dir), "prompt_len": args.prompt_len, "gen": args.gen,
            "command": "python " + " ".join(sys.argv)}
    bw = copy_bandwidth()
    meta["copy_bandwidth_TBps"] = round(bw / 1e12, 3)
    model = random_model(args.config_dir, torch.bfloat16, DEV)
    spec = model.spec
    src = SyntheticAP(spec, torch.bfloat16, DEV)
    meta["setup_s"] = round(time.time() - t_start, 1)
    table = synthetic_table(spec)
    batches = [int(b) for b in args.batches.split(",")]
    ctx = args.prompt_len + args.gen // 2

    def save() -> None:
        if rows:
            r = rows[-1]
            print(f"{time.time() - t_start:6.0f} s  {r['system']}, batch {r['batch']}: decode "
                  f"{r.get('decode_tps_measured', float('nan')):.1f} tok/s", flush=True)
        out = {"meta": meta, "rows": rows}
        args.out_md.with_suffix(".json").write_text(json.dumps(out, indent=1, default=str))
        args.out_md.write_text(render(meta, rows))

    def over() -> bool:
        return time.time() - t_start > args.time_limit

    for b in [] if args.only_pressure or args.skip_lean16 else batches:
        reqs = prompts(b, args.prompt_len, spec.vocab_size, b)
        r = lean16_run(model, reqs, min(args.gen, 32))
        rows.append({"system": "ours 16-bit (lean reference)", "batch": b, **r,
                     "floor_tps": floor_tokens_per_s(spec, model, None, b, ctx, bw)})
        save()
    stripped = strip_experts(model, torch.device(DEV))  # the 16-bit experts leave the device
    reset_peak()
    def uniform_row(b: int, q: int, fused: bool = True, rep: int = 0) -> None:
        if args.uniform_workload == "same":  # PagedWeight's request list: equal work on both sides of the ratio
            reqs = pressure_setup(spec, stripped, table, b, args.prompt_len, args.gen)[0]
        else:
            reqs = prompts(b, args.prompt_len, spec.vocab_size, b)
        s = engine_run(stripped, src, table, "uniform", q, int(args.big_budget_gib * 2**30), reqs, args.gen, b,
                       fused=fused)
        name = f"ours uniform {q}-bit" + ("" if fused else " (eager elementwise ops)")
        rows.append({"system": name, "batch": b, "rep": rep, "requests": len(reqs), **_pick(s),
                     "floor_tps": floor_tokens_per_s(spec, model, q, b, ctx, bw)})
        save()

    def pressure_row(b: int, rep: int = 0) -> None:
        reqs, budget = pressure_setup(spec, stripped, table, b, args.prompt_len, args.gen)
        s = engine_run(stripped, src, table, "pagedweight", None, budget, reqs, args.gen, b)
        rows.append({"system": "PagedWeight under pressure", "batch": b, "rep": rep, "requests": len(reqs), **_pick(s),
                     "floor_tps": floor_tokens_per_s(spec, model, s.get("mean_bits_time_avg", 4.0), b, ctx, bw)})
        save()

    def equal_memory_row(b: int, rep: int = 0) -> None:
        """The highest uniform bitwidth of EQUAL_MEMORY_BITS that serves in PagedWeight's budget (equal total
        memory; what a static deployment of that memory picks): it cannot lower its weights, so its KV room is what
        the budget leaves (it queues or preempts requests where PagedWeight demotes). BudgetTooSmall from the
        lowest one (not even one request fits) is the row's error."""
        reqs, budget = pressure_setup(spec, stripped, table, b, args.prompt_len, args.gen)
        q, u = highest_that_fits(EQUAL_MEMORY_BITS, lambda q: engine_run(stripped, src, table, "uniform", q, budget,
                                                                         reqs, args.gen, b))
        rows.append({"system": f"uniform {q}-bit{EQUAL_MEMORY}", "bits": q, "batch": b, "rep": rep,
                     "requests": len(reqs), **_pick(u), "floor_tps": floor_tokens_per_s(spec, model, q, b, ctx, bw)})
        save()

    def guarded(label: str, b: int, rep: int, run: Any) -> None:
        """One row; a failure (out of memory, a refused budget) becomes that row's error and the run goes on
        (one failing configuration, e.g. a new batch size, must not cost the rows after it)."""
        try:
            run()
        except Exception as exc:  # recorded, printed, and the other rows still run
            print(f"row {label} batch {b} failed: {type(exc).__name__}: {exc}", flush=True)
            rows.append({"system": label, "batch": b, "rep": rep, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            save()
            reset_peak()

    bit_list = [int(x) for x in args.bits.split(",")]
    if args.interleave:  # repeated, interleaved runs: the run-to-run spread next to the ratio it is compared with
        for rep in range(args.interleave):
            for b in batches:
                for q in bit_list:
                    if not over():
                        guarded(f"ours uniform {q}-bit", b, rep, lambda: uniform_row(b, q, rep=rep))  # noqa: B023
                if not over():
                    guarded("PagedWeight under pressure", b, rep, lambda: pressure_row(b, rep))  # noqa: B023
                if args.equal_memory and not args.only_pressure and not over():
                    guarded(f"uniform{EQUAL_MEMORY}", b, rep, lambda: equal_memory_row(b, rep))  # noqa: B023
    else:
        for b in [] if args.only_pressure else batches:
            runs = [(q, True) for q in bit_list]
            if args.compare_unfused:
                runs.insert(0, (4, False))
            for q, fused in runs:
                if not over():
                    guarded(f"ours uniform {q}-bit", b, 0, lambda: uniform_row(b, q, fused))  # noqa: B023
        for b in batches:
            if not over():
                guarded("PagedWeight under pressure", b, 0, lambda: pressure_row(b))  # noqa: B023
            if args.equal_memory and not args.only_pressure and not over():
                guarded(f"uniform{EQUAL_MEMORY}", b, 0, lambda: equal_memory_row(b))  # noqa: B023
    if not args.skip_hf:
        del model, stripped
        reset_peak()
        for b in batches:
            if over():
                break
            r = hf_run(args.config_dir, b, args.prompt_len, min(args.gen, 32))
            rows.append({"system": "transformers eager bf16", "batch": b, **r})
            save()
    meta["total_s"] = round(time.time() - t_start, 1)
    save()
    print(render(meta, rows))


KEYS = ("prefill_tps_measured", "decode_tps_measured", "decode_tps_incl_capture", "graph_capture_steps",
        "decode_step_ms_median", "decode_model_ms_median", "decode_step_ms_moving", "breakdown_moving_ms",
        "breakdown_still_ms",
        "decode_step_ms_still", "steps_moving", "bits_read_per_token",
        "planner_ms_per_step", "planner_overlapped_ms_per_step", "planner_plans_prepared", "planner_plans_fresh",
        "planner_ms_per_decode_step", "planner_share_of_decode_step",
        "demoted_blocks", "promoted_blocks",
        "bytes_host_to_device", "preemptions", "mean_bits_time_avg", "weight_bytes_mean", "weight_bytes_max",
        "kv_bytes_max", "device_peak_bytes", "gpu_memory", "fixed_bytes", "workspace_bytes", "pool_bytes",
        "triton_compiles_in_run", "triton_kernels_compiled_in_run", "triton_specializations_compiled_in_run",
        "triton_first_uses_in_run", "slowest_steps", "served_tokens_per_second", "seconds")


def _pick(s: dict[str, Any]) -> dict[str, Any]:
    return {k: s[k] for k in KEYS if k in s}


if __name__ == "__main__":
    main()
