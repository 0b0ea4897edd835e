"""Real-workload serving runs (``python -m bench.serving --workload w1,w2``): many requests of real text, all
arriving at once or as a Poisson process at ``--request-rate`` requests/s (``--arrival-seed``), through the engine
``pwrun generate`` builds (synthetic AP planes at the seed shape) and its run loop, which admits each request at
its arrival time.

* W1: ``count`` C4 documents at their natural length (the bundled tokenizer's tokens, capped at 1,024), 256 new
  tokens each (``--workload-gen``);
* W2: ``count`` windows of 2,048-4,096 tokens of QMSum meeting transcripts, 256 new tokens each.

Each run reports whole-run tokens/s (over the wall time, idle gaps between arrivals included; ``busy_s``: the
engine's steps), prefill / mixed / decode tokens/s and seconds (a mixed step runs prompt chunks beside decodes), the
engine's serving times (``pwrun.core.latency``: time to first token, time per output token and queueing time at p50
/ p99, goodput under ``--slo-ttft-ms`` / ``--slo-tpot-ms``, the offered rate), graph captures and Triton compilations
inside the timed run, the start-up warm-up, peak device memory and the floor: the run's prompt FLOPs at the measured
bf16 matmul rate plus its decode steps' bytes (``pwformat.cost``) at the copy bandwidth.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict
from typing import Any

import numpy as np
import torch

from bench.common import (
    BENCH_PLANNER,
    BENCH_POLICY,
    SyntheticAP,
    compiled_kernels,
    copy_bandwidth,
    decode_step_bytes,
    policy_variant,
    random_model,
    sync,
    synthetic_table,
    triton_cache_dirs,
    triton_cache_entries,
)
from bench.serving_runs import hf_random_model, non_expert_bytes, peak, reset_peak
from pwrun.core.arrivals import ArrivalSchedule
from pwrun.core.config import EngineConfig
from pwrun.core.latency import SLO
from pwrun.core.policy import Policy
from pwrun.core.request import SamplingParams
from pwrun.data import default_model_dir, read_documents
from pwrun.engine.budget import parse_size
from pwrun.engine.build import ServeConfig, assemble_engine, strip_experts
from pwrun.engine.report import summarize
from pwrun.model.lean import LeanMoEModel
from pwrun.model.loader import load_tokenizer


def _tokenize(texts: list[str]) -> list[list[int]]:
    tok = load_tokenizer(default_model_dir())
    return [tok(t, add_special_tokens=False, verbose=False).input_ids for t in texts]


def w1(count: int, cap: int = 1024) -> list[list[int]]:
    """``count`` C4 documents as token ids, each at its natural length capped at ``cap`` (the bundled evaluation
    sample first, then the calibration sample: 200 + 1,000 documents of >= 200 characters)."""
    docs = [d for name in ("c4", "c4-calib") for d in read_documents(name) if len(d) >= 200][:count]
    return [ids[:cap] for ids in _tokenize(docs)]


def w2(count: int, lo: int = 2048, hi: int = 4096, seed: int = 0) -> list[list[int]]:
    """``count`` windows of lo..hi tokens (uniform) from the concatenated QMSum meeting transcripts."""
    ids = [i for m in _tokenize(read_documents("qmsum")) for i in m]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(lo, hi + 1))
        start = int(rng.integers(0, len(ids) - n))
        out.append(ids[start: start + n])
    return out


def matmul_flops(device: str) -> float:
    """Measured bf16 matmul rate (FLOP/s) of an n^3 product (n = 8192 on CUDA, 512 elsewhere)."""
    n = 8192 if device == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    sync(device)
    t = time.perf_counter()
    for _ in range(10):
        a @ a
    sync(device)
    return 10 * 2 * n**3 / (time.perf_counter() - t)


def phase_times(trace: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind of step (prefill: prompt chunks only; mixed: prompt chunks beside decodes; decode): steps, seconds,
    prompt tokens/s and tokens/s; decode steps' mean running requests and ms; the planner's host seconds on the
    steps' critical path. ``trace``: the engine's trace rows as dicts."""
    kinds = {"prefill": [r for r in trace if r["prefill_tokens"] == r["step_tokens"]],
             "mixed": [r for r in trace if 0 < r["prefill_tokens"] < r["step_tokens"]],
             "decode": [r for r in trace if r["prefill_tokens"] == 0]}
    out: dict[str, Any] = {}
    for k, rows in kinds.items():
        secs = sum(r["seconds"] for r in rows)
        out[f"{k}_steps"] = len(rows)
        out[f"{k}_s"] = secs
        out[f"{k}_prompt_tps"] = sum(r["prefill_tokens"] for r in rows) / max(secs, 1e-9)
        out[f"{k}_tps"] = sum(r["step_tokens"] for r in rows) / max(secs, 1e-9)
    dec = kinds["decode"]
    out["decode_running_mean"] = float(np.mean([r["running"] for r in dec])) if dec else None
    out["decode_step_ms"] = 1e3 * out["decode_s"] / len(dec) if dec else None
    out["planner_s"] = sum(r["planner_seconds"] for r in trace)
    return out


