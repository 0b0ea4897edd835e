"""MoE launch-config sweep: every candidate path and tile of one expert shape at each token count, and the shipped one.

What it does: for an expert shape of ``bench.moe_kernel.SHAPES`` (random weights and router, seeded), at each token
count T and bitwidth setting (uniform q, or ``mixed``: a random mix of 3..8 per block), checks each candidate
config of ``CANDIDATES`` against ``ap_moe_ref`` and times it by CUDA-graph replay (GPU ms per layer, median), beside
the shipped config (``pwkernels/configs/ap_moe.json``) and the bf16 grouped GEMM on the same routing. One record
per (shape, q, T): the shipped and the best config's ms and share of the floor (plane and LUT bytes of the routed
experts at the measured copy bandwidth, as ``bench.moe_kernel``), every candidate's ms (or its error), in
``bench/results/moe_tune.jsonl`` as each T ends. ``--write`` puts the winners (summed over the q settings) into the
shape's buckets of ``pwkernels/configs/ap_moe.json`` as each T ends, from the smallest T swept on (the buckets below
and above the swept range stay); a winner holds from its T to the next swept T.

Usage (GPU machine)::

    python -m bench.moe_tune [--shape qwen1.5-moe] [--ts 16,32,64,128,256,512] [--qs 4,mixed] [--write]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import copy_bandwidth, environment, graph_ms, write_records
from bench.moe_kernel import SHAPES, dense_grouped, layer_floor_ms, make_layer, random_layer, routed
from pwkernels.moe.dispatch import CONFIGS, ap_moe, pick_config
from pwkernels.moe.ref import ap_moe_ref
from pwkernels.warmup import default_workers, run_in_workers

CONFIG_FILE = Path(__file__).resolve().parents[1] / "pwkernels" / "configs" / "ap_moe.json"


def _decode(slots: int, gate_up_k: int = 1024, down_k: int = 512) -> dict[str, Any]:
    return {"path": "decode", "gate_up": {"BLOCK_N": 8, "BLOCK_K": gate_up_k, "num_warps": 4, "RAW_SHFL": 1},
            "down": {"BLOCK_N": 32, "BLOCK_K": down_k, "num_warps": 4, "SPLIT_K": 1, "RAW_SHFL": 1}, "SLOTS": slots}


def _words(block_m: int, split: bool) -> dict[str, Any]:
    return {"path": "mid", "BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": 512, "num_warps": 4, "WORDS": 1,
            "RAW_SHFL": 1, "BLOCK_N_DOWN": 64, "SPLIT_Q": int(split)}


CANDIDATES: dict[str, dict[str, Any]] = {
    "decode S4": _decode(4),
    # narrow experts (Gemma-4: I = 704 columns for down, H = 2,816 for gate_up): K steps that waste fewer columns
    "decode S1 k512/256": _decode(1, 512, 256), "decode S2 k1024/256": _decode(2, 1024, 256),
    "decode tokens k512/256": _decode(0, 512, 256),
    "words 16": _words(16, False), "words 16 split": _words(16, True),
    "words 32 split": _words(32, True),
    "mid 16x64x64": {"path": "mid", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4},
    "mid 64x64x64": {"path": "mid", "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8},
    # prefill: the dequantize kernel's tile (writes every used expert in 16-bit once per step)
    "prefill 16x512": {"path": "prefill", "BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4},
    "prefill 8x1024": {"path": "prefill", "BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4},
    "prefill 32x256": {"path": "prefill", "BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4},
    "prefill 32x512 w8": {"path": "prefill", "BLOCK_N": 32, "BLOCK_K": 512, "num_warps": 8},
    "prefill 64x256 w8": {"path": "prefill", "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 8},
    "prefill 16x256 w2": {"path": "prefill", "BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 2},
}


def _graph(fn: Callable[[], object], reps: int) -> float:
    """Median GPU ms of ``fn`` replayed from a CUDA graph."""
    return graph_ms(lambda _: fn(), 1, reps)


def _layers(shape: str, qs: list[str]) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """The layer of ``shape`` at each bit setting of ``qs`` (seeded: every process builds the same), and the bf16
    gate_up and down weights of the dense baseline."""
    s = SHAPES[shape]
    codes, luts, gate_up, down = random_layer(s)
    g = torch.Generator().manual_seed(0)
    e = s["experts"]
    layers = {qn: make_layer(s, torch.randint(3, 9, (2 * e,), generator=g).tolist() if qn == "mixed"
                             else [int(qn)] * (2 * e), codes, luts) for qn in qs}
    return layers, gate_up, down


_WORKER_LAYERS: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}  # per worker process: built once


def _compile_job(job: tuple[str, tuple[str, ...], int, str, str]) -> str:
    """Worker: one call of config ``name`` (a candidate, or "shipped") at T tokens on the ``q`` layer, so that its
    kernels land in Triton's on-disk cache before the timed sweep; "" or the error."""
    shape, qs, t, qn, name = job
    try:
        s = SHAPES[shape]
        if (shape, qs) not in _WORKER_LAYERS:
            _WORKER_LAYERS[(shape, qs)] = _layers(shape, list(qs))[0]
        x, ids, w = routed(s, t, t)
        cfg = pick_config(t, s["hidden"], s["inter"]) if name == "shipped" else CANDIDATES[name]
        ap_moe(x, ids, w, _WORKER_LAYERS[(shape, qs)][qn], config=cfg, activation=s.get("activation", "silu"))
        torch.cuda.synchronize()
        return ""
    except Exception as err:  # the sweep records this config's error itself
        return f"{name} T={t} q={qn}: {type(err).__name__}: {str(err)[:160]}"


