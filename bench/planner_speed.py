"""Host time of each planner call at a real model's size (CPU only: the planner is numpy, no device).

What it measures, for the expert blocks of a seed model's config (Qwen1.5-MoE-A2.7B: 2928 blocks) with a
synthetic calibration table (the one ``bench/serve_speed.py`` serves with) and live routing statistics:
the median milliseconds of ``refresh`` (d_hat from the tables and the live statistics: done every few steps,
while the device computes), ``plan_lower`` for one and for eight KV blocks (a prepared plan or a demotion
on the step's critical path), ``plan_raise`` (reloads, while the device computes) and ``is_prepared``.
Compare with the decode step (bench/results/serve_h200.md: ~6-13 ms) for issue #8's "< 1% of the step".

Usage::

    python bench/planner_speed.py --out bench/results/planner_speed_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from pwrun.engine.experts import page_rounded_bytes
from pwrun.model.families import spec_from_config
from pwrun.model.loader import read_config
from pwrun.planner.buckets import BucketPolicy
from pwrun.planner.online import OnlineStats
from pwrun.planner.runtime import Planner, PlannerConfig

sys.path.insert(0, str(Path(__file__).parent))
from serve_synthetic import BITS, synthetic_table  # the table serve_speed serves with


def median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-dir", type=Path, default=Path("tests/fixtures/configs/Qwen__Qwen1.5-MoE-A2.7B"))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    spec, _ = spec_from_config(read_config(args.config_dir))
    a = spec.layers[0].attention
    page = 16 * a.num_kv_heads * a.head_dim * 2
    table = synthetic_table(spec)
    table = replace(table, bytes=page_rounded_bytes(table, spec, page))
    kv_block = 2 * spec.num_layers * page
    e = max(ls.moe.num_experts for ls in spec.layers if ls.moe is not None)
    stats = OnlineStats(table.layer, table.expert, spec.num_layers, e, 0.9)
    rng = np.random.default_rng(0)
    stats.update(rng.random((spec.num_layers, e + 1)), rng.random((spec.num_layers, e + 1, 4)))
    policy = BucketPolicy((0.5, 0.85), (1.0, 1.0, 1.0), ((4, 5, 6), (3, 4, 5)), (2, 2, 2))
    planner = Planner(table, policy, PlannerConfig(free_threshold=4, reload_threshold=16), None, stats)
    q = np.full(table.n, BITS.index(4))
    planner.refresh()
    rows = {
        "blocks": int(table.n),
        "refresh_ms": median_ms(planner.refresh, args.reps),
        "plan_lower_1_kv_block_ms": median_ms(lambda: planner.plan_lower(q, kv_block), args.reps),
        "plan_lower_8_kv_blocks_ms": median_ms(lambda: planner.plan_lower(q, 8 * kv_block), args.reps),
        "plan_raise_ms": median_ms(lambda: planner.plan_raise(np.full(table.n, BITS.index(3)), 64 * kv_block),
                                   args.reps),
        "is_prepared_ms": median_ms(lambda: planner.is_prepared(q, kv_block), args.reps),
    }
    # under pressure: half of what the floors let go already demoted (from 4 bits), so the timed plan still has
    # blocks to lower, fewer of them
    most = planner.plan_lower(q, float(table.total_bytes(q)))  # everything down to the last floors
    low = q.copy()
    p = planner.plan_lower(q, 0.5 * most.freed)
    low[p.blocks] = p.to_idx
    rows["plan_lower_1_kv_block_pressured_ms"] = median_ms(lambda: planner.plan_lower(low, kv_block), args.reps)
    rows["pressured_plan_freed_bytes"] = int(planner.plan_lower(low, kv_block).freed)
    rows["pressured_blocks_that_can_go_lower"] = int(planner.plan_lower(low, float(table.total_bytes(q))).blocks.size)
    meta = {"cpu": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
            "config": str(args.config_dir), "command": "python bench/planner_speed.py"}
    print(json.dumps({**meta, **rows}, indent=1))
    if args.out:
        args.out.write_text(json.dumps({**meta, **rows}, indent=1))


if __name__ == "__main__":
    main()