def workload_run(model: LeanMoEModel, src: SyntheticAP, table: Any, policy: str, bits: int | None, budget: int,
                 reqs: list[list[int]], gen: int, max_batch: int, max_step_tokens: int, flops: float,
                 bandwidth: float, non_expert: int, arrivals: ArrivalSchedule | None = None,
                 slo: SLO | None = None) -> dict[str, Any]:
    """One timed run of ``reqs`` (each arriving at its time of ``arrivals``, None: all at once; ``gen`` new tokens
    each, greedy, no stop token); the engine's start-up (build + warm-up) is timed apart. ``slo``: what the
    goodput counts."""
    engine_policy, settings = policy_variant(policy)
    cfg = ServeConfig(budget, Policy.named(engine_policy, bits),
                      EngineConfig(max_batch=max_batch, max_step_tokens=max_step_tokens, **settings), BENCH_PLANNER)
    t = time.perf_counter()
    e = assemble_engine(model, src, table, BENCH_POLICY, None, None, cfg, SamplingParams(max_new_tokens=gen), reqs,
                        set(), arrivals=arrivals)
    startup = time.perf_counter() - t
    cached = triton_cache_entries()
    before = triton_cache_dirs()
    t0 = time.perf_counter()
    outs = e.run_until_done()
    wall = time.perf_counter() - t0
    s = summarize(e, slo).to_dict()
    tr = [asdict(r) for r in e.trace]
    decode_rows = [r for r in tr if r["prefill_tokens"] == 0]
    spec = model.spec
    prompt_tokens = sum(len(r) for r in reqs)
    gen_tokens = sum(len(o.token_ids) for o in outs.values())
    active = 2 * non_expert + 2 * sum(  # FLOPs per token: every non-expert weight + the routed and shared experts
        3 * spec.hidden_size * (ls.moe.expert_intermediate * ls.moe.top_k + ls.moe.shared_intermediate)
        for ls in spec.layers if ls.moe is not None)
    dec_floor = sum(decode_step_bytes(spec, non_expert, s.get("mean_bits", 4.0), max(r["running"], 1),
                                      int(np.mean([len(q) for q in reqs])) + gen // 2) for r in decode_rows)
    rec: dict[str, Any] = {
        "policy": policy, "bits": bits, "reload_reserve_tokens": cfg.engine.reload_reserve_tokens,
        "requests": len(reqs), "prompt_tokens": prompt_tokens, "generated_tokens": gen_tokens, "max_batch": max_batch,
        "max_step_tokens": max_step_tokens,
        "gpu_memory": budget, "seconds": wall, "startup_s": startup,
        "warm_up_s": s.get("warm_up_seconds"), "startup_phases_s": s.get("startup_seconds"),
        "graphs_captured_at_start": s.get("graphs_captured_at_start"),
        "graph_captures_in_run": s.get("graph_captures_in_run"),
        "triton_compiles_in_run": triton_cache_entries() - cached,
        "compiled_in_run": compiled_kernels(triton_cache_dirs() - before),
        "tokens_per_second": (prompt_tokens + gen_tokens) / wall,
        **{k: s.get(k) for k in ("request_rate", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms",
                                 "queue_p50_s", "queue_p99_s", "goodput_rps", "requests_met_slo", "slo_ttft_ms",
                                 "slo_tpot_ms")},
        "busy_s": e.seconds,
        "floor_s": prompt_tokens * active / flops + dec_floor / bandwidth,
        "device_peak_bytes": s.get("device_peak_bytes"), "mean_bits": s.get("mean_bits"),
        "demoted_blocks": s.get("demoted_blocks"), "promoted_blocks": s.get("promoted_blocks"),
        "preemptions": s.get("preemptions"), "host_peak_rss_bytes": s.get("host_peak_rss_bytes")}
    rec.update(phase_times(tr))
    rec["slowest_steps"] = sorted(({"step": r["step"], "s": round(r["seconds"], 4), "tokens": r["step_tokens"],
                                    "prefill": r["prefill_tokens"], "running": r["running"],
                                    "captured": r["graph_captured"]} for r in tr), key=lambda x: -x["s"])[:5]
    rec["percent_of_floor"] = 100 * rec["floor_s"] / wall
    del e
    return rec


def hf_workload_run(config_dir: Any, reqs: list[list[int]], gen: int, batch: int, device: str = "cuda",
                    pad_id: int = 0) -> dict[str, Any]:
    """transformers' batched eager bf16 ``generate`` (random weights, on ``device``) over ``reqs`` in batches of
    ``batch`` taken in order, each left-padded to its longest prompt, ``gen`` new tokens each (greedy, no stop
    token): the baseline a user already has. Tokens/s counts prompt + generated tokens over the batches' summed
    wall time (``generated_tokens_per_second``: generated only). Unlike the engine's rows it has no memory budget
    (its peak is in ``device_peak_bytes``, beside the engine's non-expert weights still resident), no arrival
    times and no warm-up call; a subset of the requests gives its rate, as batches run one after another."""
    t = time.perf_counter()
    m = hf_random_model(config_dir, device)
    startup = time.perf_counter() - t
    wall = 0.0
    gen_tokens = 0
    with torch.inference_mode():
        for i in range(0, len(reqs), batch):
            chunk = reqs[i: i + batch]
            n = max(map(len, chunk))
            ids = torch.full((len(chunk), n), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), n), dtype=torch.long)
            for j, r in enumerate(chunk):
                ids[j, n - len(r):] = torch.tensor(r)
                mask[j, n - len(r):] = 1
            ids, mask = ids.to(device), mask.to(device)
            sync(device)
            t = time.perf_counter()
            out = m.generate(ids, attention_mask=mask, max_new_tokens=gen, min_new_tokens=gen, do_sample=False,
                             pad_token_id=pad_id)
            sync(device)
            wall += time.perf_counter() - t
            gen_tokens += (out.shape[1] - n) * len(chunk)
    prompt_tokens = sum(map(len, reqs))
    rec = {"policy": "transformers", "bits": 16, "requests": len(reqs), "prompt_tokens": prompt_tokens,
           "generated_tokens": gen_tokens, "max_batch": batch, "seconds": wall, "startup_s": startup,
           "tokens_per_second": (prompt_tokens + gen_tokens) / wall, "generated_tokens_per_second": gen_tokens / wall,
           "device_peak_bytes": peak(device)}
    del m
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rec


