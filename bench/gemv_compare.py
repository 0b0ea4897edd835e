"""Decode MoE (path gemv1; past 8 tokens in chunks of 8): tune the word-first kernels against a baseline, same run.

For each shape, T and q, times ``kernels.ap_moe_gemv1.gemv1_moe`` over a small grid of tiles (GPU time of
CUDA-graph replays), checks every result against ``ap_moe_ref`` and prints the best config per row (what the
gemv1 entries of ``kernels/configs/ap_moe.json`` by_shape hold). The baseline is the decode path that a given
configs JSON picks (``--baseline-configs``; default: the current one), run with the gemv1 module in
``--baseline-module`` (a file, e.g. the kernel of an earlier commit: ``git show REV:kernels/ap_moe_gemv1.py``)
where that config's path is gemv1, or with ``kernels.ap_moe.ap_moe`` (its own path: gemv, fused, dequant) elsewhere.
Experts: min(E, T * top-k) of them with distinct ids per token (T = 1 reads top-k experts, as in serving).

Usage: python bench/gemv_compare.py [--ts 1,4,8,16,32] [--qs 4,3,8] [--tune-qs 4,5,8] [--baseline-module F]
       [--baseline-configs F] [--workers 12] [--grid small] [--slots 0,1,2,4] [--time-limit S] [--write-configs F]
       (GPU machine; JSON rows + a markdown table). Each (shape, T) group compiles its tiles first: ~15 s per
       config at T = 1, 1-4 min at T_PAD 4-8 (Triton 3.6), so keep --grid small and --time-limit for T > 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from typing import Any

import torch

sys.path.insert(0, ".")
from bench.ap_moe_speed import ALL_SHAPES, copy_bandwidth, fake_experts, precompile
from bench.gemv_probe import graph_ms
from kernels import ap_moe_gemv1
from kernels.ap_moe import ap_moe, ap_moe_ref, pick_config

# (BLOCK_N pairs, BLOCK_K, num_warps) and (BLOCK_N, BLOCK_K, num_warps, SPLIT_K). BLOCK_K 1024 = 32 words: the
# tile whose codes are already in the layout of Triton's warp-local gather with a 32-entry LUT (q <= 5 by
# shuffle); 512 = 16 words: 16-entry LUT (q <= 4 by shuffle), less padding where K / 32 is not a multiple of 32
# 8 warps: the same tile over twice the threads holds half the registers per thread (sm_90, bench/sass_count.py:
# down 32 x 32 words 255 -> 105, gate_up 8 pairs x 32 words 128 -> 64) for ~5-10% more instructions per weight;
# ncu found every gemv1 launch limited by registers (occupancy 12-38%), and no tuned config had tried it yet
GU = [(16, 1024, 4), (8, 1024, 4), (32, 1024, 4), (16, 512, 4), (8, 1024, 8), (16, 1024, 8)]
DN = [(32, 1024, 4, 1), (32, 512, 4, 1), (32, 1024, 4, 2), (64, 1024, 4, 1), (32, 1024, 4, 4), (16, 1024, 4, 4),
      (32, 1024, 4, 8), (32, 1024, 8, 1), (32, 1024, 8, 2), (32, 1024, 8, 4)]
# the small grid: 3 gate_up x these down tiles (split-K 1 / 2 / 4 / 8: Mixtral's down wants 4; a one-expert down
# such as Qwen's shared expert has only H / BLOCK_N programs per split, ncu: 0.3 waves at split 2)
GU_SMALL = [GU[0], GU[1], GU[4]]
DN_SMALL = [DN[0], DN[1], DN[2], DN[4], DN[5], DN[6], DN[8]]


RAW = {"RAW_SHFL": 0}  # --raw-shfl sets 1: every candidate tile shuffles by inline shfl.sync (16/32-word K steps)


def cfg(gu: tuple, dn: tuple, slots: int = 0) -> dict[str, Any]:
    """A gemv1 config of gate_up tile ``gu``, down tile ``dn`` and, if ``slots`` > 0, the sorted-slots mode
    (``kernels.ap_moe_gemv1``: SLOTS pairs of one expert per program, any number of tokens in one launch)."""
    c = {"path": "gemv1", "gate_up": {**dict(zip(("BLOCK_N", "BLOCK_K", "num_warps"), gu, strict=True)), **RAW},
         "down": {**dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "SPLIT_K"), dn, strict=True)), **RAW}}
    return {**c, "SLOTS": slots} if slots else c


def inputs(s: dict, t: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(t)
    x = torch.randn(t, s["hidden"], device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.stack([torch.randperm(n, device="cuda", generator=g)[:s["topk"]] for _ in range(t)])
    w = torch.softmax(torch.randn(t, s["topk"], device="cuda", generator=g), -1)
    return x, ids, w


def load_module(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("baseline_gemv1", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timed(fn: Any, ref: torch.Tensor) -> tuple[float, float]:
    """(GPU us, relative error of fn() against ref)."""
    got = fn().float()
    return 1e3 * graph_ms(fn), float((got - ref).norm() / ref.norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="1", help="token counts, e.g. 1,4,8")
    ap.add_argument("--qs", default="4,3,8", help="bitwidths timed")
    ap.add_argument("--tune-qs", default="4,5,8", help="bitwidths at which the whole grid is tried (others: "
                    "the winner of the first tuned q of the same path: q <= 4, q = 5, q >= 6)")
    ap.add_argument("--shapes", default="qwen1.5-moe,mixtral-8x7b", help=f"of {', '.join(ALL_SHAPES)}")
    ap.add_argument("--baseline-module", default="", help="gemv1 module file of the baseline (default: current)")
    ap.add_argument("--baseline-configs", default="kernels/configs/ap_moe.json")
    ap.add_argument("--workers", type=int, default=12, help="parallel compile processes")
    ap.add_argument("--grid", choices=("full", "small"), default="full",
                    help="small: GU_SMALL x DN_SMALL (split-K 1 / 2 / 4 / 8, 4 and 8 warps; gemv1 "
                         "compiles take ~1-4 min per config at T_PAD 4-8)")
    ap.add_argument("--time-limit", type=float, default=0.0,
                    help="seconds; (shape, T) groups that would start past it are skipped, so the table and "
                    "--write-configs still come out (0: no limit)")
    ap.add_argument("--pick", choices=("q4", "sum"), default="q4",
                    help="the config --write-configs takes per (shape, T): the q = 4 winner, or (sum) the one of every "
                    "q's winners with the least time summed over --qs (blocks whose bitwidth varies at run time, "
                    "e.g. the always-read shared expert under PagedWeight)")
    ap.add_argument("--raw-shfl", action="store_true", help="candidates shuffle by inline shfl.sync (tile key "
                    "RAW_SHFL; only 16- and 32-word K steps, BLOCK_K 512 / 1024, use it) vs the baseline's tl.gather")
    ap.add_argument("--slots", default="0", help="comma-separated SLOTS values tried with every tile: 0 = token "
                    "slots (chunks of 8 past 8 tokens), S > 0 = pairs sorted by expert, S per program (1, 2, 4, 8)")
    ap.add_argument("--write-configs", default="", help="configs JSON to update with the winners (T=1 -> bucket "
                    "min_tokens 1, T=4 -> 2, T=8 -> 5, T=16 -> 9, T=32 -> 17; only where gemv1 beat the baseline "
                    "at q=4 or in the --pick sum row)")
    args = ap.parse_args()
    RAW["RAW_SHFL"] = int(args.raw_shfl)
    base_mod = load_module(args.baseline_module) if args.baseline_module else ap_moe_gemv1
    with open(args.baseline_configs) as f:
        base_cfgs = json.load(f)
    ts, qs, tune = ([int(v) for v in a.split(",")] for a in (args.ts, args.qs, args.tune_qs))
    shapes = args.shapes.split(",")
    gu_grid, dn_grid = (GU_SMALL, DN_SMALL) if args.grid == "small" else (GU, DN)
    slot_list = [int(v) for v in args.slots.split(",")]
    grid = ([cfg(gu, dn_grid[0], sl) for gu in gu_grid for sl in slot_list]
            + [cfg(gu_grid[0], dn, sl) for dn in dn_grid[1:] for sl in slot_list])
    print(f"copy bandwidth {copy_bandwidth() / 1e12:.3f} TB/s", flush=True)
    start = time.monotonic()
    out = []
    for family, t in [(f, t) for f in shapes for t in ts]:
        s = ALL_SHAPES[family]
        if args.time_limit and time.monotonic() - start > args.time_limit:
            print(f"skipped {family} T={t}: past --time-limit {args.time_limit:.0f} s", flush=True)
            continue
        precompile([(family, t, c) for c in grid], args.workers)  # per group: partial results come out
        n = min(s["experts"], t * s["topk"])
        won: dict[int, dict] = {}
        for q in qs:
            ex = fake_experts(s, q, n)
            x, ids, w = inputs(s, t, n)
            ref = ap_moe_ref(x, ids, w, ex).float()
            bc = pick_config(t, s["hidden"], s["inter"], base_cfgs)
            if bc["path"] == "gemv1":
                b_us, b_err = timed(lambda: base_mod.gemv1_moe(x, ids, w, ex, bc), ref)  # noqa: B023
            else:
                b_us, b_err = timed(lambda: ap_moe(x, ids, w, ex, config=bc, check=False), ref)  # noqa: B023
            kpath = 4 if q <= 4 else 5 if q == 5 else 8  # code paths: q <= 4, q = 5, q >= 6
            if q in tune or kpath not in won:
                gus = [cfg(gu, dn_grid[0], sl) for gu in gu_grid for sl in slot_list]
                res = [(timed(lambda: ap_moe_gemv1.gemv1_moe(x, ids, w, ex, c), ref), c)  # noqa: B023
                       for c in gus]
                first = min(res, key=lambda r: r[0][0])[1]
                g_best, sl_best = first["gate_up"], first.get("SLOTS", 0)
                gu_t = (g_best["BLOCK_N"], g_best["BLOCK_K"], g_best["num_warps"])
                res += [(timed(lambda: ap_moe_gemv1.gemv1_moe(x, ids, w, ex, c), ref), c)  # noqa: B023
                        for c in [cfg(gu_t, dn, sl_best) for dn in dn_grid[1:]]]
            else:
                c = won[kpath]
                res = [(timed(lambda: ap_moe_gemv1.gemv1_moe(x, ids, w, ex, c), ref), c)]  # noqa: B023
            (n_us, _), best = min(res, key=lambda r: r[0][0])
            won.setdefault(kpath, best)
            worst_err = max(r[0][1] for r in res)
            row = {"shape": family, "q": q, "T": t, "experts": n, "base_us": round(b_us, 1),
                   "base_path": bc["path"], "base_err": b_err, "new_us": round(n_us, 1), "new_err": worst_err,
                   "speedup": round(b_us / n_us, 2), "new_cfg": best, "tried": len(res)}
            out.append(row)
            print(json.dumps(row), flush=True)
        if args.pick == "sum":
            out.append(pick_sum(family, t, n, qs, [r for r in out if r["shape"] == family and r["T"] == t]))
            print(json.dumps(out[-1]), flush=True)
    print("| shape | T | q | experts | baseline us (path) | gemv1 us | speedup | rel err base / new | gemv1 config |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out:
        c = r["new_cfg"]
        cs = "gu {BLOCK_N}x{BLOCK_K} w{num_warps}".format(**c["gate_up"]) + \
             ", dn {BLOCK_N}x{BLOCK_K} w{num_warps} s{SPLIT_K}".format(**c["down"]) + \
             (f", {c['SLOTS']} slots" if c.get("SLOTS") else "")
        print(f"| {r['shape']} | {r['T']} | {r['q']} | {r['experts']} | {r['base_us']} ({r['base_path']}) | "
              f"{r['new_us']} | {r['speedup']} | {r['base_err']:.1e} / {r['new_err']:.1e} | {cs} |")
    if args.write_configs:
        write_configs(args.write_configs, out)


def pick_sum(family: str, t: int, n: int, qs: list[int], rows: list[dict]) -> dict:
    """A row (q "sum") for the candidate among ``rows``' winners with the least GPU time summed over ``qs``."""
    s = ALL_SHAPES[family]
    cands = list({json.dumps(r["new_cfg"], sort_keys=True): r["new_cfg"] for r in rows}.values())
    total = [0.0] * len(cands)
    for q in qs:
        ex = fake_experts(s, q, n)
        x, ids, w = inputs(s, t, n)
        ref = ap_moe_ref(x, ids, w, ex).float()
        for i, c in enumerate(cands):
            total[i] += timed(lambda: ap_moe_gemv1.gemv1_moe(x, ids, w, ex, c), ref)[0]  # noqa: B023
    best = min(range(len(cands)), key=lambda i: total[i])
    base = sum(r["base_us"] for r in rows)
    paths = "/".join(sorted({r["base_path"] for r in rows}))  # the baseline's path(s) at this T
    return {"shape": family, "q": "sum", "T": t, "experts": n, "base_us": round(base, 1), "base_path": paths,
            "base_err": 0.0, "new_us": round(total[best], 1), "new_err": 0.0, "speedup": round(base / total[best], 2),
            "new_cfg": cands[best], "tried": len(cands), "sums_us": [round(v, 1) for v in total]}


