# ruff: noqa: B023  (the timed closures run inside their loop iteration)
"""Decode GEMVs of the non-expert linears: cuBLAS (``F.linear``) against ``kernels/dense_gemv.py`` (GPU only).

What it does: for the 16-bit linears a decode step reads once (Qwen1.5-MoE and Mixtral shapes: q, k, v
separately and fused, o_proj, router + shared gate, LM head), at T = 1 and 4 tokens, times (GPU time of
a CUDA-graph replay of 24 calls cycling over copies of the weight that make 240 MB, so that each call
reads its weight from HBM as in a decode step; median of 5) ``F.linear`` and the Triton GEMV over a
small grid of tiles; checks every Triton result against
``F.linear`` (max |diff| / max |ref|) and prints one table: us per call, % of the copy bandwidth (weight
bytes / time against the device-to-device copy rate, read + write counted as the floor convention of
``bench/ap_moe_speed.py``), the best tile per shape. Usage::

    PYTHONPATH=$PWD python bench/dense_gemv_speed.py [--quick] [--out-md bench/results/dense_gemv_h200.md]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.dense_gemv import gemv, pick_config

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
}


def graph_us(fn, calls: int = 24) -> float:
    """GPU microseconds per call of ``fn(i)``, i = 0..calls-1 (CUDA-graph replay, median of 5)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(ts)[2]


def copy_bandwidth() -> float:
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = graph_us(lambda i: y.copy_(x), calls=5)
    return 2 * x.numel() / (us * 1e-6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="3 tiles instead of the grid")
    ap.add_argument("--ts", default="1,4")
    ap.add_argument("--shapes", default="", help="only the linears whose name contains this (e.g. router)")
    ap.add_argument("--out-md", type=Path)
    ap.add_argument("--write-configs", type=Path, help="write the best T = 1 tile per shape into this JSON "
                    "(kernels/configs/dense_gemv.json layout, by_shape)")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    grid = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw) for bn, bk, nw in
            itertools.product((1, 2, 4, 8, 16), (512, 1024, 2048), (4, 8))]
    if args.quick:
        grid = [dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4), dict(BLOCK_N=2, BLOCK_K=1024, num_warps=4),
                dict(BLOCK_N=8, BLOCK_K=512, num_warps=4)]
    rows = []
    shapes = {name: v for name, v in SHAPES.items() if args.shapes in name}
    for (name, (n, k, has_bias)), t in itertools.product(shapes.items(), [int(v) for v in args.ts.split(",")]):
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
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, date=str(datetime.date.today()),
                copy_bandwidth_TBps=bw / 1e12, command="python bench/dense_gemv_speed.py " +
                (" ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v not in (None, False))))
    if args.write_configs:
        cfgs = json.loads(args.write_configs.read_text())
        for r in rows:  # T = 1 only: configs are per shape (T >= 2: max_tokens / max_tokens_small_n)
            if r["t"] == 1 and r["config"]:
                cfgs["by_shape"][f"{r['n']}x{r['k']}"] = r["config"]
        args.write_configs.write_text(json.dumps(cfgs, indent=1) + "\n")
    if args.out_md:
        lines = ["# Decode GEMV of the 16-bit linears: cuBLAS (F.linear) vs kernels/dense_gemv.py", "",
                 f"`{json.dumps(meta)}`", "",
                 "GPU time per call of a CUDA-graph replay (24 calls cycling over copies of the weight that make "
                 "240 MB, so that each call reads from HBM, not L2; median of 5); % bw = weight bytes / time "
                 "against the copy bandwidth (read + write counted, as the floors elsewhere); rel. err = the worst "
                 "Triton tile's max |diff| / max |F.linear|.", "",
                 "| linear | N x K | T | F.linear us | % bw | Triton us | % bw | speed-up | tile (BN, BK, warps) "
                 "| rel. err |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            c = r["config"] or {}
            lines.append(f"| {r['shape']} | {r['n']} x {r['k']} | {r['t']} | {r['cublas_us']:.1f} | "
                         f"{r['cublas_pct_bw']:.1f} | {r['triton_us']:.1f} | {r['triton_pct_bw']:.1f} | "
                         f"{r['speedup']:.2f}x | {c.get('BLOCK_N')}, {c.get('BLOCK_K')}, {c.get('num_warps')}"
                         " | "
                         f"{r['rel_err']:.1e} |")
        args.out_md.write_text("\n".join(lines) + "\n")
        args.out_md.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