def workload_rows(args: Any, emit: Any) -> None:
    """The rows of ``--workload``: for each workload, PagedWeight and uniform 4-bit in one budget
    (``--workload-gpu-memory``), the requests arriving at ``--request-rate`` (the same times for every policy), and
    with ``transformers`` among the policies transformers' batched ``generate`` (``--hf-batch``, the first
    ``--hf-requests``); a failure becomes the row's error and the next row runs."""
    dev = args.device
    bw = copy_bandwidth(dev)
    flops = matmul_flops(dev)
    model = strip_experts(random_model(args.config_dir, torch.bfloat16, dev), torch.device(dev))
    src, table = SyntheticAP(model.spec, torch.bfloat16, dev), synthetic_table(model.spec)
    ne = non_expert_bytes(model)
    budget = parse_size(args.workload_gpu_memory)
    reset_peak(dev)  # the 16-bit experts of the random model are gone: the first row's peak starts here
    for name in args.workload.split(","):
        count = args.workload_requests or (256 if name == "w1" else 64)
        vocab = model.spec.vocab_size  # the bundled tokenizer's ids, folded into a smaller test vocabulary
        reqs = [[i % vocab for i in r] for r in (w1(count) if name == "w1" else w2(count))]
        arrivals = ArrivalSchedule.poisson(len(reqs), args.request_rate, args.arrival_seed)
        slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
        for policy in args.workload_policies.split(","):
            bits = 4 if policy == "uniform" else None
            base = {"model": args.config_dir.name, "system": f"workload {name}", "workload": name,
                    "copy_bandwidth_TBps": round(bw / 1e12, 3), "matmul_TFLOPs": round(flops / 1e12, 1)}
            try:
                if policy == "transformers":  # all at once (no arrival times), the first --hf-requests of them
                    hf_reqs = reqs[: args.hf_requests or len(reqs)]
                    emit({**base, **hf_workload_run(args.config_dir, hf_reqs, args.workload_gen,
                                                    args.hf_batch or args.workload_max_batch, dev)})
                else:
                    emit({**base, **workload_run(model, src, table, policy, bits, budget, reqs, args.workload_gen,
                                                 args.workload_max_batch,
                                                 args.workload_step_tokens, flops, bw, ne, arrivals, slo),
                          "arrival_seed": args.arrival_seed})
            except Exception as exc:  # recorded; the other rows still run
                emit({**base, "policy": policy, "bits": bits, "error": f"{type(exc).__name__}: {exc}"[:300]})
            reset_peak(dev)
