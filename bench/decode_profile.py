"""Decode-step profile suite: where a decode step's time goes, kernel by kernel (``torch.profiler``).

What it does: builds the engine of the serving suite (random weights at the real shape of ``--config-dir``, synthetic
AP planes, uniform ``--bits``) for ``--batches`` requests of ``--prompt-len`` tokens, serves past the prefill and a
few decode steps, then profiles ``--steps`` decode steps (CUDA graphs on unless ``--eager``). Per (model, batch,
graphs) one record: the steps' wall and model ms (the engine's trace), the GPU busy ms per step (the union of kernel
and copy intervals), kernels per step, their summed ms, and the kernels by name (us per step, launches per step):
a step far from its floor with a busy GPU needs faster kernels; one with many small kernels needs fusion; one whose
wall exceeds its busy time has host gaps. On the CPU (no CUDA activity) the kernel fields are empty.

``--phase mixed`` profiles the steps that run prompt chunks beside decodes instead (``--batches`` requests, all
arriving at once, chunked into ``max_step_tokens`` steps), with the kernels' time grouped into attention, MoE
and the rest; ``--policy pagedweight`` serves mixed bitwidths (the planner's choice under the budget) instead of
uniform ``--bits``; ``--policy 16-bit`` the model's own bf16 experts in the page pool (``--policy 16-bit``).

Usage (GPU machine)::

    python -m bench.decode_profile --config-dir tests/fixtures/configs/google__gemma-4-26B-A4B [--batches 1,4]
    python -m bench.decode_profile --config-dir tests/fixtures/configs/Qwen__Qwen1.5-MoE-A2.7B --phase mixed \
        --batches 64 --prompt-len 1024 --policy pagedweight --gpu-memory-gib 16
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import (
    BENCH_PLANNER,
    BENCH_POLICY,
    HostExperts,
    SyntheticAP,
    environment,
    prompts,
    random_model,
    synthetic_table,
    write_records,
)
from pwrun.core.config import EngineConfig
from pwrun.core.policy import Policy
from pwrun.core.request import SamplingParams
from pwrun.engine.build import ServeConfig, assemble_engine, strip_experts
from pwrun.engine.build_dense import assemble_dense_engine
from pwrun.engine.llm_engine import LLMEngine

DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")  # chrome-trace categories of device work
# kernel-name fragments of each group of ``--phase mixed`` (first match wins; the rest is "other")
# (pwkernels' kernels by name; torch._grouped_mm's CUTLASS kernels count as MoE, cuBLAS GEMMs as "other")
GROUPS = (("attention", ("_varlen_kernel", "_decode_kernel", "_merge_kernel", "_rope_kv", "flash", "attn")),
          ("moe", ("_dequant_kernel", "_silu_mul", "_gather_sum", "_sort_pairs", "_combine_kernel", "_route_kernel",
                   "gate_up_kernel", "_down_kernel", "group", "cutlass")))


def kernel_summary(events: list[dict[str, Any]], steps: int, top: int = 25) -> dict[str, Any]:
    """Per step: GPU busy ms (union of the device intervals), kernels, their summed ms, and the ``top`` names by
    time as [name, us per step, launches per step] of the chrome-trace ``events`` of ``steps`` steps."""
    dev = [e for e in events if e.get("cat") in DEVICE_KINDS and "dur" in e]
    by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in dev:
        by[e["name"]][0] += e["dur"]
        by[e["name"]][1] += 1
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in dev):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    ranked = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    groups: dict[str, float] = defaultdict(float)
    for name, (us, _) in by.items():
        low = name.lower()
        groups[next((g for g, keys in GROUPS if any(k in low for k in keys)), "other")] += us / steps / 1e3
    return {"gpu_busy_ms": busy / steps / 1e3, "kernels_per_step": len(dev) / steps,
            "kernel_sum_ms": sum(v[0] for v in by.values()) / steps / 1e3,
            "group_ms": {g: round(v, 3) for g, v in sorted(groups.items())},
            "kernels": [[name[:120], round(us / steps, 2), round(n / steps, 2)] for name, (us, n) in ranked]}


def _decode(e: LLMEngine) -> bool:
    r = e.trace[-1]
    return r.step_tokens == r.running > 0 and not r.graph_captured


def _mixed(e: LLMEngine) -> bool:
    r = e.trace[-1]
    return 0 < r.prefill_tokens < r.step_tokens


def profile_steps(e: LLMEngine, steps: int, cuda: bool, batch: int, phase: str = "decode") -> dict[str, Any]:
    """Serve ``e`` until 4 steps of ``phase`` (decode: of all ``batch`` requests) have run, then profile ``steps``
    more; the record's timing fields."""
    seen, want = 0, _decode if phase == "decode" else _mixed
    while seen < 4:
        if e.idle:
            raise RuntimeError(f"the requests finished before 4 {phase} steps: the budget holds fewer than "
                               "--batches requests at once (raise --gpu-memory-gib) or the prompts are too short")
        e.step()
        seen += want(e) and (phase != "decode" or e.trace[-1].running == batch)
    if cuda:
        torch.cuda.synchronize()
    first = len(e.trace)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            e.step()
        if cuda:
            torch.cuda.synchronize()
    rows = e.trace[first:]
    if not all(r.step_tokens == r.running > 0 if phase == "decode" else 0 < r.prefill_tokens < r.step_tokens
               for r in rows):
        raise RuntimeError(f"a profiled step was not a {phase} step: lower --steps (or raise --batches for mixed)")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    host: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # CUDA runtime/driver calls: [us, calls]
    for ev in events:
        if ev.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in ev:
            host[ev["name"]][0] += ev["dur"]
            host[ev["name"]][1] += 1
    ops = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:12]
    return {"steps": steps, "step_ms": 1e3 * sum(r.seconds for r in rows) / steps,
            "runtime_calls": [[n[:80], round(us / steps / 1e3, 3), round(c / steps, 1)]
                              for n, (us, c) in sorted(host.items(), key=lambda kv: -kv[1][0])[:10]],
            "cpu_ops_self_ms": [[a.key[:80], round(a.self_cpu_time_total / steps / 1e3, 3), round(a.count / steps, 1)]
                                for a in ops],
            "model_ms": 1e3 * sum(r.model_seconds for r in rows) / steps,
            "step_tokens": sum(r.step_tokens for r in rows) / steps,
            "prefill_tokens": sum(r.prefill_tokens for r in rows) / steps,
            "mean_bits": sum(sum(b * n for b, n in enumerate(r.bits_hist)) / max(sum(r.bits_hist), 1)
                             for r in rows) / steps,
            **kernel_summary(events, steps)}


