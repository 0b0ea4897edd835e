"""Host work of PagedWeight under pressure on the CPU: demotion plans by caller and why none was ready, and the
host time of executing demotions (no GPU needed: the planner and the page table are control plane).

What it does: runs ``bench/serve_speed.py``'s PagedWeight-under-pressure scenario (b long prompts, then b short
ones, a budget that forces demotions and reloads) on the CPU with a shrunken copy of a seed config (same layers
and experts, so the planner sees the real block count; tiny hidden sizes, so the model runs fast), with
``--cuda-order`` the planner's CUDA step order (plans prepared while the device computes), and prints:
every ``Planner.take`` by caller (admission = ``make_room`` for a whole prompt; after_step = pressure after
sampling), whether the prepared plan held (else why not) and whether the plan freed the room, with milliseconds;
and the host microseconds per demoted block of ``ExpertStore.lower``. Usage::

    python bench/pressure_host_probe.py [--batch 16] [--prompt-len 512] [--gen 32] [--cuda-order]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

import pwrun.engine.experts as experts
import pwrun.planner.runtime as runtime

sys.path.insert(0, str(Path(__file__).parent))
import serve_speed  # bench/ sibling

TAKES: collections.Counter[tuple[str, ...]] = collections.Counter()
TAKE_MS: collections.Counter[str] = collections.Counter()
LOWER: collections.Counter[str] = collections.Counter()


def _instrument() -> None:
    take, lower = runtime.Planner.take, experts.ExpertStore.lower

    def counted_take(self: runtime.Planner, q_idx: np.ndarray, need_bytes: float,
                     movable: np.ndarray | None = None) -> Any:
        where = "admission" if any(f.name == "make_room" for f in traceback.extract_stack()) else "after_step"
        why = self.why_not_prepared(q_idx, need_bytes, movable) or "prepared held"
        t0 = time.perf_counter()
        plan = take(self, q_idx, need_bytes, movable)
        TAKE_MS[where] += 1e3 * (time.perf_counter() - t0)
        TAKES[(where, why, "frees the room" if plan.freed >= need_bytes else "falls short")] += 1
        return plan

    def timed_lower(self: experts.ExpertStore, blocks: np.ndarray, to_bits: np.ndarray) -> int:
        t0 = time.perf_counter()
        freed = lower(self, blocks, to_bits)
        LOWER["ms"] += 1e3 * (time.perf_counter() - t0)
        LOWER["blocks"] += len(blocks)
        return freed

    runtime.Planner.take = counted_take  # type: ignore[method-assign]
    experts.ExpertStore.lower = timed_lower  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-dir", type=Path, default=Path("tests/fixtures/configs/Qwen__Qwen1.5-MoE-A2.7B"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512, help="tokens of the long prompts (the short ones: 256)")
    ap.add_argument("--gen", type=int, default=32, help="new tokens per request")
    ap.add_argument("--cuda-order", action="store_true", help="plan as on CUDA (prepared during the step)")
    args = ap.parse_args()
    cfg = json.loads((args.config_dir / "config.json").read_text())
    cfg.update(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, shared_expert_intermediate_size=256,
               num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)
    if args.cuda_order:
        serve_speed.PLANNER = replace(serve_speed.PLANNER, overlapped=True)
    _instrument()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        out = Path(tmp) / "probe.md"
        sys.argv = ["serve_speed", "--device", "cpu", "--config-dir", tmp, "--skip-hf", "--skip-lean16", "--batches",
                    str(args.batch), "--bits", "4", "--prompt-len", str(args.prompt_len), "--gen", str(args.gen),
                    "--big-budget-gib", "1", "--only-pressure", "--out-md", str(out)]
        serve_speed.main()
        row = next(r for r in json.loads(out.with_suffix(".json").read_text())["rows"]
                   if r["system"] == "PagedWeight under pressure")
    print(f"\n{'cuda' if args.cuda_order else 'cpu'} step order, batch {args.batch}, prompts {args.prompt_len} + 256, "
          f"{args.gen} new tokens (warm-up and timed run together):")
    for (where, why, ok), n in sorted(TAKES.items()):
        print(f"  {where:10s} {why:28s} {ok:15s} {n:5d}")
    for where, ms in sorted(TAKE_MS.items()):
        print(f"  {where}: {ms:.1f} ms in Planner.take")
    print(f"  demotions executed: {LOWER['blocks']} blocks, {1e3 * LOWER['ms'] / max(LOWER['blocks'], 1):.2f} us "
          "of host time per block (ExpertStore.lower)")
    print("  timed run: " + json.dumps({k: row.get(k) for k in (
        "planner_ms_per_step", "planner_ms_per_decode_step", "planner_plans_prepared", "planner_plans_fresh",
        "preemptions", "demoted_blocks", "promoted_blocks")}))


if __name__ == "__main__":
    main()
