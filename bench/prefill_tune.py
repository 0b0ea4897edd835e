"""Prefill MoE (T >= 256): the ``fused`` path at prefill tile sizes against the committed path, same run (issue 4).

Why: the prefill target (<= 1.3x the bf16 dense path's time) is missed by the ``dequant`` path (every used expert
dequantized to bf16, written, then a grouped GEMM: Qwen 1.5-2.8x, Mixtral 1.5-2.9x the dense time,
``bench/results/ap_moe_s15_h200.md``). ``fused`` dequantizes each [BLOCK_N, BLOCK_K] weight tile inside the GEMM's
K loop and never writes bf16 weights, but the tuner (``ap_moe_speed.py --tune``) only ever timed it with
BLOCK_M <= 32 and only up to 64 tokens: at 2048 Qwen tokens an expert gets ~137 rows, so BLOCK_M 16 dequantizes
each weight ~9 times, BLOCK_M 128 twice. This script times ``fused`` with BLOCK_M 32..128 at T >= 256.

What it does: for each shape and T, random experts (q = 4 and a random mix of 2..8, as ``ap_moe_speed``), the
routing of ``ap_moe_speed.routed``; every candidate config is checked against ``ap_moe_ref`` on the timed inputs
(rel. error) and timed eagerly (CUDA events; prefill steps are not graph-captured), beside the committed config
and the bf16 dense path (tokens sorted by expert, grouped mm). Per (shape, T) the candidate with the least time
summed over the q's wins; ``--write-configs F`` gives it the bucket of that T in F (``kernels/configs/ap_moe.json``
layout) where it beat the committed config in that sum.

Usage (GPU machine): python bench/prefill_tune.py [--shapes qwen1.5-moe,mixtral-8x7b] [--ts 256,2048]
       [--qs 4,mixed] [--workers 12] [--time-limit S] [--write-configs F]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, ".")

# prefill tiles: BLOCK_M rows of one expert's tokens, BLOCK_N output columns, BLOCK_K columns of K per step
FUSED_PREFILL = [{"path": "fused", "SPREAD": 1, "BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "num_warps": w}
                 for m, n, k, w in ((32, 64, 64, 4), (64, 64, 64, 4), (64, 128, 64, 8), (128, 64, 64, 8),
                                    (128, 128, 64, 8), (64, 64, 128, 8), (128, 64, 128, 8))]
# the bucket (min_tokens) a T's winner takes: 256 -> 256 .. 1023, 2048 -> 1024 and up
BUCKET_OF = {256: 256, 2048: 1024}


def write_buckets(configs: dict[str, Any], key: str, winners: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """A copy of ``configs`` (``kernels/configs/ap_moe.json`` layout) where shape ``key``'s token range of each won T
    (BUCKET_OF[T] up to the next bound of BUCKET_OF, or up) takes ``winners[T]``: buckets starting inside that
    range go, and the config that was in force at the range's end resumes there; a shape without buckets starts
    from the default ones. Adjacent equal configs merge. Raises ``KeyError`` for a T not in BUCKET_OF."""
    from kernels.config_buckets import pick_bucket

    out = copy.deepcopy(configs)
    old = copy.deepcopy(out["by_shape"].get(key, out["default"]))
    bounds = sorted(BUCKET_OF.values())
    new = copy.deepcopy(old)
    for t, cfg in winners.items():
        lo = BUCKET_OF[t]
        hi = next((b for b in bounds if b > lo), None)
        new = [b for b in new if not (lo <= b["min_tokens"] and (hi is None or b["min_tokens"] < hi))]
        new.append({"min_tokens": lo, "config": copy.deepcopy(cfg)})
        if hi is not None and not any(b["min_tokens"] == hi for b in new):
            new.append({"min_tokens": hi, "config": copy.deepcopy(pick_bucket(old, hi, "min_tokens"))})
    new.sort(key=lambda b: b["min_tokens"])
    out["by_shape"][key] = [b for i, b in enumerate(new) if i == 0 or b["config"] != new[i - 1]["config"]]
    return out


def main() -> None:
    import torch

    from bench.ap_moe_speed import ALL_SHAPES, dense_grouped, make_layer, precompile, random_layer, routed, timeit
    from kernels.ap_moe import CONFIGS, ap_moe, ap_moe_ref, pick_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen1.5-moe,mixtral-8x7b")
    ap.add_argument("--ts", default="256,2048", help="token counts (each must be a key of BUCKET_OF: 256, 2048)")
    ap.add_argument("--qs", default="4,mixed", help="bitwidths, or 'mixed' (a random mix of 2..8 per block)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--workers", type=int, default=12, help="processes compiling the candidates ahead")
    ap.add_argument("--time-limit", type=float, default=0.0, help="seconds; (shape, T) groups past it are skipped")
    ap.add_argument("--write-configs", default="", help="configs JSON to update with the winners")
    args = ap.parse_args()
    ts = [int(v) for v in args.ts.split(",")]
    bad = [t for t in ts if t not in BUCKET_OF]
    if bad:
        raise SystemExit(f"--ts {bad}: only {sorted(BUCKET_OF)} have a bucket to write")
    start = time.monotonic()
    precompile([(f, t, c) for f in args.shapes.split(",") for t in ts for c in FUSED_PREFILL], args.workers)
    print(f"precompiled in {time.monotonic() - start:.0f} s", flush=True)
    configs = CONFIGS
    print("| shape | T | q | committed ms (path) | best fused ms | config | dense ms | committed / dense | "
          "fused / dense | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for family in args.shapes.split(","):
        s = ALL_SHAPES[family]
        e, h, inter = s["experts"], s["hidden"], s["inter"]
        g = torch.Generator().manual_seed(0)
        codes, luts, gate_up, down = random_layer(s)
        layers = {q: make_layer(s, torch.randint(2, 9, (2 * e,), generator=g).tolist() if q == "mixed"
                                else [int(q)] * (2 * e), codes, luts) for q in args.qs.split(",")}
        winners: dict[int, dict[str, Any]] = {}
        for t in ts:
            if args.time_limit and time.monotonic() - start > args.time_limit:
                print(f"skipped {family} T={t}: past --time-limit", flush=True)
                continue
            x, ids, w = routed(s, t, t)
            committed = pick_config(t, h, inter)
            sums = {i: 0.0 for i in range(len(FUSED_PREFILL))}
            base_sum = 0.0
            for q, ex in layers.items():
                ref = ap_moe_ref(x, ids, w, ex).float()
                base = timeit(lambda: ap_moe(x, ids, w, ex, check=False), args.reps)  # noqa: B023
                dense = timeit(lambda: dense_grouped(x, ids, w, gate_up, down), args.reps)  # noqa: B023
                base_sum += base
                best = (float("inf"), -1, "")
                for i, cfg in enumerate(FUSED_PREFILL):
                    try:
                        got = ap_moe(x, ids, w, ex, config=cfg).float()
                        rel = ((got - ref).norm() / ref.norm()).item()
                        ms = timeit(lambda: ap_moe(x, ids, w, ex, config=cfg, check=False), args.reps)  # noqa: B023
                        ms = ms if rel < 2e-2 else float("inf")  # a wrong result is not a candidate
                    except Exception as err:  # a config that fails to compile or run is not a candidate
                        print(f"{family} T={t} q={q} {json.dumps(cfg)} failed: {str(err)[:200]}", flush=True)
                        ms, rel = float("inf"), float("nan")
                    sums[i] += ms
                    if ms < best[0]:
                        best = (ms, i, f"{rel:.1e}")
                c = FUSED_PREFILL[best[1]] if best[1] >= 0 else {}
                print(f"| {family} | {t} | {q} | {base:.4f} ({committed.get('path')}) | {best[0]:.4f} | "
                      f"M{c.get('BLOCK_M')} N{c.get('BLOCK_N')} K{c.get('BLOCK_K')} w{c.get('num_warps')} | "
                      f"{dense:.4f} | {base / dense:.2f} | {best[0] / dense:.2f} | {best[2]} |", flush=True)
            i_best = min(sums, key=lambda i: sums[i])
            print(f"{family} T={t}: summed over q fused {sums[i_best]:.4f} ms vs committed {base_sum:.4f} "
                  f"({base_sum / sums[i_best]:.2f}x) with {json.dumps(FUSED_PREFILL[i_best])}", flush=True)
            if sums[i_best] < base_sum:
                winners[t] = FUSED_PREFILL[i_best]
        if winners:
            configs = write_buckets(configs, f"{h}x{inter}", winners)
        if args.write_configs:  # after every shape: a run cut short by a timeout keeps what it measured
            tmp = f"{args.write_configs}.tmp"  # then renamed: a kill mid-write leaves the old file whole
            with open(tmp, "w") as f:
                json.dump(configs, f, indent=4)
                f.write("\n")
            os.replace(tmp, args.write_configs)
            print(f"wrote {args.write_configs}", flush=True)


if __name__ == "__main__":
    main()
