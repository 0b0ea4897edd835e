"""MoE kernel suite: the fused AP MoE kernel against the bf16 dense path, transformers' experts block and the floor.

What it does: for the Qwen1.5-MoE-A2.7B layer (H 2048, I 1408, 60 experts top-4) and the Mixtral-8x7B layer
(H 4096, I 14336, 8 experts top-2), random weights and router, T tokens and a committed bitwidth q (uniform, or a
random mix of 2..8 per block), checks the kernel against its reference on the timed inputs, then times per layer
(CUDA events, median of repeats): (a) ``ap_moe`` as the runtime calls it (no host sync), eagerly and, on the
decode paths, replayed from a CUDA graph; (b) the bf16 dense path (tokens sorted by expert, grouped GEMMs, or a
per-expert loop where faster); (c) transformers' experts block of the family; (d) the bandwidth floor = plane and
LUT bytes of the experts in use + activations / copy bandwidth. ``--cold-l2`` writes 256 MiB before every timed
call (a layer deep in a decode step finds its weights out of L2). One record per (shape, q, T) in
``bench/results/moe_kernel.jsonl``.

Usage (GPU machine)::

    python -m bench.moe_kernel [--quick] [--shapes qwen1.5-moe] [--ts 1,4] [--qs 4,mixed] [--cold-l2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import MixtralConfig, Qwen2MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

from bench.common import copy_bandwidth, environment, event_ms, graph_ms, write_records
from pwformat.ap import pack_planes
from pwformat.cost import block_bytes
from pwkernels.moe.activation import gate_act_ref
from pwkernels.moe.dispatch import ap_moe, pick_config
from pwkernels.moe.experts import build_experts
from pwkernels.moe.ref import ap_moe_ref

SHAPES: dict[str, dict[str, Any]] = {"qwen1.5-moe": dict(hidden=2048, inter=1408, experts=60, topk=4),
          "mixtral-8x7b": dict(hidden=4096, inter=14336, experts=8, topk=2)}
SHAPES["qwen1.5-moe-shared"] = dict(hidden=2048, inter=5632, experts=1, topk=1)  # its own launch in serving
SHAPES["gemma-4-26b-a4b"] = dict(hidden=2816, inter=704, experts=128, topk=8, activation="gelu_tanh")
DECODE_PATHS = ("decode",)  # paths whose launches a CUDA graph holds (no host sync)
COLD_L2_BYTES = 256 << 20  # written before each timed call with --cold-l2 (H200 L2: 50 MB)


def dense_grouped(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """bf16 dense MoE via grouped GEMMs over the expert-sorted (token, slot) pairs. No host sync (group ends by
    ``searchsorted``, not ``bincount``, which syncs on CUDA), so a CUDA graph can hold it: its graph time is the
    dense baseline's GPU time at decode, comparable with our kernel's graph time."""
    t, k = ids.shape
    flat = ids.flatten()
    sorted_ids, order = torch.sort(flat)
    e_all = torch.arange(gate_up.shape[0], device=x.device)
    offs = torch.searchsorted(sorted_ids, e_all + 1).to(torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)
    g, u = h.chunk(2, -1)
    y = torch._grouped_mm((gate_act_ref(g, act) * u).contiguous(), down.transpose(1, 2), offs=offs)
    out = torch.zeros(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    out[order] = y.float() * w.flatten()[order, None]
    return out.view(t, k, -1).sum(1).to(x.dtype)


def dense_loop(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """The bf16 dense MoE, one expert at a time (the baseline where grouped GEMMs are slower)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        g, u = (x[rows] @ gate_up[e].T).chunk(2, -1)
        out.index_add_(0, rows, ((gate_act_ref(g, act) * u) @ down[e].T).float() * w[rows, slot, None])
    return out.to(x.dtype)


