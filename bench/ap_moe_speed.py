"""Benchmark: the fused AP MoE kernel vs the bf16 dense path, transformers' MoE block, and the floor.

What it does: for the Qwen1.5-MoE-A2.7B layer (H 2048, I 1408, 60 experts top-4) and the
Mixtral-8x7B layer (H 4096, I 14336, 8 experts top-2), random weights and router, T tokens and a
committed bitwidth q (uniform or a random mix of 2..8), checks the kernel against its reference
on the timed inputs, then times per layer (CUDA events, median of repeats): (a) ``ap_moe`` as a
runtime calls it (``check=False``: no host sync), eagerly and, on the decode (gemv) path, replayed
from a CUDA graph (the GPU time without Python launch overhead);
(b) the bf16 dense path: tokens sorted by expert and ``torch._grouped_mm`` (or a per-expert loop,
whichever is faster); (c) transformers' MoE block of the family (Qwen2MoeExperts / MixtralExperts,
its default experts implementation); (d) the bandwidth floor = bytes the kernel must read (planes
at q and LUTs of the experts in use, activations) / measured device copy bandwidth.

With ``--tune`` it first picks, per shape, the configs of ``kernels/configs/ap_moe.json`` (gemv
tiles at T = 1 and 4 by coordinate descent at q = 4; path and tiles at T = 16, 64, 256) and
writes them next to the markdown as ``*.tuned.json``; the rows then use them. Candidates are
compiled ahead in parallel worker processes (Triton's on-disk cache), then timed here.

Usage::

    python bench/ap_moe_speed.py --out-md bench/results/ap_moe_h200.md [--quick] [--tune]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kernels.ap_moe import CONFIGS, ap_moe, ap_moe_ref, build_experts, pick_config
from kernels.warmup import random_experts, run_in_workers
from pwrun.ap.format import pack_planes

SHAPES = {"qwen1.5-moe": dict(hidden=2048, inter=1408, experts=60, topk=4),
          "mixtral-8x7b": dict(hidden=4096, inter=14336, experts=8, topk=2)}
# plus the shared expert of Qwen1.5-MoE, which serving runs as its own launch (one expert, top-1, I = 5632)
ALL_SHAPES = {**SHAPES, "qwen1.5-moe-shared": dict(hidden=2048, inter=5632, experts=1, topk=1)}


# With --cold-l2, every timed call starts with the weights out of L2 (H200: 50 MB; Qwen's q = 4 routed layer at one
# token reads 17 MB, so repeated calls of one layer ran from L2 where serving, 24 layers deep, reads HBM): a
# write of COLD_L2_BYTES before each call, outside its events (sixteenth session).
COLD_L2_BYTES = 256 << 20
_flush: list[torch.Tensor] = []


def set_cold_l2(on: bool) -> None:
    """Flush L2 before every call that ``timeit`` times (``on``) or not; allocates COLD_L2_BYTES on the GPU."""
    _flush[:] = [torch.empty(COLD_L2_BYTES, dtype=torch.uint8, device="cuda")] if on else []


def timeit(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Median ms of ``reps`` calls of ``fn`` (CUDA events; 3 untimed calls first; L2 flushed before each if
    ``set_cold_l2(True)``)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        for buf in _flush:
            buf.fill_(1)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def graph_time(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Median ms of one replay of a CUDA graph holding one call of ``fn`` (inf if it cannot be captured)."""
    try:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return timeit(g.replay, reps)
    except RuntimeError:
        return float("inf")


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timeit(lambda: dst.copy_(src), 10)
    return 2 * src.numel() / (ms / 1e3)


def dense_grouped(x, ids, w, gate_up, down):  # type: ignore[no-untyped-def]
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


def gemv_cfg(spread: int, gu: tuple[int, int, int], dn: tuple[int, int, int, int]) -> dict[str, Any]:
    gate_up = dict(zip(("BLOCK_N", "BLOCK_K", "num_warps"), gu, strict=True))
    down = dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "SPLIT_K"), dn, strict=True))
    return {"path": "gemv", "SPREAD": spread, "gate_up": gate_up, "down": down}


