"""Where a decode (or prefill) step's GPU time goes at a seed model's real size (torch.profiler, eager).

What it does: builds the serving engine exactly as ``bench/serve_speed.py`` does (random Qwen1.5-MoE
weights, synthetic AP planes, uniform ``--bits``), serves ``--batch`` prompts of ``--prompt-len`` tokens, and profiles
``--steps`` decode steps (no CUDA graphs): prints the top CUDA kernels by total time and the share of the
MoE kernels, attention and everything else. With ``--prefill`` it profiles the prompt's prefill step
instead (one step of ``--prompt-len`` tokens). Either way a 3-token run of the same prompts first compiles the
kernels, as ``serve_speed`` does. It prints the steps' wall time with and without the profiler, and
groups kernel time only (an aten op's own row would count its kernels twice). Usage::

    python bench/profile_decode.py --bits 4 --out bench/results/profile_decode_h200.txt
    python bench/profile_decode.py --bits 4 --prefill --out bench/results/profile_prefill_h200.txt
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import io
import pstats
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import serve_speed as sp  # type: ignore[import-not-found]
import serve_synthetic as syn  # type: ignore[import-not-found]
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from pwrun.engine.engine import EngineConfig
from pwrun.engine.serve import ServeConfig, assemble_engine, strip_experts
from pwrun.planner.buckets import BucketPolicy
from pwrun.sampling import SamplingParams

STEP_TOKENS = 2048  # tokens per engine step (a 2048-token prompt is one prefill step)


def new_tokens(batch: int, prompt_len: int, steps: int) -> int:
    """Tokens each request must generate so that none finishes before the last profiled step: the first
    request decodes through the prompts' ``prefill_steps`` steps, then 2
    warm-up, ``steps`` timed and ``steps`` profiled steps (+ 4 to spare; the sixteenth session's first batch-16
    run sized it 2 * steps + 4, and every request finished before the last prompt was in)."""
    return prefill_steps(batch, prompt_len) + 2 * steps + 4


def prefill_steps(batch: int, prompt_len: int) -> int:
    """Steps until every prompt is in, at most: the running requests' decode tokens take their share of each
    step's STEP_TOKENS before the prompts' chunks do (the scheduler's order; a breaker helper of the sixteenth
    session found batch 92 running out with STEP_TOKENS per step)."""
    return -(-batch * prompt_len // max(1, STEP_TOKENS - batch))


def to_decode(e: Any, batch: int, prompt_len: int) -> None:
    """Step ``e`` through every prompt's prefill chunks (batch 16 x 2048 tokens is 16 steps of 2048: the
    fifteenth session's batch-16 profile timed prefill steps) and 2 warm-up steps with ``batch`` decode
    tokens each; raises ``RuntimeError`` if the requests never all decode together."""
    warm = 0
    for _ in range(prefill_steps(batch, prompt_len) + batch + 16):
        before = (e.totals.prefill_tokens, e.totals.decode_tokens)
        e.step()
        only_decode = e.totals.prefill_tokens == before[0] and e.totals.decode_tokens - before[1] == batch
        warm = warm + 1 if only_decode else 0
        if warm == 2:
            return
    raise RuntimeError(f"the {batch} requests never decoded together: profile a smaller batch or shorter prompt")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config-dir", type=Path, default=Path("tests/fixtures/configs/Qwen__Qwen1.5-MoE-A2.7B"))
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (uniform --bits only)")
    ap.add_argument("--pressure", action="store_true",
                    help="PagedWeight under pressure, as bench/serve_speed.py runs it at batch 1 (else uniform --bits)")
    ap.add_argument("--prefill", action="store_true", help="profile the prefill step instead of decode steps")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model = syn.random_model(args.config_dir, torch.bfloat16, "cuda")
    model = strip_experts(model, torch.device("cuda"))
    torch.cuda.empty_cache()
    src = syn.SyntheticAP(model.spec, torch.bfloat16)
    table = syn.synthetic_table(model.spec)
    if args.pressure:
        reqs, budget = sp.pressure_setup(model.spec, model, table, 1, args.prompt_len, args.steps + 4)
        cfg = ServeConfig(budget, "pagedweight", None, EngineConfig(max_batch=1, max_step_tokens=STEP_TOKENS,
                                                                     cuda_graphs=False), sp.PLANNER)
        pol = sp.PRESSURE_POLICY
    else:
        reqs = sp.prompts(args.batch, args.prompt_len, model.spec.vocab_size, 0)
        cfg = ServeConfig(40 * 2**30, "uniform", args.bits,
                          EngineConfig(max_batch=args.batch, max_step_tokens=STEP_TOKENS, cuda_graphs=False))
        pol = BucketPolicy.neutral(3)
    # compile every kernel of the prefill and first decode steps (so no timing below includes Triton's JIT), then
    # a fresh engine
    assemble_engine(model, src, table, pol, None, None, cfg, SamplingParams(max_new_tokens=3), reqs, set()).engine.run()

    def fresh() -> Any:
        gc.collect()  # the previous engine (and its pool) is gone before the next one is built
        torch.cuda.empty_cache()
        gen = SamplingParams(max_new_tokens=new_tokens(args.batch, args.prompt_len, args.steps))
        return assemble_engine(model, src, table, pol, None, None, cfg, gen, reqs, set()).engine

    def timed(e: Any, n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            e.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n

    steps = 1 if args.prefill else args.steps
    e = fresh()
    if not args.prefill:
        to_decode(e, args.batch, args.prompt_len)
    plain = timed(e, steps)  # wall time per step without the profiler
    plain_phases = {k: round(1e3 * v, 3) for k, v in e.totals.trace[-1].items() if k.endswith("seconds") and v}
    host = ""
    if args.prefill:  # where the host's time goes (cProfile), and which calls wait for the device
        del e  # so that fresh() can free it
        e = fresh()
        torch.cuda.synchronize()
        cp = cProfile.Profile()
        syncs: collections.Counter[str] = collections.Counter()
        shown = warnings.showwarning

        def record(message: Any, category: Any, filename: str, lineno: int, *a: Any, **kw: Any) -> None:
            if "synchroniz" in str(message):
                here = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[-8:-1]
                        if "site-packages" not in f.filename]
                syncs[" < ".join(reversed(here[-4:]))] += 1
            else:
                shown(message, category, filename, lineno, *a, **kw)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            cp.enable()
            e.step()
            cp.disable()
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
        buf = io.StringIO()
        pstats.Stats(cp, stream=buf).sort_stats("tottime").print_stats(30)
        host = ("synchronizing calls in the prefill step (count, innermost first):\n"
                + "\n".join(f"{n:5d}  {k}" for k, n in syncs.most_common(20)) + "\n\ncProfile, by own time:\n"
                + "\n".join(buf.getvalue().splitlines()[:60]))
        del e  # so that fresh() can free it
        e = fresh()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = timed(e, steps)
    # kernels only (an aten op's row repeats its kernels' time)
    events = [ev for ev in prof.key_averages() if ev.device_type == DeviceType.CUDA and ev.self_device_time_total > 0]
    total = sum(ev.self_device_time_total for ev in events)
    last = e.totals.trace[-1]
    what = "PagedWeight under pressure" if args.pressure else f"uniform {args.bits}-bit"
    kind = "prefill step" if args.prefill else "decode steps"
    lines = [f"{steps} {kind}, {what}, batch {args.batch}, prompt {args.prompt_len}: GPU kernel time "
             f"{total / 1e3 / steps:.3f} ms/step; wall {1e3 * plain:.3f} ms/step without the profiler, "
             f"{1e3 * wall:.3f} under it; "
             f"committed bits of the shared / routed expert blocks "
             f"{last.get('shared_bits', float('nan')):.2f} / {last.get('routed_bits', float('nan')):.2f}", ""]
    groups = {"ap_moe": 0.0, "paged_attention": 0.0, "prefill_attention": 0.0, "gemm": 0.0, "other": 0.0}
    for ev in events:
        k = ev.key.lower()
        g = ("gemm" if k.startswith("_gemv_kernel") else  # kernels.dense_gemv: the 16-bit linears
             "ap_moe" if any(x in k for x in ("gemv", "gate_up", "_down", "dequant", "_combine")) else
             "paged_attention" if "decode_kernel" in k or "merge_kernel" in k else
             "prefill_attention" if any(x in k for x in ("fmha", "flash", "attention", "efficient")) else
             "gemm" if any(x in k for x in ("gemm", "gemv", "cutlass", "nvjet", "sm90")) else "other")
        groups[g] += ev.self_device_time_total
    for g, t in groups.items():
        lines.append(f"{g:17s} {t / 1e3 / steps:8.3f} ms/step  {100 * t / max(total, 1):5.1f}%")
    phases = {k: round(1e3 * v, 3) for k, v in last.items() if k.endswith("seconds") and v}
    lines += ["", f"host phases of the last step without / with the profiler (ms, engine trace): {plain_phases} / "
              f"{phases}"]
    lines += ["", prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=60)]
    lines += ["", host, "", "by host time:", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                                             max_name_column_width=60)]
    text = "\n".join(lines)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