def hf_block(family: str, s: dict) -> torch.nn.Module | None:
    """transformers' experts block of the family (its default experts implementation), bf16 on the GPU; None for
    Gemma-4 where this transformers has no ``gemma4``."""
    mod: torch.nn.Module
    if family.startswith("gemma-4"):
        try:  # an optional model: transformers before 5.5 has no Gemma-4
            from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
            from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts
        except ImportError:
            return None
        mod = Gemma4TextExperts(Gemma4TextConfig(hidden_size=s["hidden"], moe_intermediate_size=s["inter"],
                                                 num_experts=s["experts"], top_k_experts=s["topk"],
                                                 enable_moe_block=True))
    elif family == "qwen1.5-moe":
        mod = Qwen2MoeExperts(Qwen2MoeConfig(hidden_size=s["hidden"], moe_intermediate_size=s["inter"],
                                             num_experts=s["experts"]))
    else:
        mod = MixtralExperts(MixtralConfig(hidden_size=s["hidden"], intermediate_size=s["inter"],
                                           num_local_experts=s["experts"]))
    return mod.to(device="cuda", dtype=torch.bfloat16)


def make_layer(s: dict, bits: list[int], codes: list, luts: list) -> Any:
    return build_experts(codes, luts, bits, s["hidden"], s["inter"], torch.bfloat16, "cuda")


def routed(s: dict, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, s["hidden"], device="cuda", dtype=torch.bfloat16, generator=g)
    logits = torch.randn(t, s["experts"], device="cuda", generator=g)
    w, ids = torch.softmax(logits, -1).topk(s["topk"], -1)
    return x, ids, w


def random_layer(s: dict) -> tuple[list, list, torch.Tensor, torch.Tensor]:
    """A layer of shape ``s`` on the GPU, seeded (torch.manual_seed(0)): per block (gate_up [2I, H], down [H, I] of
    each expert) 8-bit codes packed into planes (``pack_planes``, reused for every q) and LUTs {q: [N, 2^q]} for
    q = 2..8, plus the bf16 dense weights gate_up [E, 2I, H] and down [E, H, I] of the dense baseline."""
    e, hdim, inter = s["experts"], s["hidden"], s["inter"]
    torch.manual_seed(0)
    codes, luts = [], []
    for i in range(2 * e):
        n, kk = (2 * inter, hdim) if i % 2 == 0 else (hdim, inter)
        codes.append(pack_planes(torch.randint(0, 256, (n, kk), dtype=torch.uint8, device="cuda")))
        luts.append({b: torch.randn(n, 2**b, device="cuda") * kk**-0.5 for b in range(2, 9)})
    gate_up = torch.randn(e, 2 * inter, hdim, device="cuda", dtype=torch.bfloat16) * hdim**-0.5
    down = torch.randn(e, hdim, inter, device="cuda", dtype=torch.bfloat16) * inter**-0.5
    return codes, luts, gate_up, down


def layer_floor_ms(ex: Any, ids: torch.Tensor, x: torch.Tensor, hidden: int, inter: int, bw: float) -> float:
    """The bandwidth floor of one MoE call: plane and LUT bytes of the experts ``ids`` routes to at their committed
    bits (``ex.bits``, two blocks per expert), plus x read and y written in 16 bits, at ``bw`` bytes/s."""
    qb = ex.bits.tolist()
    kbytes = sum(block_bytes(n, kk, qb[2 * u + j], seed=min(qb)) for u in ids.unique().tolist()
                 for j, (n, kk) in enumerate(((2 * inter, hidden), (hidden, inter))))
    return (kbytes + x.numel() * 2 * 2) / bw * 1e3


