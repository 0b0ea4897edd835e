"""``pwcal search-buckets``: choose routing buckets, multipliers, floors and depth caps (SPEC section 4).

What it does: enumerates a grid of ``BucketPolicy`` settings (bucket count and mass-quantile
boundaries, the hot bucket's damage multiplier mu, stage-0 floors, depth caps), samples
``candidates`` of them reproducibly (plus the neutral one-bucket policy), and scores each by
held-out perplexity when the runtime's own planner (``pwrun.planner.greedy.fit_budget``, run
offline over the calibration tables, with eta = 1 since no live prompt exists) must fit each
memory budget. Score = mean log-perplexity over the budgets (infeasible = +inf). The held-out
text is the next calibration windows after those of ``sensitivity`` and ``fit-residual``.
Writes ``buckets.parquet`` (the winner) and ``bucket_search.parquet`` (every candidate x budget).

Budgets are given as uniform-equivalent bits: budget(3.5) = the midpoint of the expert bytes at
uniform 3 and 4 bits; an integer b is exactly uniform b bits.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pwcal.calib_data import calibration_windows
from pwcal.manifest import read_manifest
from pwcal.stages import begin_stage, finish_stage
from pwcal.tables import read_table, write_table
from pwrun.ap.artifact import APArtifact
from pwrun.errors import PagedWeightError
from pwrun.model.loader import load_model, load_tokenizer
from pwrun.planner.buckets import BucketPolicy
from pwrun.planner.greedy import fit_budget
from pwrun.planner.tables import UNITS, BlockTable
from pwrun.ppl import perplexity


@dataclass(frozen=True)
class SearchConfig:
    """``budgets_bits``: uniform-equivalent budgets; ``candidates``: sampled settings besides the neutral one."""

    budgets_bits: tuple[float, ...] = (3.5, 4.0)
    candidates: int = 8
    heldout_windows: int = 12
    seed: int = 0

    def __post_init__(self) -> None:
        if self.candidates < 0 or self.heldout_windows < 1 or not self.budgets_bits:
            raise PagedWeightError("--candidates must be >= 0, --heldout-windows >= 1, and at least one --budget-bits")


def search_space(seed_bits: int) -> list[BucketPolicy]:
    """Every setting of the grid (the search space; its size is ``len`` of this list)."""
    out = []
    quantile_sets = [(0.5,), (0.75,), (0.33, 0.67), (0.5, 0.85)]
    for qs, mu_hot, hot_floor, cap in itertools.product(quantile_sets, (1.0, 2.0, 4.0, 8.0),
                                                         (seed_bits + 1, seed_bits + 2), (1, 2)):
        nb = len(qs) + 1
        mu = tuple(float(mu_hot ** (i / (nb - 1))) for i in range(nb))  # geometric from cold (1) to hot
        stage0 = tuple(seed_bits if i == 0 else min(8, hot_floor if i == nb - 1 else seed_bits + 1)
                       for i in range(nb))
        stage1 = tuple(max(seed_bits, f - 1) for f in stage0)
        out.append(BucketPolicy(qs, mu, (stage0, stage1), tuple([cap] * nb)))
    return out


def budget_bytes(table: BlockTable, bits: float) -> int:
    lo, hi = math.floor(bits), math.ceil(bits)
    b_lo = table.bytes[:, table.bit_index(lo)].sum()
    b_hi = table.bytes[:, table.bit_index(hi)].sum()
    return int(b_lo + (bits - lo) * (b_hi - b_lo))


def policy_frame(p: BucketPolicy) -> pd.DataFrame:
    qs = [*p.quantiles, 1.0]
    f1 = p.floors[1] if len(p.floors) > 1 else p.floors[0]
    return pd.DataFrame([{"bucket": i, "mass_quantile_hi": qs[i], "mu": p.mu[i], "floor_stage0": p.floors[0][i],
                          "floor_stage1": f1[i], "depth_cap": p.depth_cap[i]} for i in range(p.num_buckets)])


def policy_from_frame(df: pd.DataFrame) -> BucketPolicy:
    """The ``BucketPolicy`` stored in a ``buckets`` table."""
    return BucketPolicy.from_frame(df)


def run_search_buckets(model_dir: Path, artifact_dir: Path, cfg: SearchConfig, device: str = "auto",
                       force: bool = False, progress: Callable[[str, int, int], None] | None = None
                       ) -> dict[str, Any]:
    """The whole stage; returns its manifest entry (``{"skipped": True}`` if already complete)."""
    if not begin_stage(artifact_dir, model_dir, "search-buckets", asdict(cfg), force):
        return {"skipped": True}
    t0 = time.time()
    stages = read_manifest(artifact_dir)["stages"]
    sens_cfg, res_cfg = stages["sensitivity"]["config"], stages["fit-residual"]["config"]
    table = BlockTable.from_frames(read_table(artifact_dir / "sensitivity.parquet", "sensitivity"),
                                   read_table(artifact_dir / "routing.parquet", "routing"))
    art = APArtifact(artifact_dir)
    bad = [b for b in cfg.budgets_bits if not art.seed_bits <= b <= 8]
    if bad:
        raise PagedWeightError(f"--budget-bits {bad} outside [{art.seed_bits}, 8] (the artifact's bitwidths)")
    tok = load_tokenizer(model_dir)
    base = load_model(model_dir, device=device, dtype="float32")
    windows = calibration_windows(tok, sens_cfg["dataset"], cfg.heldout_windows, sens_cfg["seq_len"],
                                  sens_cfg["seed"], skip=sens_cfg["samples"] + res_cfg["prompts"])
    flat = [t for w in windows for t in w]
    space = search_space(art.seed_bits)
    rng = np.random.default_rng(cfg.seed)
    picks = rng.choice(len(space), size=min(cfg.candidates, len(space)), replace=False)
    candidates = [BucketPolicy.neutral(art.seed_bits), *(space[i] for i in sorted(picks))]
    budgets = [budget_bytes(table, b) for b in cfg.budgets_bits]
    rows, scores = [], []
    for ci, pol in enumerate(candidates):
        logs = []
        for budget in budgets:
            q = fit_budget(table, pol, budget)
            if q is None:
                rows.append({"candidate": ci, "setting": pol.to_json(), "budget_bytes": budget, "expert_bytes": -1,
                             "ppl": math.inf, "score": math.inf})
                logs.append(math.inf)
                continue
            bits = {(int(la), int(e), UNITS[u]): int(table.bits[qi])
                    for la, e, u, qi in zip(table.layer, table.expert, table.unit, q, strict=True)}
            ppl = perplexity(art.dense_model(base, bits), flat, seq_len=len(windows[0])).ppl
            rows.append({"candidate": ci, "setting": pol.to_json(), "budget_bytes": budget,
                         "expert_bytes": table.total_bytes(q), "ppl": ppl, "score": math.nan})
            logs.append(math.log(ppl))
        scores.append(float(np.mean(logs)))
        for r in rows[-len(budgets):]:
            r["score"] = scores[-1]
        if progress:
            progress("candidates", ci + 1, len(candidates))
    best = int(np.argmin(scores))
    if not math.isfinite(scores[best]):
        raise PagedWeightError(f"no candidate fits the budgets {list(cfg.budgets_bits)}: raise --budget-bits")
    write_table(pd.DataFrame(rows), artifact_dir / "bucket_search.parquet", "bucket_search")
    write_table(policy_frame(candidates[best]), artifact_dir / "buckets.parquet", "buckets")
    info = {"config": asdict(cfg), "files": ["buckets.parquet", "bucket_search.parquet"],
            "search_space_size": len(space), "candidates_scored": len(candidates), "budgets_bytes": budgets,
            "best_candidate": best, "best_setting": candidates[best].to_json(),
            "heldout_dataset": sens_cfg["dataset"], "heldout_tokens": len(flat),
            "best_ppl_per_budget": [r["ppl"] for r in rows if r["candidate"] == best],
            "neutral_ppl_per_budget": [r["ppl"] for r in rows if r["candidate"] == 0],
            "seconds": round(time.time() - t0, 2)}
    finish_stage(artifact_dir, "search-buckets", info)
    return info