GU = [(8, 256, 4), (4, 256, 4), (16, 128, 4), (8, 512, 8), (16, 256, 8)]  # BLOCK_N gate (and up) rows
DN = [(32, 128, 4, 4), (16, 256, 4, 4), (16, 256, 4, 8), (32, 128, 4, 2), (8, 512, 4, 8), (32, 256, 8, 2)]
FUSED = [{"path": "fused", "SPREAD": 1, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4},
         {"path": "fused", "SPREAD": 1, "BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8}]
DEQUANT = [{"path": "dequant", "SPREAD": sp, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}
           for sp, bn, bk, w in ((1, 32, 256, 4), (1, 8, 1024, 4), (1, 16, 512, 4), (1, 32, 512, 8))]


def candidates(t: int) -> list[dict[str, Any]]:
    """Every config the tuner may time at T = t (all compiled ahead in parallel)."""
    gemv = [gemv_cfg(sp, gu, dn) for sp in (0, 1) for gu in GU for dn in DN[:1]]
    gemv += [gemv_cfg(sp, gu, dn) for sp in (0, 1) for gu in GU[:1] for dn in DN[1:]]
    if t <= 4:
        return gemv
    return (FUSED + DEQUANT) if t <= 64 else DEQUANT  # the T = 4 winner compiles on demand


def fake_experts(s: dict, q: int, n: int | None = None, device: str = "cuda") -> Any:
    """n experts (default top-k: enough to compile the same kernels) with the real H and I, every block at q bits,
    random planes and LUTs (``kernels.warmup.random_experts``, bf16)."""
    return random_experts(s["hidden"], s["inter"], s["topk"] if n is None else n, q, torch.bfloat16, device)


def _compile(job: tuple[str, int, dict[str, Any]]) -> str:
    family, t, cfg = job
    s = ALL_SHAPES[family]
    try:
        ex = fake_experts(s, 4)
        x = torch.randn(t, s["hidden"], device="cuda", dtype=torch.bfloat16)
        ids = torch.arange(t * s["topk"], device="cuda").view(t, -1) % s["topk"]
        ap_moe(x, ids, torch.rand(t, s["topk"], device="cuda"), ex, config=cfg, check=False)
        torch.cuda.synchronize()
        return ""
    except Exception as err:  # a config that does not compile is just not a candidate
        return f"{family} T={t} {json.dumps(cfg)}: {type(err).__name__}: {str(err)[:200]}"


def precompile(jobs: list[tuple[str, int, dict[str, Any]]], workers: int) -> None:
    for msg in run_in_workers(_compile, jobs, workers):  # what failed compiles on demand (or is not a candidate)
        print("compile failed:", msg, flush=True)


def make_layer(s: dict, bits: list[int], codes: list, luts: list) -> Any:
    return build_experts(codes, luts, bits, s["hidden"], s["inter"], torch.bfloat16, "cuda")


def routed(s: dict, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, s["hidden"], device="cuda", dtype=torch.bfloat16, generator=g)
    logits = torch.randn(t, s["experts"], device="cuda", generator=g)
    w, ids = torch.softmax(logits, -1).topk(s["topk"], -1)
    return x, ids, w


def tune_shape(family: str, s: dict, ex: Any, reps: int) -> list[dict[str, Any]]:
    """Buckets for ``configs/ap_moe.json`` of this shape, timed on ``ex`` (q = 4)."""
    def ms(cfg: dict[str, Any], t: int) -> float:  # GPU time (graph replay) where capturable: no CPU noise
        x, ids, w = routed(s, t, 100 + t)
        try:
            g = graph_time(lambda: ap_moe(x, ids, w, ex, config=cfg, check=False), reps)
            return g if g < float("inf") else timeit(lambda: ap_moe(x, ids, w, ex, config=cfg, check=False), reps)
        except Exception as err:
            print(f"tune {family} T={t} failed {json.dumps(cfg)}: {str(err)[:200]}", flush=True)
            return float("inf")

    log = []
    best: dict[int, tuple[float, dict[str, Any]]] = {}
    for t in (1, 4):
        cands = [gemv_cfg(sp, GU[0], DN[0]) for sp in (0, 1)]
        res = [(ms(c, t), c) for c in cands]
        spread = min(res, key=lambda r: r[0])[1]["SPREAD"]
        res += [(ms(c, t), c) for c in (gemv_cfg(spread, gu, DN[0]) for gu in GU[1:])]
        gu_best = min(res, key=lambda r: r[0])[1]["gate_up"]
        gu_t = (gu_best["BLOCK_N"], gu_best["BLOCK_K"], gu_best["num_warps"])
        res += [(ms(c, t), c) for c in (gemv_cfg(spread, gu_t, dn) for dn in DN[1:])]  # kernels cached apart
        best[t] = min(res, key=lambda r: r[0])
        log += [(t, r[0], r[1]) for r in res]
    for t in (16, 64, 256):
        cands = [best[4][1], *FUSED, *DEQUANT] if t <= 64 else DEQUANT
        res = [(ms(c, t), c) for c in cands]
        best[t] = min(res, key=lambda r: r[0])
        log += [(t, r[0], r[1]) for r in res]
    for t, m, c in log:
        print(f"tune {family} T={t} {m:.4f} ms {json.dumps(c)}", flush=True)
    buckets = [{"min_tokens": 1, "config": best[1][1]}, {"min_tokens": 2, "config": best[4][1]},
               {"min_tokens": 16, "config": best[16][1]}, {"min_tokens": 64, "config": best[64][1]},
               {"min_tokens": 256, "config": best[256][1]}]
    # the word-first gemv1 buckets are picked by bench/gemv_compare.py, not here: keep them, and let the tuned
    # gemv config start where they end
    old = CONFIGS["by_shape"].get(f"{s['hidden']}x{s['inter']}", CONFIGS["default"])
    g1 = [b for b in old if b["config"].get("path") == "gemv1"]
    if g1:
        end = next((b["min_tokens"] for b in old if b["min_tokens"] > g1[-1]["min_tokens"]), 16)
        buckets = [*g1, *([{"min_tokens": end, "config": best[4][1]}] if end < 16 else []), *buckets[2:]]
    return [b for i, b in enumerate(buckets) if i == 0 or b["config"] != buckets[i - 1]["config"]]


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


def run_shape(family: str, s: dict, ts: list[int], qs: list[str], bw: float, reps: int,
              tuned: dict[str, list]) -> list[dict]:
    e, hdim, inter = s["experts"], s["hidden"], s["inter"]
    g = torch.Generator().manual_seed(0)
    codes, luts, gate_up, down = random_layer(s)
    hf = hf_block(family, s)
    key = f"{hdim}x{inter}"
    if key in tuned:
        tuned[key] = tune_shape(family, s, make_layer(s, [4] * (2 * e), codes, luts), reps)
        CONFIGS["by_shape"][key] = tuned[key]
    rows = []
    for qname in qs:
        bits = torch.randint(2, 9, (2 * e,), generator=g).tolist() if qname == "mixed" else [int(qname)] * (2 * e)
        ex = make_layer(s, bits, codes, luts)
        for t in ts:
            try:
                x, ids, w = routed(s, t, t)
                got = ap_moe(x, ids, w, ex).float()
                ref = ap_moe_ref(x, ids, w, ex).float()
                rel = ((got - ref).norm() / ref.norm()).item()
                r = reps if t <= 64 else max(5, reps // 2)
                t_k = timeit(lambda: ap_moe(x, ids, w, ex, check=False), r)  # noqa: B023
                path = pick_config(t, hdim, inter)["path"]
                decode = path in ("gemv", "gemv1")
                t_graph = graph_time(lambda: ap_moe(x, ids, w, ex, check=False), r) if decode else float("nan")  # noqa: B023
                try:
                    t_g = timeit(lambda: dense_grouped(x, ids, w, gate_up, down), r)  # noqa: B023
                except (RuntimeError, AttributeError):  # grouped mm unavailable for this layout/build
                    t_g = float("inf")
                t_l = timeit(lambda: dense_loop(x, ids, w, gate_up, down), r) if e <= 8 or t <= 64 else float("inf")  # noqa: B023
                t_hf = timeit(lambda: hf(x, ids, w.to(torch.bfloat16)), r)  # noqa: B023
                used = ids.unique().tolist()
                qb = ex.bits.tolist()
                kbytes = sum(qb[2 * u + j] * (n * (-(-kk // 32)) * 4) + n * 2 ** qb[2 * u + j] * 2
                             for u in used for j, (n, kk) in enumerate(((2 * inter, hdim), (hdim, inter))))
                kbytes += x.numel() * 2 * 2
                floor_ms = kbytes / bw * 1e3
                dense = min(t_g, t_l)
                t_dg = graph_time(lambda: dense_grouped(x, ids, w, gate_up, down), r) if decode else float("nan")  # noqa: B023
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
    ap.add_argument("--out-md", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="fewer T and q")
    ap.add_argument("--tune", action="store_true", help="pick configs first (see module docstring)")
    ap.add_argument("--workers", type=int, default=12, help="processes compiling tuning candidates")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=None, help="comma-separated families (default: all)")
    ap.add_argument("--ts", default=None, help="comma-separated token counts T (overrides --quick)")
    ap.add_argument("--qs", default=None, help="comma-separated bitwidths, or 'mixed' (overrides --quick)")
    ap.add_argument("--cold-l2", action="store_true",
                    help="flush L2 before every timed call, as a layer deep in a decode step finds it (all paths)")
    args = ap.parse_args()
    t0 = time.time()
    tuned: dict[str, list] = {}
    if args.tune:
        jobs = [(fam, t, c) for fam in SHAPES for t in (1, 4, 16, 64, 256) for c in candidates(t)]
        precompile(jobs, args.workers)
        print(f"precompiled {len(jobs)} candidates in {time.time() - t0:.0f} s", flush=True)
        tuned = {f"{s['hidden']}x{s['inter']}": [] for s in SHAPES.values()}
    bw = copy_bandwidth()
    set_cold_l2(args.cold_l2)
    ts = [1, 4, 64, 256, 2048] if args.quick else [1, 4, 16, 64, 256, 2048]
    qs = ["2", "4", "8", "mixed"] if args.quick else ["2", "3", "4", "6", "8", "mixed"]
    ts = [int(t) for t in args.ts.split(",")] if args.ts else ts
    qs = args.qs.split(",") if args.qs else qs
    rows = []
    for fam, s in SHAPES.items():
        if args.shapes and fam not in args.shapes.split(","):
            continue
        rows += run_shape(fam, s, ts, qs, bw, args.reps, tuned)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": _triton_version(),
            "date": time.strftime("%Y-%m-%d"), "copy_bandwidth_TBps": round(bw / 1e12, 3),
            "seconds": round(time.time() - t0), "cold_l2": args.cold_l2}
    if args.out_md:
        out = {**meta, "rows": rows}
        if tuned:
            args.out_md.with_suffix(".tuned.json").write_text(json.dumps(tuned, indent=1))
        args.out_md.with_suffix(".json").write_text(json.dumps(out, indent=1))
        head = ("| shape | q | T | path | kernel ms | graph ms | bf16 dense ms | dense graph ms | transformers ms "
                "| floor ms | % of floor | graph % of floor | x vs dense | graph x vs dense graph | rel err |")
        lines = [head, "|" + "---|" * 15]
        lines += [f"| {r['shape']} | {r['q']} | {r['T']} | {r['path']} | {r['kernel_ms']} | {r['graph_ms']} | "
                  f"{r['bf16_dense_ms']} | {r.get('bf16_dense_graph_ms', 'nan')} | {r['transformers_ms']} | "
                  f"{r['floor_ms']} | {r['pct_of_floor']} | {r['graph_pct_of_floor']} | {r['speedup_vs_dense']} | "
                  f"{r.get('graph_speedup_vs_dense_graph', 'nan')} | {r['rel_err']} |" for r in rows]
        cmd = " ".join(["python", *sys.argv])
        args.out_md.write_text(f"# AP MoE kernel speed\n\nCommand: `{cmd}`\n\n{meta}\n\n" + "\n".join(lines) + "\n")


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


if __name__ == "__main__":
    main()