def precompile(shape: str, ts: list[int], qs: list[str], workers: int) -> None:
    """Compile every (T, q, config) of the sweep in ``workers`` processes first (serially, in the timing process,
    each candidate's first call compiles for 5-20 s); errors are left to the sweep to record."""
    jobs = [(shape, tuple(qs), t, qn, name) for t in ts for qn in qs for name in ("shipped", *CANDIDATES)]
    start = time.perf_counter()
    print(f"compiling {len(jobs)} (T, q, config) calls on {workers} processes", flush=True)
    errors = run_in_workers(_compile_job, jobs, workers)
    print(f"compiled in {time.perf_counter() - start:.0f} s ({len(errors)} calls failed; the sweep records why)",
          flush=True)


def sweep(shape: str, ts: list[int], qs: list[str], reps: int, emit: Callable[[list[dict[str, Any]]], None],
          bw: float) -> list[dict[str, Any]]:
    """The records, T by T (``emit(rows so far)`` after each T, so that a run cut short keeps what it measured);
    each with the floor of its routing at copy bandwidth ``bw`` (bytes/s) and the shipped and best configs' share."""
    s = SHAPES[shape]
    act = s.get("activation", "silu")
    layers, gate_up, down = _layers(shape, qs)
    rows: list[dict[str, Any]] = []
    for t in ts:
        x, ids, w = routed(s, t, t)
        shipped = pick_config(t, s["hidden"], s["inter"])
        for qn, ex in layers.items():
            ref = ap_moe_ref(x, ids, w, ex, act).float()
            ms: dict[str, Any] = {}
            for name, cfg in [("shipped", shipped), *CANDIDATES.items()]:
                try:
                    got = ap_moe(x, ids, w, ex, config=cfg, activation=act).float()
                    rel = ((got - ref).norm() / ref.norm()).item()
                    if not rel < 1e-2:  # a wrong kernel is not timed
                        ms[name] = f"wrong: rel err {rel:.1e}"
                        continue
                    ms[name] = round(_graph(functools.partial(ap_moe, x, ids, w, ex, config=cfg, check=False,
                                                              activation=act), reps), 4)
                except Exception as err:  # one failing config must not lose the others
                    ms[name] = f"{type(err).__name__}: {str(err)[:120]}"
            timed = {k: v for k, v in ms.items() if isinstance(v, float)}
            best = min(timed, key=timed.__getitem__) if timed else ""
            bf16 = _graph(functools.partial(dense_grouped, x, ids, w, gate_up, down, act), reps)
            floor = layer_floor_ms(ex, ids, x, s["hidden"], s["inter"], bw)
            share = {f"{k}_pct_of_floor": round(100 * floor / timed[v], 1) if v in timed else None
                     for k, v in (("shipped", "shipped"), ("best", best))}
            rows.append({"shape": shape, "q": qn, "T": t, "shipped_path": shipped.get("path"),
                         "shipped_ms": timed.get("shipped"), "best": best, "best_ms": timed.get(best),
                         "best_config": shipped if best == "shipped" else CANDIDATES.get(best),
                         "bf16_grouped_ms": round(bf16, 4), "configs_ms": ms, "floor_ms": round(floor, 4), **share,
                         "best_x_vs_shipped": round(timed["shipped"] / timed[best], 3) if best and "shipped" in timed
                         else None})
            print(f"{shape} q={qn} T={t}: shipped {ms['shipped']} ms, best {best} {timed.get(best)} ms, bf16 "
                  f"{bf16:.4f} ms | " + "  ".join(f"{k}={v}" for k, v in ms.items()), flush=True)
        emit(rows)
    return rows


