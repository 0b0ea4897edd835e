"""Calls the decode AP MoE (gemv1 path) a few times per case, for ``ncu`` (GPU only; no timing of its own).

Cases (``--cases``, comma-separated ``family:q``): the Qwen1.5-MoE routed layer (4 experts, T = 1) and its
shared expert (H 2048, I 5632), every block at q bits, on the committed configs. Usage::

    ncu --clock-control none --kernel-name regex:gemv1 --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats ... python bench/ncu_gemv1.py --cases qwen1.5-moe:4
"""

from __future__ import annotations

import argparse

import torch

from bench.ap_moe_speed import ALL_SHAPES, fake_experts
from kernels.ap_moe import ap_moe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cases", default="qwen1.5-moe:4,qwen1.5-moe-shared:4,qwen1.5-moe-shared:8")
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    for case in args.cases.split(","):
        family, q = case.split(":")
        s = ALL_SHAPES[family]
        ex = fake_experts(s, int(q), s["topk"])
        x = torch.randn(1, s["hidden"], device="cuda", dtype=torch.bfloat16)
        ids = torch.arange(s["topk"], device="cuda").view(1, -1)
        w = torch.rand(1, s["topk"], device="cuda")
        for _ in range(args.calls):
            ap_moe(x, ids, w, ex, check=False)
        torch.cuda.synchronize()
        print(f"{case}: {args.calls} calls", flush=True)


if __name__ == "__main__":
    main()
