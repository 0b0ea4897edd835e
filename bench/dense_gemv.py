# ruff: noqa: B023  (the timed closures run inside their loop iteration)
"""Dense GEMV suite: decode GEMVs of the 16-bit linears, cuBLAS (``F.linear``) against ``pwkernels/dense_gemv.py``.

What it does: for the linears a decode step reads once (Qwen1.5-MoE, Mixtral and Gemma-4 shapes: q, k, v separately
and fused, o_proj, routers, Gemma-4's dense MLP, LM head), after compiling every tile in ``--workers`` processes,
at T = 1 and 4 tokens, times ``F.linear`` and the Triton GEMV over a
grid of tiles (GPU time of a CUDA-graph replay of 24 calls cycling over copies of the weight that make 240 MB, so
each call reads its weight from HBM as in a decode step; median of 5), checks every Triton result against
``F.linear`` (max |diff| / max |ref|) and records us per call, % of the copy bandwidth (weight bytes / time, read +
write counted as the other floors) and the best tile. ``--write-configs F`` writes the best T = 1 tile per shape
into F (``pwkernels/configs/dense_gemv.json`` layout). One record per (linear, T) in ``bench/results/dense_gemv.jsonl``.

Usage (GPU machine)::

    python -m bench.dense_gemv [--quick] [--ts 1,4] [--shapes router] [--write-configs F] [--workers 8]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import copy_bandwidth, environment, graph_ms, write_records
from pwkernels.dense_gemv import gemv, pick_config
from pwkernels.warmup import default_workers, run_in_workers

# name: (N, K, bias)
SHAPES = {
    "qwen q|k|v (x3)": (2048, 2048, True),
    "qwen qkv fused": (6144, 2048, True),
    "qwen o_proj": (2048, 2048, False),
    "qwen router+gate": (61, 2048, False),
    "qwen lm_head": (151936, 2048, False),
    "mixtral qkv fused": (6144, 4096, False),
    "mixtral o_proj": (4096, 4096, False),
    "mixtral router": (8, 4096, False),
    "gemma sliding qkv fused": (8192, 2816, False),  # 16 x 256 + 2 x 8 x 256
    "gemma global qk fused (v = k)": (9216, 2816, False),  # 16 x 512 + 2 x 512
    "gemma sliding o_proj": (2816, 4096, False),
    "gemma global o_proj": (2816, 8192, False),
    "gemma router": (128, 2816, False),
    "gemma dense mlp gate_up": (4224, 2816, False),
    "gemma dense mlp down": (2816, 2112, False),
    "gemma lm_head": (262144, 2816, False),
}


def _compile_job(job: tuple[int, int, bool, int, dict[str, int]]) -> str:
    """Worker: one call of ``gemv`` with tile ``cfg`` on an [N, K] weight at T tokens, so that its kernel lands in
    Triton's on-disk cache before the timed sweep; "" or the error (the sweep reports a tile that fails itself)."""
    n, k, has_bias, t, cfg = job
    try:
        w = torch.zeros(n, k, dtype=torch.bfloat16, device="cuda")
        b = torch.zeros(n, dtype=torch.bfloat16, device="cuda") if has_bias else None
        gemv(torch.zeros(t, k, dtype=torch.bfloat16, device="cuda"), w, b, cfg)
        torch.cuda.synchronize()
        return ""
    except Exception as err:
        return f"{n}x{k} T={t} {cfg}: {type(err).__name__}: {str(err)[:160]}"


