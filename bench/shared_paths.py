"""Qwen's shared expert (one expert, every token) at 8..32 tokens: every MoE path against the committed one (issue 8).

Why: the batch-16 decode profile (sixteenth session, ``bench/results/profile_decode_u4_b16_s16_h200.txt``) found
the shared expert on the ``fused`` tile path at 240 us per layer; ``gemv1`` with 4 sorted slots took it to ~108 us
at q = 4 (``gemv_probe/gemv1_shared16_s16_h200.txt``), still ~4% of its floor: 16 tokens times 34.6M weights on
CUDA cores. The ``dequant`` path (the expert dequantized once into bf16, then two cuBLAS GEMMs: ~155 MB of
traffic at q = 4, ~40 us at the copy bandwidth) was never timed below 64 tokens for this shape, nor ``fused`` with
narrow tiles (its 176 programs of 64 columns ran latency-bound).

What it does: for each T of ``--ts`` and q of ``--qs``, a random shared expert (``kernels.warmup.random_experts``)
and every candidate of ``candidates`` (the committed config; ``gemv1`` with 4 and 8 sorted slots; ``dequant`` and
narrow ``fused`` tiles), each checked against ``ap_moe_ref`` (relative error) and timed as CUDA-graph replays
(``gemv_probe.graph_ms``: decode steps are graph-captured). Per T the candidate with the least time summed over
the q's wins; ``--write-configs F`` puts it into T's bucket of F (``gemv_compare.write_configs``: T = 8 -> 5..8,
16 -> 9..16, 32 -> 17..32) where it beat the committed config in that sum.

Usage (GPU machine): python bench/shared_paths.py [--ts 8,16,32] [--qs 4,5,6] [--workers 12] [--write-configs F]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

sys.path.insert(0, ".")

from bench.ap_moe_speed import DEQUANT  # the dequantize tiles the tuner tries

FAMILY = "qwen1.5-moe-shared"
# gemv1 tiles that won the shared expert's 9..16-token bucket over fused (sixteenth session, 4 sorted slots; the
# dequant path has held that bucket since), tried with 4 and 8 slots
GEMV1_TILES = {"gate_up": {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4, "RAW_SHFL": 0},
               "down": {"BLOCK_N": 32, "BLOCK_K": 1024, "num_warps": 8, "SPLIT_K": 2, "RAW_SHFL": 0}}
FUSED = [{"path": "fused", "SPREAD": 1, "BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}
         for bn, bk, w in ((16, 128, 4), (32, 64, 4), (32, 128, 4), (16, 256, 4))]


def candidates(committed: dict[str, Any]) -> list[dict[str, Any]]:
    """The committed config first, then gemv1 with 4 / 8 sorted slots, dequant and fused tiles (no duplicates)."""
    out = [committed] + [{"path": "gemv1", **GEMV1_TILES, "SLOTS": s} for s in (4, 8)] + DEQUANT + FUSED
    unique: dict[str, dict[str, Any]] = {}
    for c in out:
        unique.setdefault(json.dumps(c, sort_keys=True), c)
    return list(unique.values())


def sum_row(t: int, cands: list[dict[str, Any]], us: list[list[float]]) -> dict[str, Any]:
    """The row ``gemv_compare.write_configs`` reads (q "sum"): ``us[i]`` holds candidate i's times over the q's;
    candidate 0 is the committed config (the baseline)."""
    total = [sum(u) if u and not any(math.isnan(v) for v in u) else math.inf for u in us]  # NaN / none: never wins
    best = min(range(len(cands)), key=lambda i: total[i])
    speedup = total[0] / total[best] if math.isfinite(total[best]) else 1.0  # nothing ran: keep the committed one
    return {"shape": FAMILY, "q": "sum", "T": t, "experts": 1, "base_us": round(total[0], 1),
            "base_path": cands[0]["path"], "new_us": round(total[best], 1), "speedup": round(speedup, 2),
            "new_cfg": cands[best], "sums_us": [round(v, 1) for v in total]}


def main() -> None:
    from bench.ap_moe_speed import ALL_SHAPES, fake_experts, precompile
    from bench.gemv_compare import inputs, timed, write_configs
    from kernels.ap_moe import CONFIGS, ap_moe, ap_moe_ref, pick_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ts", default="8,16,32", help="token counts (each stands for its bucket, see above)")
    ap.add_argument("--qs", default="4,5,6", help="bitwidths timed (PagedWeight keeps the shared expert at 4-6)")
    ap.add_argument("--workers", type=int, default=12, help="parallel compile processes")
    ap.add_argument("--write-configs", default="", help="configs JSON to update with the winners")
    args = ap.parse_args()
    s = ALL_SHAPES[FAMILY]
    ts, qs = ([int(v) for v in a.split(",")] for a in (args.ts, args.qs))
    rows: list[dict[str, Any]] = []
    for t in ts:
        cands = candidates(pick_config(t, s["hidden"], s["inter"], CONFIGS))
        precompile([(FAMILY, t, c) for c in cands], args.workers)
        us: list[list[float]] = [[] for _ in cands]
        for q in qs:
            ex = fake_experts(s, q, 1)
            x, ids, w = inputs(s, t, 1)
            ref = ap_moe_ref(x, ids, w, ex).float()
            for i, c in enumerate(cands):
                try:
                    u, err = timed(lambda: ap_moe(x, ids, w, ex, config=c, check=False), ref)  # noqa: B023
                except Exception as e:  # a tile that does not compile or run is reported, not fatal
                    print(f"T={t} q={q} {json.dumps(c)}: {type(e).__name__} {str(e)[:160]}", flush=True)
                    u, err = float("inf"), float("nan")
                if not err < 1e-2:  # a wrong result never wins
                    u = float("inf")
                us[i].append(u)
                print(json.dumps({"T": t, "q": q, "us": round(u, 1), "rel_err": err, "config": c}), flush=True)
        rows.append(sum_row(t, cands, us))
        print(json.dumps(rows[-1]), flush=True)
    print("| T | committed us (path), summed over q | best us | speed-up | best config |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['base_us']} ({r['base_path']}) | {r['new_us']} | {r['speedup']} | "
              f"{json.dumps(r['new_cfg'])} |")
    if args.write_configs:
        write_configs(args.write_configs, rows)
        print(f"wrote {args.write_configs}")


if __name__ == "__main__":
    main()
