"""Decode MoE: the word-first kernels (path gemv1, T <= 8) vs the gemv kernels, same run (GPU time, CUDA graphs).

For each shape, q and T, times ``kernels.ap_moe_gemv.gemv_moe`` with its configs tuned on 2026-11-29 and
``kernels.ap_moe_gemv1.gemv1_moe`` over a small grid of tiles, checks both against ``ap_moe_ref`` and prints
the best gemv1 config per row (what the gemv1 entries of ``kernels/configs/ap_moe.json`` by_shape hold).

Usage: python bench/gemv_compare.py [--ts 1,4] [--qs 4,3,8] [--quick]  (GPU machine; JSON rows + a table)
"""

from __future__ import annotations

import json
import sys

sys.path.insert(0, ".")
from bench.ap_moe_speed import SHAPES, copy_bandwidth, fake_experts, routed
from bench.gemv_probe import graph_ms
from kernels import ap_moe_gemv, ap_moe_gemv1
from kernels.ap_moe import ap_moe_ref

GU = [(4, 1024, 4), (8, 1024, 4), (2, 1024, 4), (8, 512, 4), (4, 2048, 8), (8, 1024, 8)]
DN = [(8, 512, 4, 1), (8, 512, 4, 2), (16, 512, 4, 1), (4, 1024, 4, 1), (8, 1024, 8, 1), (16, 256, 4, 2)]


# the gemv path's T = 1 configs as tuned on the H200 on 2026-11-29 (kernels/configs/ap_moe.json before gemv1)
GEMV_T1 = {"qwen1.5-moe": {"path": "gemv", "SPREAD": 1, "gate_up": {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4},
                           "down": {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "SPLIT_K": 2}},
           "mixtral-8x7b": {"path": "gemv", "SPREAD": 1, "gate_up": {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4},
                            "down": {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "SPLIT_K": 2}}}


# the gemv path's T >= 2 configs (kernels/configs/ap_moe.json min_tokens 2, tuned 2026-11-29)
GEMV_T2 = {"qwen1.5-moe": {"path": "gemv", "SPREAD": 0, "gate_up": {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4},
                           "down": {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "SPLIT_K": 2}},
           "mixtral-8x7b": {"path": "gemv", "SPREAD": 0, "gate_up": {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4},
                            "down": {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "SPLIT_K": 8}}}


def cfg(gu, dn):  # type: ignore[no-untyped-def]
    return {"path": "gemv1", "gate_up": dict(zip(("BLOCK_N", "BLOCK_K", "num_warps"), gu, strict=True)),
            "down": dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "SPLIT_K"), dn, strict=True))}


def timed(fn, ref):  # type: ignore[no-untyped-def]
    """(GPU ms, relative error of fn() against ref)."""
    got = fn().float()
    return graph_ms(fn), float((got - ref).norm() / ref.norm())


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="1", help="token counts, e.g. 1,4")
    ap.add_argument("--qs", default="4,3,8")
    ap.add_argument("--quick", action="store_true", help="3 gate_up and 2 down tiles only")
    args = ap.parse_args()
    gus, dns = (GU[:3], DN[:2]) if args.quick else (GU, DN)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    out = []
    for family in ("qwen1.5-moe", "mixtral-8x7b"):
        s = SHAPES[family]
        for q, t in [(int(q), int(t)) for q in args.qs.split(",") for t in args.ts.split(",")]:
            ex = fake_experts(s, q)
            x, ids, w = routed(s, t, t)
            ids = ids % s["topk"]
            ref = ap_moe_ref(x, ids, w, ex).float()
            base = GEMV_T1[family] if t == 1 else GEMV_T2[family]
            t_main, err_m = timed(lambda: ap_moe_gemv.gemv_moe(x, ids, w, ex, base), ref)  # noqa: B023
            best: tuple[float, dict, float] = (float("inf"), {}, 0.0)
            cands = [cfg(gu, dns[0]) for gu in gus] if (q == 4 or family == "qwen1.5-moe") else [cfg(gus[0], dns[0])]
            for c in cands:
                ms, err = timed(lambda: ap_moe_gemv1.gemv1_moe(x, ids, w, ex, c), ref)  # noqa: B023
                best = min(best, (ms, c, err), key=lambda b: b[0])
            gu_b = best[1]["gate_up"]
            for dn in dns[1:] if q == 4 else []:
                c = cfg((gu_b["BLOCK_N"], gu_b["BLOCK_K"], gu_b["num_warps"]), dn)
                ms, err = timed(lambda: ap_moe_gemv1.gemv1_moe(x, ids, w, ex, c), ref)  # noqa: B023
                best = min(best, (ms, c, err), key=lambda b: b[0])
            row = {"shape": family, "q": q, "T": t, "main_us": round(1e3 * t_main, 1), "main_err": err_m,
                   "new_us": round(1e3 * best[0], 1), "new_err": best[2], "speedup": round(t_main / best[0], 2),
                   "new_cfg": best[1]}
            out.append(row)
            print(json.dumps(row), flush=True)
    print("| shape | q | T | gemv us | gemv1 us | speedup | rel err gemv / gemv1 |")
    print("|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['shape']} | {r['q']} | {r['T']} | {r['main_us']} | {r['new_us']} | {r['speedup']} | "
              f"{r['main_err']:.1e} / {r['new_err']:.1e} |")


if __name__ == "__main__":
    main()
