"""Bucket-search suite: ``pwcal search-buckets`` on the bundled model as the user runs it (whole process, CPU).

What it measures: the wall time of ``pwcal search-buckets MODEL --artifacts DIR --force`` (interpreter start,
imports, model load, the candidates' fits, selection and confirmation) on a copy of an artifact made by
``pwcal run-all`` (``make demo`` makes ``artifacts/runs/tiny-ap``), for each variant: ``default`` (the shipped
search: successive halving in bfloat16 where the CPU multiplies it natively) and ``exhaustive-fp32``
(``--rounds 1 --dtype float32``: every setting on every window in float32). With ``--baseline REV`` the same
variants also run from a git worktree of REV in the same session (rows labelled ``base REV``; its ``default``
only, what REV shipped, since older builds lack the variants' flags), so the ratio compares builds under the same
load. Each record has the stage's own seconds (manifest), the allocation x window
sequences it scored, the winner, its band and the machine's load average before the run. One record per run in
``bench/results/search_buckets.jsonl``.

Usage::

    python -m bench.search_buckets [--artifacts artifacts/runs/tiny-ap] [--baseline REV] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import environment, write_records

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "artifacts" / "models" / "tiny-qwen2moe-wiki"
VARIANTS = {"default": [], "exhaustive-fp32": ["--rounds", "1", "--dtype", "float32"]}


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``) and its core count."""
    name = platform.processor() or platform.machine()
    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name} x {os.cpu_count()}"


def run_once(tree: Path, artifacts: Path, extra: list[str]) -> dict[str, object]:
    """One whole ``pwcal search-buckets --force`` from the code in ``tree`` on a copy of ``artifacts``."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "ap"
        shutil.copytree(artifacts, work)
        load = os.getloadavg()[0]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "pwcal", "search-buckets", str(MODEL), "--artifacts", str(work),
                            "--force", *extra], cwd=tree, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if r.returncode != 0:
            raise SystemExit(f"search-buckets failed in {tree}:\n{r.stderr[-2000:]}")
        info = json.loads((work / "manifest.json").read_text())["stages"]["search-buckets"]
    return {"seconds": round(seconds, 2), "stage_seconds": info["seconds"], "load_before": round(load, 2),
            "sequences_scored": info.get("allocation_windows_scored"), "dtype": info.get("dtype", "float32"),
            "best_setting": info["best_setting"], "neutral_from_bits": info["neutral_from_bits"],
            "best_ppl_per_budget": info["best_ppl_per_budget"],
            "neutral_ppl_per_budget": info["neutral_ppl_per_budget"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", type=Path, default=ROOT / "artifacts" / "runs" / "tiny-ap",
                    help="an artifact of the bundled model with every stage done (`make demo` makes the default)")
    ap.add_argument("--baseline", help="a git revision to time beside this tree in the same session")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each variant (interleaved)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    # SIGTERM ends the run like Ctrl-C: the temporary copies and the baseline worktree are removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not (args.artifacts / "manifest.json").is_file():
        raise SystemExit(f"{args.artifacts} has no manifest: run `make demo` (or `pwcal run-all {MODEL} --out "
                         f"{args.artifacts}`) first")
    variants = args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variants {bad}: use {list(VARIANTS)}")
    env = environment()
    trees = [("measured", env["label"], ROOT)]
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            base = Path(tmp) / "base"
            subprocess.run(["git", "worktree", "add", "--detach", str(base), args.baseline], cwd=ROOT, check=True,
                           capture_output=True)
            trees.append(("baseline", f"base {args.baseline}", base))
        try:
            recs = []
            for rep in range(args.repeats):  # interleaved: builds and variants see the same load
                for build, label, tree in trees:
                    for v in (variants if tree == ROOT else ["default"]):
                        print(f"{label} {v} run {rep + 1} of {args.repeats} ...", file=sys.stderr, flush=True)
                        rec = {"build": build, "label": label, "variant": v, "repeat": rep, "cpu": cpu_name(),
                               **run_once(tree, args.artifacts, VARIANTS[v])}
                        print(json.dumps(rec), flush=True)
                        recs.append(rec)
        finally:
            if args.baseline:
                subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    write_records("search_buckets", recs, env, args.out)


if __name__ == "__main__":
    main()
