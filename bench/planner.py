"""Planner suite: host time of each planner call at a real model's block count (CPU: the planner is numpy).

What it measures, for the expert blocks of a seed config (Qwen1.5-MoE-A2.7B: 2928 blocks) with the synthetic
calibration table the serving suite serves with and live routing statistics: the median ms of ``refresh``
(d_hat from the tables and the live statistics, every few steps while the device computes), ``plan_lower`` for
one and eight KV blocks (a demotion on the step's critical path), the same under pressure (half of what the floors
let go already demoted), ``plan_raise`` (reloads) and ``is_prepared``. One record per call in
``bench/results/planner.jsonl``; compare with the decode step time of the serving suite.

Usage::

    python -m bench.planner [--config-dir tests/fixtures/configs/...] [--reps 30]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.common import (
    BENCH_PLANNER,
    BENCH_POLICY,
    QWEN,
    environment,
    kv_bytes,
    page_rounded_table,
    seed_spec,
    synthetic_table,
    write_records,
)
from pwrun.core.planner.online import OnlineStats
from pwrun.core.planner.runtime import Planner


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-dir", type=Path, default=QWEN)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSONL (default bench/results/planner.jsonl)")
    args = ap.parse_args()
    env = environment(args.label)
    spec, _ = seed_spec(args.config_dir)
    table = page_rounded_table(synthetic_table(spec), spec)
    kv_block = kv_bytes(spec, 16)
    e = max(ls.moe.num_experts for ls in spec.layers if ls.moe is not None)
    stats = OnlineStats(table.layer, table.expert, spec.num_layers, e, 0.9)
    rng = np.random.default_rng(0)
    stats.update(rng.random((spec.num_layers, e + 1)), rng.random((spec.num_layers, e + 1, 4)))
    planner = Planner(table, BENCH_POLICY, BENCH_PLANNER, None, stats)
    q = np.full(table.n, 4)
    planner.refresh()
    lower = {"refresh": planner.refresh,
             "plan_lower, 1 KV block": lambda: planner.plan_lower(q, kv_block),
             "plan_lower, 8 KV blocks": lambda: planner.plan_lower(q, 8 * kv_block),
             "plan_raise, 64 KV blocks": lambda: planner.plan_raise(np.full(table.n, 3), 64 * kv_block),
             "is_prepared": lambda: planner.is_prepared(q, kv_block)}
    ms = {name: median_ms(fn, args.reps) for name, fn in lower.items()}
    # under pressure: half of what the floors let go already demoted (from 4 bits), so the timed plan still has
    # blocks to lower, fewer of them
    most = planner.plan_lower(q, float(table.total_bytes(q)))  # everything down to the last floors
    low = q.copy()
    p = planner.plan_lower(q, 0.5 * most.freed)
    low[p.blocks] = p.to_bits
    ms["plan_lower, 1 KV block, under pressure"] = median_ms(lambda: planner.plan_lower(low, kv_block), args.reps)
    base = {"model": args.config_dir.name, "blocks": int(table.n), "cpu": platform.processor() or platform.machine()}
    recs = [{**base, "call": k, "ms": round(v, 4)} for k, v in ms.items()]
    write_records("planner", recs, env, args.out)
    print(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