def run_shape(family: str, s: dict, ts: list[int], qs: list[str], bw: float, reps: int,
              flush: torch.Tensor | None) -> list[dict]:
    e, hdim, inter = s["experts"], s["hidden"], s["inter"]
    act = s.get("activation", "silu")
    g = torch.Generator().manual_seed(0)
    codes, luts, gate_up, down = random_layer(s)
    hf = hf_block(family, s)
    rows = []
    for qname in qs:
        bits = torch.randint(2, 9, (2 * e,), generator=g).tolist() if qname == "mixed" else [int(qname)] * (2 * e)
        ex = make_layer(s, bits, codes, luts)
        for t in ts:
            try:
                x, ids, w = routed(s, t, t)
                got = ap_moe(x, ids, w, ex, activation=act).float()
                ref = ap_moe_ref(x, ids, w, ex, act).float()
                rel = ((got - ref).norm() / ref.norm()).item()
                r = reps if t <= 64 else max(5, reps // 2)
                t_k = event_ms(lambda: ap_moe(x, ids, w, ex, check=False, activation=act), r, flush)  # noqa: B023
                path = pick_config(t, hdim, inter)["path"]
                decode = path in DECODE_PATHS
                t_graph = graph_ms(lambda _: ap_moe(x, ids, w, ex, check=False, activation=act), 1, r, flush) \
                    if decode else float("nan")  # noqa: B023
                try:
                    t_g = event_ms(lambda: dense_grouped(x, ids, w, gate_up, down, act), r, flush)  # noqa: B023
                except (RuntimeError, AttributeError):  # grouped mm unavailable for this layout/build
                    t_g = float("inf")
                t_l = event_ms(lambda: dense_loop(x, ids, w, gate_up, down, act), r, flush) \
                    if e <= 8 or t <= 64 else float("inf")  # noqa: B023
                t_hf = event_ms(lambda: hf(x, ids, w.to(torch.bfloat16)), r, flush) \
                    if hf is not None else float("nan")  # noqa: B023
                floor_ms = layer_floor_ms(ex, ids, x, hdim, inter, bw)
                dense = min(t_g, t_l)
                t_dg = graph_ms(lambda _: dense_grouped(x, ids, w, gate_up, down, act), 1, r, flush) \
                    if decode else float("nan")  # noqa: B023
                rows.append({"shape": family, "q": qname, "T": t, "path": path,
                             "kernel_ms": round(t_k, 4), "graph_ms": round(t_graph, 4),
                             "bf16_dense_ms": round(dense, 4), "transformers_ms": round(t_hf, 4),
                             "floor_ms": round(floor_ms, 4), "pct_of_floor": round(100 * floor_ms / t_k, 1),
                             "graph_pct_of_floor": round(100 * floor_ms / t_graph, 1),
                             "speedup_vs_dense": round(dense / t_k, 2), "bf16_dense_graph_ms": round(t_dg, 4),
                             "graph_speedup_vs_dense_graph": round(t_dg / t_graph, 2), "rel_err": f"{rel:.2e}"})
                print(json.dumps(rows[-1]), flush=True)
            except Exception as err:  # one failing row must not lose the others
                print(f"row {family} q={qname} T={t} failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer T and q")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="qwen1.5-moe,mixtral-8x7b", help=f"comma-separated of {', '.join(SHAPES)}")
    ap.add_argument("--ts", default=None, help="comma-separated token counts T (overrides --quick)")
    ap.add_argument("--qs", default=None, help="comma-separated bitwidths, or 'mixed' (overrides --quick)")
    ap.add_argument("--cold-l2", action="store_true", help="flush L2 before every timed call")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSONL (default bench/results/moe_kernel.jsonl)")
    args = ap.parse_args()
    env = environment(args.label)
    bw = copy_bandwidth()
    flush = torch.empty(COLD_L2_BYTES, dtype=torch.uint8, device="cuda") if args.cold_l2 else None
    ts = [1, 4, 64, 256, 2048] if args.quick else [1, 4, 16, 64, 256, 2048]
    qs = ["2", "4", "8", "mixed"] if args.quick else ["2", "3", "4", "6", "8", "mixed"]
    ts = [int(t) for t in args.ts.split(",")] if args.ts else ts
    qs = args.qs.split(",") if args.qs else qs
    for fam in args.shapes.split(","):
        rows = run_shape(fam, SHAPES[fam], ts, qs, bw, args.reps, flush)
        write_records("moe_kernel", ({**r, "cold_l2": args.cold_l2, "copy_bandwidth_TBps": round(bw / 1e12, 3)}
                                     for r in rows), env, args.out)


if __name__ == "__main__":
    main()