def _release(dev: str) -> None:
    """Free the page pool of an engine just dropped (reference cycles hold it until a collection)."""
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-dir", type=Path, required=True, help="a directory with the model's config.json")
    ap.add_argument("--batches", default="1", help="requests per run, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=2048, help="tokens per prompt")
    ap.add_argument("--step-tokens", default="2048", help="the engine's max_step_tokens (tokens per step at most), "
                    "comma-separated: one run each")
    ap.add_argument("--bits", type=int, default=4, help="uniform bitwidth of every expert block")
    ap.add_argument("--policy", choices=("uniform", "pagedweight", "16-bit"), default="uniform",
                    help="uniform --bits, the planner's mixed bitwidths under --gpu-memory-gib, or the 16-bit experts")
    ap.add_argument("--phase", choices=("decode", "mixed"), default="decode",
                    help="profile decode steps, or steps that run prompt chunks beside decodes")
    ap.add_argument("--steps", type=int, default=10, help="decode steps profiled")
    ap.add_argument("--eager", action="store_true", help="without CUDA graphs (host launch gaps show)")
    ap.add_argument("--gpu-memory-gib", type=float, default=40.0, help="the engine's device budget, GiB")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSONL (default bench/results/decode_profile.jsonl)")
    args = ap.parse_args()
    env, dev = environment(args.label), args.device
    model = random_model(args.config_dir, torch.bfloat16, dev)
    spec = model.spec
    src, table = SyntheticAP(spec, torch.bfloat16, dev), synthetic_table(spec)
    experts = HostExperts(model) if args.policy == "16-bit" else None
    stripped = strip_experts(model, torch.device(dev))
    del model
    for b, st in ((int(x), int(y)) for x in args.batches.split(",") for y in args.step_tokens.split(",")):
        pol = Policy.named("uniform", args.bits) if args.policy == "uniform" else Policy.named(args.policy)
        cfg = ServeConfig(int(args.gpu_memory_gib * 2**30), pol,
                          EngineConfig(max_batch=b, max_step_tokens=st, cuda_graphs=not args.eager),
                          BENCH_PLANNER)
        reqs = prompts(b, args.prompt_len, spec.vocab_size, b)

        def build(n: int, reqs: list[list[int]] = reqs, cfg: ServeConfig = cfg) -> LLMEngine:
            if experts is not None:
                return assemble_dense_engine(stripped, experts, cfg, SamplingParams(max_new_tokens=n), reqs, set())
            return assemble_engine(stripped, src, table, BENCH_POLICY, None, None, cfg,
                                   SamplingParams(max_new_tokens=n), reqs, set())

        build(3).run_until_done()  # compiles and graph captures out of the profile
        _release(dev)  # that engine's page pool goes before the profiled one takes its own
        # new tokens: the prompts' prefill steps (requests decode beside later prompts' chunks), then the warm-up
        # and profiled decode steps of the whole batch
        e = build(-(-b * args.prompt_len // st) + args.steps + 16)
        rec = {"model": args.config_dir.name, "batch": b, "graphs": not args.eager, "phase": args.phase,
               "policy": args.policy, "bits": args.bits if args.policy == "uniform" else None,
               "prompt_len": args.prompt_len, "step_tokens_max": st,
               **profile_steps(e, args.steps, dev == "cuda", b, args.phase)}
        del e
        _release(dev)  # and the profiled one's before the next batch size builds
        if experts is not None:
            rec["mean_bits"] = 16.0  # the trace's bit histogram covers AP blocks only
        write_records("decode_profile", [rec], env, args.out)
        print(f"{rec['model']} b{b} step tokens {st} {'graphs' if rec['graphs'] else 'eager'}: step "
              f"{rec['step_ms']:.2f} ms, model "
              f"{rec['model_ms']:.2f} ms, GPU busy {rec['gpu_busy_ms']:.2f} ms, {rec['kernels_per_step']:.0f} "
              f"kernels/step, {rec['step_tokens']:.0f} tokens/step ({rec['prefill_tokens']:.0f} prompt), mean bits "
              f"{rec['mean_bits']:.2f}, groups ms {rec['group_ms']}")
        for name, us, n in rec["kernels"][:15]:
            print(f"  {us:9.1f} us/step {n:6.1f}/step  {name[:90]}")
        for title, key in (("CUDA runtime calls", "runtime_calls"), ("CPU ops by self time", "cpu_ops_self_ms")):
            print(f"  {title} (ms/step, calls/step): " + "; ".join(f"{n} {ms:.2f} x{c:g}" for n, ms, c in rec[key]))


if __name__ == "__main__":
    main()