def graph_us(fn: Callable[[int], object], calls: int = 24) -> float:
    """GPU microseconds per call of ``fn(i)``, i = 0..calls-1 (CUDA-graph replay, median of 5)."""
    return 1e3 * graph_ms(fn, calls, reps=5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="3 tiles instead of the grid")
    ap.add_argument("--ts", default="1,4")
    ap.add_argument("--shapes", default="", help="only the linears whose name contains this (e.g. router)")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSONL (default bench/results/dense_gemv.jsonl)")
    ap.add_argument("--write-configs", type=Path, help="write the best T = 1 tile per shape into this JSON "
                    "(pwkernels/configs/dense_gemv.json layout, by_shape)")
    ap.add_argument("--workers", type=int, default=default_workers(),
                    help="processes that compile every (shape, T, tile) before the timed sweep (0: compile as timed)")
    args = ap.parse_args()
    env = environment(args.label)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    grid = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw) for bn, bk, nw in
            itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (4, 8))]
    if args.quick:
        grid = [dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4), dict(BLOCK_N=2, BLOCK_K=1024, num_warps=4),
                dict(BLOCK_N=8, BLOCK_K=512, num_warps=4)]
    rows = []
    shapes = {name: v for name, v in SHAPES.items() if args.shapes in name}
    ts = [int(v) for v in args.ts.split(",")]
    if args.workers > 0:  # serially, each tile's first call compiles for a second or more: minutes over the grid
        jobs = [(n, k, has_bias, t, cfg) for (n, k, has_bias), t in itertools.product(shapes.values(), ts)
                for cfg in grid + ([pick_config(n, k)] if args.quick else [])]
        start = time.perf_counter()
        errors = run_in_workers(_compile_job, jobs, args.workers)
        print(f"compiled {len(jobs)} (shape, T, tile) calls in {time.perf_counter() - start:.0f} s on "
              f"{args.workers} processes ({len(errors)} failed; the sweep reports them)", flush=True)
    for (name, (n, k, has_bias)), t in itertools.product(shapes.items(), ts):
        # as many copies of the weight as make 240 MB, called in turn: as in a decode step, every call reads its
        # weight from HBM (one copy would stay in the 50 MB L2 across calls)
        ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k**0.5
              for _ in range(max(1, -(-240 * 2**20 // (2 * n * k))))]
        w = ws[0]
        b = torch.randn(n, dtype=torch.bfloat16, device="cuda") if has_bias else None
        x = torch.randn(t, k, dtype=torch.bfloat16, device="cuda")
        ref = F.linear(x, w, b).float()
        base = graph_us(lambda i: F.linear(x, ws[i % len(ws)], b))
        best, best_cfg, worst_err = float("inf"), None, 0.0
        for cfg in grid + ([pick_config(n, k)] if args.quick else []):  # --quick: also the tile in force
            try:
                y = gemv(x, w, b, cfg)
                us = graph_us(lambda i: gemv(x, ws[i % len(ws)], b, cfg))
            except Exception as err:  # a tile that does not compile is reported, not fatal
                print(f"{name} T={t} {cfg}: {type(err).__name__} {str(err)[:120]}")
                continue
            worst_err = max(worst_err, float((y.float() - ref).abs().max() / ref.abs().max()))
            if us < best:
                best, best_cfg = us, cfg
        wbytes = w.numel() * 2
        row = dict(shape=name, n=n, k=k, t=t, cublas_us=base, triton_us=best, speedup=base / best,
                   cublas_pct_bw=wbytes / bw / (base * 1e-6) * 100, triton_pct_bw=wbytes / bw / (best * 1e-6) * 100,
                   config=best_cfg, rel_err=worst_err)
        rows.append(row)
        print(f"{name:20} T={t} cuBLAS {base:7.1f} us ({row['cublas_pct_bw']:5.1f}% bw)  Triton {best:7.1f} us "
              f"({row['triton_pct_bw']:5.1f}% bw)  x{base / best:4.2f}  {best_cfg}  err {worst_err:.1e}", flush=True)
    write_records("dense_gemv", ({**r, "copy_bandwidth_TBps": round(bw / 1e12, 3)} for r in rows), env, args.out)
    if args.write_configs:
        cfgs = json.loads(args.write_configs.read_text())
        for r in rows:  # T = 1 only: configs are per shape (T >= 2: max_tokens / max_tokens_small_n)
            if r["t"] == 1 and r["config"]:
                cfgs["by_shape"][f"{r['n']}x{r['k']}"] = r["config"]
        args.write_configs.write_text(json.dumps(cfgs, indent=1) + "\n")


if __name__ == "__main__":
    main()
