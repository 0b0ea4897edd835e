"""Attention suite: paged decode attention (``pwkernels/paged_attention.py``), launch configs against the default.

For each head shape (Qwen1.5-MoE 16x16x128, Mixtral 32x8x128, a Qwen3-MoE-like 32x4x128) and batch S, every
sequence at ``--ctx`` positions of a paged cache laid out as the runtime's (K and V units of one tensor, placed
at random through separate K and V block tables, block size 16), it times the default config and each candidate
(GPU time of CUDA-graph replays), checks each output against ``paged_decode_attention_ref``, and records the
default and the best against the floor (K + V bytes the step must read / copy bandwidth). Candidates: BLOCK_N x
num_warps x DOT (tensor-core or fp32 broadcast products) x split policy (min_split_tokens, programs_per_sm).
``--write-configs F`` stores, per shape, the winner of each batch as a bucket (``min_seqs`` = that batch) where
it beat the default by more than 3%. One record per (shape, S) in ``bench/results/attention.jsonl``.

Usage (GPU machine)::

    python -m bench.attention [--batches 1,4,16] [--ctx 2048] [--quick] [--write-configs F]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import copy_bandwidth, environment, graph_ms, write_records
from pwkernels import paged_attention as pa

SHAPES = {"qwen1.5-moe": (16, 16, 128), "mixtral-8x7b": (32, 8, 128), "qwen3-moe-like": (32, 4, 128)}
SPLITS = [(64, 4), (128, 2), (128, 4), (256, 2), (512, 1)]  # (min_split_tokens, programs_per_sm)


def grid(quick: bool) -> list[dict[str, Any]]:
    base = pa.CONFIGS["default"]
    bns, warps = ([32, 64], [4]) if quick else ([32, 64, 128], [2, 4, 8])
    return [{**base, "BLOCK_N": bn, "num_warps": w, "DOT": dot, "min_split_tokens": ms, "programs_per_sm": pps}
            for bn, w, dot, (ms, pps) in itertools.product(bns, warps, (1, 0), SPLITS)]


def case(s: int, hq: int, hkv: int, d: int, ctx: int, bs: int = 16, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    nb = -(-ctx // bs)
    units = torch.randperm(2 * s * nb + 8, device="cuda", generator=g)[: 2 * s * nb].view(2, s, nb).to(torch.int32)
    pages = torch.randn(2 * s * nb + 8, bs, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.full((s,), ctx, dtype=torch.int32, device="cuda")
    return {"q": q, "pages": pages, "kt": units[0].contiguous(), "vt": units[1].contiguous(), "lens": lens}


def run(c: dict[str, Any], cfg: dict[str, Any] | None) -> torch.Tensor:
    return pa.paged_decode_attention(c["q"], c["pages"], c["pages"], c["kt"], c["lens"], c["q"].shape[-1] ** -0.5,
                                     v_block_tables=c["vt"], config=cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--quick", action="store_true", help="BLOCK_N 32/64 and 4 warps only")
    ap.add_argument("--time-limit", type=float, default=0.0, help="seconds; later (shape, batch) rows are skipped")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSONL (default bench/results/attention.jsonl)")
    ap.add_argument("--write-configs", default="", help="configs JSON to update with winners that beat the default")
    args = ap.parse_args()
    env = environment(args.label)
    t0 = time.time()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    rows: list[dict[str, Any]] = []
    for name in args.shapes.split(","):
        hq, hkv, d = SHAPES[name]
        for s in (int(b) for b in args.batches.split(",")):
            if args.time_limit and time.time() - t0 > args.time_limit:
                print(f"time limit: skipped {name} S={s}", flush=True)
                continue
            c = case(s, hq, hkv, d, args.ctx)
            ref = pa.paged_decode_attention_ref(c["q"], c["pages"], c["pages"], c["kt"], c["lens"], d**-0.5,
                                                v_block_tables=c["vt"]).float()
            floor_us = 1e6 * (2 * s * args.ctx * hkv * d * 2 + 2 * s * hq * d * 2) / bw
            default = pa.pick_config(s, hq, hkv, d)
            base_us = 1e3 * graph_ms(lambda _: run(c, default))  # noqa: B023
            best: tuple[float, dict[str, Any]] = (base_us, default)
            tried = failed = 0
            for cfg in grid(args.quick):
                try:
                    got = run(c, cfg).float()
                    err = float((got - ref).norm() / ref.norm())
                    if err > 1e-2:
                        raise AssertionError(f"relative error {err:.2e}")
                    us = 1e3 * graph_ms(lambda _: run(c, cfg))  # noqa: B023
                except Exception as e:  # a config that does not compile or is wrong is just not a candidate
                    failed += 1
                    print(f"{name} S={s} {json.dumps(cfg)} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                tried += 1
                if us < best[0]:
                    best = (us, cfg)
            splits = pa.pick_num_splits(s, hkv, args.ctx, torch.cuda.get_device_properties(0).multi_processor_count,
                                        best[1])
            rows.append({"shape": name, "heads": f"{hq}x{hkv}x{d}", "S": s, "ctx": args.ctx,
                         "default_us": round(base_us, 2), "best_us": round(best[0], 2),
                         "speedup": round(base_us / best[0], 2), "floor_us": round(floor_us, 2),
                         "default_pct_of_floor": round(100 * floor_us / base_us, 1),
                         "best_pct_of_floor": round(100 * floor_us / best[0], 1), "best_splits": splits,
                         "best_cfg": best[1], "tried": tried, "failed": failed})
            print(json.dumps(rows[-1]), flush=True)
    write_records("attention", ({**r, "copy_bandwidth_TBps": round(bw / 1e12, 3)} for r in rows), env, args.out)
    if args.write_configs:
        write_configs(args.write_configs, rows)


def write_configs(path: str, rows: list[dict[str, Any]]) -> None:
    """Per shape, a bucket for each measured batch whose winner beat the default by > 3% (else the default's
    values, so a bucket never carries an untested config past its batch)."""
    configs = json.loads(Path(path).read_text())
    default = configs["default"]
    by: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: r["S"]):
        cfg = r["best_cfg"] if r["speedup"] > 1.03 else default
        by.setdefault(r["heads"], []).append({"min_seqs": r["S"], "config": {k: v for k, v in cfg.items()
                                                                              if default.get(k) != v}})
    for heads, buckets in by.items():
        configs["by_shape"][heads] = [b for i, b in enumerate(buckets)
                                      if i == 0 or b["config"] != buckets[i - 1]["config"]]
    Path(path).write_text(json.dumps(configs, indent=1) + "\n")
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
