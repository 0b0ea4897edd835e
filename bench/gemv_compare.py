"""Decode GEMV of main's kernel vs this branch's word-first kernel, same run (GPU time, CUDA-graph replay).

Usage: python bench/gemv_compare.py  (H200; prints a table; kernels/_gemv_main.py = main's kernels/ap_moe_gemv.py)
"""

from __future__ import annotations

import json
import sys

sys.path.insert(0, ".")
from bench.ap_moe_speed import SHAPES, copy_bandwidth, fake_experts, routed
from bench.gemv_probe import graph_ms
from kernels import _gemv_main, ap_moe_gemv
from kernels.ap_moe import CONFIGS, ap_moe_ref

GU = [(4, 1024, 4), (8, 1024, 4), (2, 1024, 4), (8, 512, 4), (4, 2048, 8), (8, 1024, 8)]
DN = [(8, 512, 4, 1), (8, 512, 4, 2), (16, 512, 4, 1), (4, 1024, 4, 1), (8, 1024, 8, 1), (16, 256, 4, 2)]


def cfg(gu, dn):  # type: ignore[no-untyped-def]
    return {"path": "gemv", "gate_up": dict(zip(("BLOCK_N", "BLOCK_K", "num_warps"), gu, strict=True)),
            "down": dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "SPLIT_K"), dn, strict=True))}


def main() -> None:
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    out = []
    for family in ("qwen1.5-moe", "mixtral-8x7b"):
        s = SHAPES[family]
        main_cfgs = {b["min_tokens"]: b["config"] for b in CONFIGS["by_shape"][f"{s['hidden']}x{s['inter']}"]}
        for q in (4, 3, 8):
            ex = fake_experts(s, q)
            for t in (1, 4):
                x, ids, w = routed(s, t, t)
                ids = ids % s["topk"]
                ref = ap_moe_ref(x, ids, w, ex).float()
                mc = main_cfgs[1] if t == 1 else main_cfgs[2]
                got = _gemv_main.gemv_moe(x, ids, w, ex, mc).float()
                err_m = float((got - ref).norm() / ref.norm())
                t_main = graph_ms(lambda: _gemv_main.gemv_moe(x, ids, w, ex, mc))
                best = (float("inf"), None, 0.0)
                cands = [cfg(gu, DN[0]) for gu in GU] if (q == 4 or family == "qwen1.5-moe") else [cfg(GU[0], DN[0])]
                for c in cands:
                    got = ap_moe_gemv.gemv_moe(x, ids, w, ex, c).float()
                    err = float((got - ref).norm() / ref.norm())
                    ms = graph_ms(lambda: ap_moe_gemv.gemv_moe(x, ids, w, ex, c))
                    if ms < best[0]:
                        best = (ms, c, err)
                gu_best = best[1]["gate_up"]
                gu_t = (gu_best["BLOCK_N"], gu_best["BLOCK_K"], gu_best["num_warps"])
                for dn in DN[1:] if q == 4 else []:
                    c = cfg(gu_t, dn)
                    got = ap_moe_gemv.gemv_moe(x, ids, w, ex, c).float()
                    err = float((got - ref).norm() / ref.norm())
                    ms = graph_ms(lambda: ap_moe_gemv.gemv_moe(x, ids, w, ex, c))
                    if ms < best[0]:
                        best = (ms, c, err)
                row = {"shape": family, "q": q, "T": t, "main_us": round(1e3 * t_main, 1), "main_err": err_m,
                       "new_us": round(1e3 * best[0], 1), "new_err": best[2], "speedup": round(t_main / best[0], 2),
                       "new_cfg": best[1]}
                out.append(row)
                print(json.dumps(row), flush=True)
    print("| shape | q | T | main us | word-first us | speedup | rel err main / new |")
    print("|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['shape']} | {r['q']} | {r['T']} | {r['main_us']} | {r['new_us']} | {r['speedup']} | "
              f"{r['main_err']:.1e} / {r['new_err']:.1e} |")


if __name__ == "__main__":
    main()