def write_buckets(shape: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Put each swept T's winner (least ms summed over the q settings) into ``shape``'s buckets of the config file,
    from the smallest swept T on; neighbouring equal configs merge. Returns the new buckets."""
    s = SHAPES[shape]
    key = f"{s['hidden']}x{s['inter']}"
    table = json.loads(CONFIG_FILE.read_text())
    old = table["by_shape"].get(key, table["default"])
    ts = sorted({r["T"] for r in rows})
    new = [b for b in old if b["min_tokens"] < ts[0]]
    above = [b for b in old if b["min_tokens"] > ts[-1]]  # token counts past the sweep keep their buckets
    for t in ts:
        total: dict[str, float] = {}
        for r in (r for r in rows if r["T"] == t):
            for name, v in r["configs_ms"].items():
                total[name] = total.get(name, 0.0) + v if isinstance(v, float) else float("inf")
        name = min(total, key=total.__getitem__)
        cfg = pick_config(t, s["hidden"], s["inter"], CONFIGS) if name == "shipped" else CANDIDATES[name]
        if not new or new[-1]["config"] != cfg:
            new.append({"min_tokens": t, "config": copy.deepcopy(cfg)})
    for b in above:
        if new[-1]["config"] != b["config"]:
            new.append(b)
    table["by_shape"][key] = new
    CONFIG_FILE.write_text(json.dumps(table, indent=1) + "\n")
    return new


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen1.5-moe", help=f"one of {', '.join(SHAPES)}")
    ap.add_argument("--ts", default="16,32,64,128,256,512", help="comma-separated token counts T")
    ap.add_argument("--qs", default="4,mixed", help="comma-separated bitwidths, or 'mixed'")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--write", action="store_true", help="write the winners into pwkernels/configs/ap_moe.json")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSONL (default bench/results/moe_tune.jsonl)")
    ap.add_argument("--workers", type=int, default=default_workers(),
                    help="processes that compile every config first (0: each compiles at its first timed call)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.moe_tune times CUDA-graph replays: run it on the GPU machine")
    env = environment(args.label)
    written = 0

    def emit(rows: list[dict[str, Any]]) -> None:
        nonlocal written
        write_records("moe_tune", rows[written:], env, args.out)
        written = len(rows)
        if args.write:
            print(json.dumps(write_buckets(args.shape, rows)), flush=True)

    ts, qs = [int(t) for t in args.ts.split(",")], args.qs.split(",")
    if args.workers > 0:
        precompile(args.shape, ts, qs, args.workers)
    sweep(args.shape, ts, qs, args.reps, emit, copy_bandwidth())


if __name__ == "__main__":
    main()
