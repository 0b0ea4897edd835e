"""16-bit MoE kernel suite: the page-pool bf16 MoE paths (``pwkernels.moe.dense``) against torch's grouped GEMM and
the floor, over a grid of launch tiles.

What it does: for each expert shape (routed Qwen1.5-MoE, its shared expert, Mixtral-8x7B, Gemma-4-26B-A4B) with
random bf16 weights in one pool (``build_dense_experts``) and a random softmax router, and each token count T,
checks every candidate tile against the reference (``dense_moe_ref``), then times it (CUDA-graph replay up to 64
tokens, as a decode step runs it; CUDA events above) beside the dense baseline (``bench.moe_kernel.dense_grouped``,
``torch._grouped_mm`` on the expert-sorted pairs) and the floor: the bytes of the distinct experts the batch routes
to plus activations, at the measured copy bandwidth. One record per (shape, T): the best GEMV and grouped-GEMM tile
and their times, the shipped default's time (``DenseMoEConfig()``) and its share of the floor. What to ship as the
default is read from these records.

Usage (GPU machine)::

    python -m bench.dense_moe [--shapes qwen1.5-moe,mixtral-8x7b] [--ts 1,4,16,64,512]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from bench.common import copy_bandwidth, environment, event_ms, graph_ms, write_records
from bench.moe_kernel import SHAPES, dense_grouped
from pwkernels.moe.dense import dense_moe
from pwkernels.moe.experts import build_dense_experts
from pwkernels.moe.launch import DenseGemmTile, DenseGemvTile, DenseMoEConfig
from pwkernels.moe.ref import dense_moe_ref

GEMV_TILES = [DenseGemvTile(bn, bk, w, split) for bn, bk, w, split in (
    (16, 256, 4, 0), (32, 256, 4, 0), (16, 512, 4, 0), (32, 512, 8, 0), (16, 256, 4, 2), (16, 512, 4, 2),
    (16, 512, 4, 4), (16, 512, 8, 4), (32, 512, 4, 4), (8, 512, 4, 4), (8, 1024, 4, 4), (16, 1024, 4, 4),
    (16, 512, 4, 8), (8, 512, 4, 8), (16, 2048, 8, 4), (8, 2048, 4, 4), (32, 1024, 8, 4))]
GEMM_TILES = [DenseGemmTile(bm, bn, bk, w) for bm, bn, bk, w in (
    (16, 64, 64, 4), (32, 64, 64, 4), (64, 64, 64, 4), (64, 128, 64, 8), (128, 128, 64, 8), (32, 128, 128, 8))]
MAX_GEMV_T = 64  # GEMV tiles are timed up to this many tokens (each pair re-reads its expert)


def time_ms(fn: Any, t: int, reps: int) -> float:
    """Graph-replay ms per call up to 64 tokens (a decode step's launches), event ms above."""
    return graph_ms(lambda _: fn(), 1, reps) if t <= 64 else event_ms(fn, max(5, reps // 2))


def run_shape(name: str, s: dict[str, Any], ts: list[int], bw: float, reps: int) -> list[dict[str, Any]]:
    e, hdim, inter, k = s["experts"], s["hidden"], s["inter"], s["topk"]
    act = s.get("activation", "silu")
    torch.manual_seed(0)
    gate_up = torch.randn(e, 2 * inter, hdim, device="cuda", dtype=torch.bfloat16) * hdim**-0.5
    down = torch.randn(e, hdim, inter, device="cuda", dtype=torch.bfloat16) * inter**-0.5
    blocks = [w for u in range(e) for w in (gate_up[u], down[u])]
    ex = build_dense_experts(blocks, hdim, inter, torch.bfloat16, "cuda")
    rows = []
    for t in ts:
        g = torch.Generator(device="cuda").manual_seed(t)
        x = torch.randn(t, hdim, device="cuda", dtype=torch.bfloat16, generator=g)
        w, ids = torch.softmax(torch.randn(t, e, device="cuda", generator=g), -1).topk(k, -1)
        ref = dense_moe_ref(x, ids, w, ex, act).float()
        used = ids.unique().numel()
        floor_ms = (used * 3 * inter * hdim * 2 + 2 * x.numel() * 2) / bw * 1e3
        times: dict[str, float] = {}
        worst = 0.0
        tiles: list[DenseGemvTile | DenseGemmTile | DenseMoEConfig] = [
            *(GEMV_TILES if t <= MAX_GEMV_T else []), *GEMM_TILES, DenseMoEConfig()]
        for tile in tiles:
            try:
                got = dense_moe(x, ids, w, ex, tile, act).float()
                worst = max(worst, ((got - ref).norm() / ref.norm()).item())
                times[repr(tile)] = time_ms(lambda: dense_moe(x, ids, w, ex, tile, act), t, reps)  # noqa: B023
            except Exception as err:  # a tile that does not compile or fit is skipped, the others still run
                print(f"{name} T={t} {tile}: {type(err).__name__}: {str(err)[:200]}", flush=True)
        try:
            base = time_ms(lambda: dense_grouped(x, ids, w, gate_up, down, act), t, reps)  # noqa: B023
        except (RuntimeError, AttributeError):
            base = float("inf")
        default = times.pop(repr(DenseMoEConfig()), float("nan"))
        gemv = {key: v for key, v in times.items() if key.startswith("DenseGemvTile")}
        gemm = {key: v for key, v in times.items() if key.startswith("DenseGemmTile")}
        best_v = min(gemv, key=gemv.__getitem__) if gemv else None
        best_m = min(gemm, key=gemm.__getitem__) if gemm else None
        best = min(times.values()) if times else float("nan")
        rows.append({"shape": name, "T": t, "experts_used": used, "floor_ms": round(floor_ms, 4),
                     "default_ms": round(default, 4), "best_ms": round(best, 4),
                     "best_gemv": best_v, "best_gemv_ms": round(gemv[best_v], 4) if best_v else None,
                     "best_gemm": best_m, "best_gemm_ms": round(gemm[best_m], 4) if best_m else None,
                     "torch_grouped_mm_ms": round(base, 4), "pct_of_floor_default": round(100 * floor_ms / default, 1),
                     "pct_of_floor_best": round(100 * floor_ms / best, 1), "max_rel_err": f"{worst:.2e}",
                     "all_ms": {key: round(v, 4) for key, v in times.items()}})
        print(json.dumps({k2: v for k2, v in rows[-1].items() if k2 != "all_ms"}), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen1.5-moe,qwen1.5-moe-shared,mixtral-8x7b,gemma-4-26b-a4b",
                    help=f"comma-separated of {', '.join(SHAPES)}")
    ap.add_argument("--ts", default="1,2,4,8,16,32,64,128,512,2048", help="comma-separated token counts T")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSONL (default bench/results/dense_moe.jsonl)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.dense_moe needs a CUDA GPU")
    bad = [s for s in args.shapes.split(",") if s not in SHAPES]
    if bad:
        raise SystemExit(f"unknown shapes {bad}; choose from {', '.join(SHAPES)}")
    env = environment(args.label)
    bw = copy_bandwidth()
    ts = [int(t) for t in args.ts.split(",")]
    for name in args.shapes.split(","):
        write_records("dense_moe", run_shape(name, SHAPES[name], ts, bw, args.reps), env, args.out)


if __name__ == "__main__":
    main()
