"""Benchmark: the fused AP MoE kernel vs the bf16 dense path, transformers' MoE block, and the floor.

What it does: for the Qwen1.5-MoE-A2.7B layer (H 2048, I 1408, 60 experts top-4) and the
Mixtral-8x7B layer (H 4096, I 14336, 8 experts top-2), random weights and router, T tokens and a
committed bitwidth q (uniform or a random mix of 2..8), checks the kernel against its reference
on the timed inputs, then times per layer (CUDA events, median of repeats): (a) ``ap_moe``;
(b) the bf16 dense path: tokens sorted by expert and ``torch._grouped_mm`` (or a per-expert loop,
whichever is faster); (c) transformers' MoE block of the family (Qwen2MoeExperts / MixtralExperts,
its default experts implementation); (d) the bandwidth floor = bytes the kernel must read (planes
at q and LUTs of the experts in use, activations) / measured device copy bandwidth.

Usage::

    python bench/ap_moe_speed.py --out-md bench/results/ap_moe_h200.md [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.ap_moe import ap_moe, ap_moe_ref, build_experts
from pwrun.ap.format import pack_planes

SHAPES = {"qwen1.5-moe": dict(hidden=2048, inter=1408, experts=60, topk=4),
          "mixtral-8x7b": dict(hidden=4096, inter=14336, experts=8, topk=2)}


def timeit(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timeit(lambda: dst.copy_(src), 10)
    return 2 * src.numel() / (ms / 1e3)


def dense_grouped(x, ids, w, gate_up, down):  # type: ignore[no-untyped-def]
    t, k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat)
    counts = torch.bincount(flat, minlength=gate_up.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)
    g, u = h.chunk(2, -1)
    y = torch._grouped_mm((F.silu(g) * u).contiguous(), down.transpose(1, 2), offs=offs)
    out = torch.zeros(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    out[order] = y.float() * w.flatten()[order, None]
    return out.view(t, k, -1).sum(1).to(x.dtype)


def dense_loop(x, ids, w, gate_up, down):  # type: ignore[no-untyped-def]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        g, u = (x[rows] @ gate_up[e].T).chunk(2, -1)
        out.index_add_(0, rows, ((F.silu(g) * u) @ down[e].T).float() * w[rows, slot, None])
    return out.to(x.dtype)


def hf_block(family: str, s: dict):  # type: ignore[no-untyped-def]
    from transformers import MixtralConfig, Qwen2MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

    if family == "qwen1.5-moe":
        cfg = Qwen2MoeConfig(hidden_size=s["hidden"], moe_intermediate_size=s["inter"], num_experts=s["experts"])
        mod = Qwen2MoeExperts(cfg)
    else:
        cfg = MixtralConfig(hidden_size=s["hidden"], intermediate_size=s["inter"], num_local_experts=s["experts"])
        mod = MixtralExperts(cfg)
    return mod.to(device="cuda", dtype=torch.bfloat16)


def run_shape(family: str, s: dict, ts: list[int], qs: list[str], bw: float, reps: int) -> list[dict]:
    e, hdim, inter, k = s["experts"], s["hidden"], s["inter"], s["topk"]
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    codes, luts = [], []
    for i in range(2 * e):
        n, kk = (2 * inter, hdim) if i % 2 == 0 else (hdim, inter)
        c = torch.randint(0, 256, (n, kk), dtype=torch.uint8, device="cuda")
        codes.append(pack_planes(c))  # packed once on the GPU, reused for every q
        luts.append({b: torch.randn(n, 2**b, device="cuda") * kk**-0.5 for b in range(2, 9)})
    gate_up = torch.randn(e, 2 * inter, hdim, device="cuda", dtype=torch.bfloat16) * hdim**-0.5
    down = torch.randn(e, hdim, inter, device="cuda", dtype=torch.bfloat16) * inter**-0.5
    hf = hf_block(family, s)
    rows = []
    for qname in qs:
        bits = torch.randint(2, 9, (2 * e,), generator=g).tolist() if qname == "mixed" else [int(qname)] * (2 * e)
        ex = build_experts(codes, luts, bits, hdim, inter, torch.bfloat16, "cuda")
        for t in ts:
            x = torch.randn(t, hdim, device="cuda", dtype=torch.bfloat16)
            logits = torch.randn(t, e, device="cuda")
            w, ids = torch.softmax(logits, -1).topk(k, -1)
            got = ap_moe(x, ids, w, ex).float()
            ref = ap_moe_ref(x, ids, w, ex).float()
            rel = ((got - ref).norm() / ref.norm()).item()
            t_k = timeit(lambda: ap_moe(x, ids, w, ex), reps)  # noqa: B023
            try:
                t_g = timeit(lambda: dense_grouped(x, ids, w, gate_up, down), reps)  # noqa: B023
            except (RuntimeError, AttributeError):  # grouped mm unavailable for this layout/build
                t_g = float("inf")
            t_l = timeit(lambda: dense_loop(x, ids, w, gate_up, down), reps) if e <= 8 or t <= 64 else float("inf")  # noqa: B023
            t_hf = timeit(lambda: hf(x, ids, w.to(torch.bfloat16)), reps)  # noqa: B023
            used = ids.unique().tolist()
            kbytes = sum(ex.bits[2 * u + j].item() * (n * (-(-kk // 32)) * 4) + n * 2 ** ex.bits[2 * u + j].item() * 2
                         for u in used for j, (n, kk) in enumerate(((2 * inter, hdim), (hdim, inter))))
            kbytes += x.numel() * 2 * 2
            floor_ms = kbytes / bw * 1e3
            dense = min(t_g, t_l)
            rows.append({"shape": family, "q": qname, "T": t, "kernel_ms": round(t_k, 4),
                         "bf16_dense_ms": round(dense, 4), "transformers_ms": round(t_hf, 4),
                         "floor_ms": round(floor_ms, 4), "pct_of_floor": round(100 * floor_ms / t_k, 1),
                         "speedup_vs_dense": round(dense / t_k, 2), "rel_err": f"{rel:.2e}"})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-md", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="fewer T and q")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    bw = copy_bandwidth()
    ts = [1, 4, 64, 2048] if args.quick else [1, 4, 16, 64, 256, 2048]
    qs = ["3", "4", "8", "mixed"] if args.quick else ["2", "3", "4", "6", "8", "mixed"]
    rows = []
    for fam, s in SHAPES.items():
        rows += run_shape(fam, s, ts, qs, bw, args.reps)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "copy_bandwidth_TBps": round(bw / 1e12, 3)}
    if args.out_md:
        args.out_md.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
        head = ("| shape | q | T | kernel ms | bf16 dense ms | transformers ms | floor ms | % of floor | x vs dense "
                "| rel err |")
        lines = [head, "|" + "---|" * 10]
        lines += [f"| {r['shape']} | {r['q']} | {r['T']} | {r['kernel_ms']} | {r['bf16_dense_ms']} | "
                  f"{r['transformers_ms']} | {r['floor_ms']} | {r['pct_of_floor']} | {r['speedup_vs_dense']} | "
                  f"{r['rel_err']} |" for r in rows]
        cmd = "python bench/ap_moe_speed.py" + (" --quick" if args.quick else "")
        args.out_md.write_text(f"# AP MoE kernel speed\n\nCommand: `{cmd}`\n\n{meta}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
