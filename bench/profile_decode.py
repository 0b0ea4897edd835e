"""Where a decode step's GPU time goes at a seed model's real size (torch.profiler, eager, no graphs).

What it does: builds the serving engine exactly as ``bench/serve_speed.py`` does (random Qwen1.5-MoE
weights, synthetic AP planes, uniform ``--bits``), serves one ``--prompt-len`` prompt, and profiles
``--steps`` decode steps: prints the top CUDA kernels by total time and the share of the MoE kernels,
the paged attention kernel and everything else. Usage::

    python bench/profile_decode.py --bits 4 --out bench/results/profile_decode_h200.txt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import serve_speed as sp  # type: ignore[import-not-found]
import torch
from torch.profiler import ProfilerActivity, profile

from pwrun.engine.engine import EngineConfig
from pwrun.engine.serve import ServeConfig, assemble_engine, strip_experts
from pwrun.planner.buckets import BucketPolicy
from pwrun.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config-dir", type=Path, default=Path("tests/fixtures/configs/Qwen__Qwen1.5-MoE-A2.7B"))
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--pressure", action="store_true",
                    help="PagedWeight under pressure, as bench/serve_speed.py runs it at batch 1 (else uniform --bits)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model = sp.random_model(args.config_dir, torch.bfloat16, "cuda")
    model = strip_experts(model, torch.device("cuda"))
    torch.cuda.empty_cache()
    src = sp.SyntheticAP(model.spec, torch.bfloat16)
    table = sp.synthetic_table(model.spec)
    if args.pressure:
        reqs, budget = sp.pressure_setup(model.spec, model, table, 1, args.prompt_len, args.steps + 4)
        cfg = ServeConfig(budget, "pagedweight", None, EngineConfig(max_batch=1, max_step_tokens=2048,
                                                                     cuda_graphs=False), sp.PLANNER)
        pol = sp.PRESSURE_POLICY
    else:
        reqs = sp.prompts(1, args.prompt_len, model.spec.vocab_size, 0)
        cfg = ServeConfig(40 * 2**30, "uniform", args.bits, EngineConfig(max_batch=1, max_step_tokens=2048,
                                                                         cuda_graphs=False))
        pol = BucketPolicy.neutral(3)
    e = assemble_engine(model, src, table, pol, None, None, cfg, SamplingParams(max_new_tokens=args.steps + 4), reqs,
                        set()).engine
    for _ in range(3):  # prefill + warm-up decode steps
        e.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            e.step()
        torch.cuda.synchronize()
    events = [ev for ev in prof.key_averages() if ev.device_time_total > 0]
    total = sum(ev.self_device_time_total for ev in events)
    last = e.totals.trace[-1]
    what = "PagedWeight under pressure" if args.pressure else f"uniform {args.bits}-bit"
    lines = [f"{args.steps} decode steps, {what}, prompt {args.prompt_len}: GPU self time "
             f"{total / 1e3 / args.steps:.3f} ms/step; committed bits of the shared / routed expert blocks "
             f"{last.get('shared_bits', float('nan')):.2f} / {last.get('routed_bits', float('nan')):.2f}", ""]
    groups = {"ap_moe": 0.0, "paged_attention": 0.0, "gemm": 0.0, "other": 0.0}
    for ev in events:
        k = ev.key.lower()
        g = ("ap_moe" if any(x in k for x in ("gemv", "gate_up", "_down", "dequant")) else
             "paged_attention" if "decode_kernel" in k or "merge_kernel" in k else
             "gemm" if any(x in k for x in ("gemm", "gemv", "cutlass", "nvjet", "sm90")) else "other")
        groups[g] += ev.self_device_time_total
    for g, t in groups.items():
        lines.append(f"{g:16s} {t / 1e3 / args.steps:8.3f} ms/step  {100 * t / max(total, 1):5.1f}%")
    lines += ["", prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60)]
    text = "\n".join(lines)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