BUCKET = {1: 1, 4: 2, 8: 5, 16: 9, 32: 17}  # tuned T -> min_tokens of the bucket it stands for
BOUNDS = (1, 2, 5, 9, 17, 33)  # bucket starts: one that lost keeps its old config (33: past the largest tuned T;
# 1: also where a shape's old list started above 1 token, whose first bucket then covered T = 1)


def write_configs(path: str, rows: list[dict]) -> None:
    """Put each shape's q=4 winner (or its --pick sum row) into its bucket of ``path`` where gemv1 beat the
    baseline; a bucket that lost, and the one past the largest tuned T (33 tokens), keep the config that covered
    them before; a bucket that was not tuned and lies between two winners with the same config takes that config
    (else it keeps its old one)."""
    with open(path) as f:
        configs = json.load(f)
    for family in {r["shape"] for r in rows}:
        s = ALL_SHAPES[family]
        key = f"{s['hidden']}x{s['inter']}"
        old = configs["by_shape"].get(key, configs["default"])
        buckets = {b["min_tokens"]: b["config"] for b in old}
        pick = "sum" if any(r["q"] == "sum" for r in rows if r["shape"] == family) else 4
        was = {m: pick_config(m, s["hidden"], s["inter"], {"by_shape": {key: old}, "default": old}) for m in BOUNDS}
        won = set()
        for r in rows:
            if r["shape"] == family and r["q"] == pick and r["T"] in BUCKET and r["speedup"] > 1.0:
                m = BUCKET[r["T"]]
                end = min(b for b in BOUNDS if b > m)
                buckets = {k: c for k, c in buckets.items() if not m < k < end}  # the winner covers m .. end - 1
                buckets[m] = r["new_cfg"]
                won.add(m)
        tuned = {BUCKET[r["T"]] for r in rows if r["shape"] == family and r["q"] == pick and r["T"] in BUCKET}
        for m in BOUNDS[1:-1]:  # an untuned bucket between two winners of one config takes it (e.g. 5..8 tokens
            below = [k for k in won if k < m]  # between equal T = 4 and T = 16 winners); 33+ never does
            above = [k for k in won if k > m]
            if m not in tuned and below and above and buckets[max(below)] == buckets[min(above)]:
                end = min(b for b in BOUNDS if b > m)
                buckets = {k: c for k, c in buckets.items() if not m <= k < end}  # the lower winner covers it
                won.add(m)
        for m in BOUNDS:  # a bucket that lost (or 33+) keeps what covered it before, not a smaller winner
            if m not in won and m not in buckets:
                buckets[m] = was[m]
        merged = [{"min_tokens": m, "config": buckets[m]} for m in sorted(buckets)]
        configs["by_shape"][key] = [b for i, b in enumerate(merged) if i == 0 or b["config"] != merged[i - 1]["config"]]
        new = {"by_shape": {key: configs["by_shape"][key]}, "default": old}
        assert all(pick_config(m, s["hidden"], s["inter"], new) == was[m] for m in BOUNDS if m not in won)
    with open(path, "w") as f:
        json.dump(configs, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
