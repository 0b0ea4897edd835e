"""``pwcal search-buckets``: choose routing buckets, multipliers, floors and depth caps (SPEC section 4).

What it does: scores every setting of a grid of ``BucketPolicy`` settings (bucket count and
mass-quantile boundaries, the hot bucket's damage multiplier mu, stage-0 floors, depth caps; or a
reproducible sample of it, a prefix of one seeded permutation, so a larger sample only adds
settings) plus the neutral one-bucket policy, by held-out perplexity when the runtime's own planner
(``pwrun.core.planner.greedy.fit_budget``, run offline over the calibration tables, with eta = 1 since no
live prompt exists) must fit each memory budget. Settings that give the same allocation at a budget
share one perplexity. Selection score = mean log-perplexity over the budgets (infeasible = +inf).
The settings race over the selection windows in ``rounds`` rounds of successive halving
(``pwcal.bucket_select``): after each round only the best ``keep`` of them go on, so the winner is scored on
every window while clearly worse settings stop after the first chunk. The allocations are scored together in
batched passes (``pwcal.alloc_scoring``: each dequantized weight made once, shared layer prefixes run once),
equal to one model per allocation up to float rounding, in ``dtype`` (bfloat16, the dtype the runtime serves in,
where the device multiplies it natively: 2x the float32 matmul rate on such CPUs).

Confirmation (the held-out objective the choice is kept on): the winner and the neutral policy are scored again, per
budget, on the next ``confirm_windows`` calibration windows, which the selection never saw (the best of many
settings on one text is optimistically scored there). It shows a gain at a budget when its mean per-window NLL gain
exceeds ``budget_z`` standard errors of the paired differences: ``gain_z`` holds for the family of budgets
(Bonferroni), since every budget's test moves the band. The winner is
kept only below the smallest budget at which it shows no gain: ``neutral_from_bits`` of the written policy, the
band the runtime planner hands to the neutral policy (``pwrun.core.planner.buckets``). The
budgets span where the runtime works (its mean expert bits on the evaluation's text suite run from ~3.5 at U3 to
~5.8 at U6), so a setting that helps at 3.5-4 bits but not at 5-6 is not applied at 5-6. Below the smallest budget
(floors only bind there) the winner applies. The held-out text is the calibration windows after those of
``sensitivity`` and ``fit-residual``. Writes ``buckets.parquet`` (the winner and its band) and
``bucket_search.parquet`` (every candidate x budget of the selection, and the confirmation rows).

Budgets are given as uniform-equivalent bits (``BlockTable.uniform_bytes``): budget(3.5) = the
midpoint of the expert bytes at uniform 3 and 4 bits; an integer b is exactly uniform b bits.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import pandas as pd

from pwcal.alloc_scoring import CACHE_BYTES, score_allocations
from pwcal.bucket_select import round_bounds, select
from pwcal.calib_data import calibration_windows
from pwcal.residual import ResidualConfig
from pwcal.sensitivity import OPTIONAL_FIELDS, SensitivityConfig
from pwcal.split_experts import WeightCache
from pwcal.stages import begin_stage, committing, finish_stage, locked_stage, recorded_config
from pwformat.errors import PagedWeightError
from pwformat.tables import write_table
from pwrun.ap.artifact import APArtifact
from pwrun.core.planner.buckets import BucketPolicy
from pwrun.core.planner.greedy import fit_budget
from pwrun.core.planner.tables import BlockTable
from pwrun.model.loader import load_model, load_tokenizer, resolve_device, scoring_dtype

# progress labels: the stage, its phase of two, and what is counted (scored allocation x window sequences)
PHASES = {"select": "search-buckets 1/2 select, round {r} of {rounds}: allocation x window scores",
          "confirm": "search-buckets 2/2 confirm (winner vs neutral): allocation x window scores"}
# a search recorded before these parameters existed (every candidate on every window, in float32: a finer search
# than the defaults) counts as done with the defaults, so `pwcal run-all` on its artifact does not redo it
RECORDED_BEFORE = {"rounds": 6, "keep": 0.5, "dtype": "auto"}


@dataclass(frozen=True)
class SearchConfig:
    """``budgets_bits``: uniform-equivalent budgets; ``candidates``: settings besides the neutral one (None: the
    whole grid); ``heldout_windows``: selection windows; ``confirm_windows``: the next windows, for the band;
    ``gain_z``: the one-sided z of the confirmation over all budgets together (``budget_z`` at each);
    ``rounds``, ``keep``: the successive halving of the selection (``pwcal.bucket_select``; at most one round per
    selection window); ``dtype``: of the
    scoring passes (auto: ``pwrun.model.loader.scoring_dtype``)."""

    budgets_bits: tuple[float, ...] = (3.5, 4.0, 4.5, 5.0, 6.0)
    candidates: int | None = None
    heldout_windows: int = 12
    confirm_windows: int = 24
    seed: int = 0
    gain_z: float = 1.645  # one-sided 95% over the budgets: 2.33 standard errors at each of five
    rounds: int = 6
    keep: float = 0.5  # the better half (rounded up) of the feasible settings goes on to the next round
    dtype: str = "auto"

    def __post_init__(self) -> None:
        checks = [(self.candidates is None or self.candidates >= 0, f"--candidates {self.candidates} must be >= 0"),
                  (self.heldout_windows >= 1, f"--heldout-windows {self.heldout_windows} must be >= 1"),
                  (self.confirm_windows >= 2, f"--confirm-windows {self.confirm_windows} must be >= 2"),
                  (self.seed >= 0, f"--seed {self.seed} must be >= 0"),
                  (math.isfinite(self.gain_z) and self.gain_z >= 0, f"--gain-z {self.gain_z} must be a finite number "
                   ">= 0"),
                  (self.rounds >= 1, f"--rounds {self.rounds} must be >= 1"),
                  (0 < self.keep <= 1, f"--keep {self.keep} must be in (0, 1]"),
                  (self.dtype in ("auto", "bfloat16", "float32"), f"--dtype {self.dtype!r}: use auto, bfloat16 or "
                   "float32"),
                  (bool(self.budgets_bits), "give at least one --budget-bits"),
                  (all(math.isfinite(b) for b in self.budgets_bits), f"--budget-bits {list(self.budgets_bits)} must "
                   "be finite numbers of bits")]
        for ok, message in checks:
            if not ok:
                raise PagedWeightError(message)


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


def sample(space_size: int, candidates: int | None, seed: int) -> list[int]:
    """Grid indices to score: all (``candidates`` None), else the first ``candidates`` of one seeded permutation,
    so that a larger sample contains every smaller one of the same seed."""
    order = np.random.default_rng(seed).permutation(space_size)
    return sorted(int(i) for i in order[: space_size if candidates is None else min(candidates, space_size)])


def budget_z(gain_z: float, budgets: int) -> float:
    """The z each of ``budgets`` one-sided tests must pass for the family to hold at ``gain_z`` (Bonferroni: each
    test's tail is the family's tail / budgets)."""
    normal = NormalDist()
    return normal.inv_cdf(1 - (1 - normal.cdf(gain_z)) / budgets)


def shows_gain(neutral_nll: np.ndarray, best_nll: np.ndarray, z: float) -> bool:
    """Whether the winner's per-window NLL [w] is lower than the neutral policy's on the same windows by more than
    ``z`` standard errors of the mean paired difference (one-sided test; False for fewer than 2 windows)."""
    d = np.asarray(neutral_nll, np.float64) - np.asarray(best_nll, np.float64)
    if d.size < 2:
        return False
    se = float(d.std(ddof=1)) / math.sqrt(d.size)
    return bool(d.mean() > z * se) if se > 0 else bool(d.mean() > 0)


def neutral_from(budgets_bits: list[float], gain: list[bool]) -> float | None:
    """The band's start: the smallest budget at which the winner shows no gain (every budget below it shows one);
    None if it shows one at every budget. ``gain[k]``: whether it shows a gain over the neutral policy at budget k.
    The runtime applies the winner below the band and the neutral policy from it on, so a gain confirmed only at
    larger budgets cannot be used without applying the winner where it showed none."""
    for k in np.argsort(budgets_bits, kind="stable"):
        if not gain[k]:
            return float(budgets_bits[k])
    return None


def policy_frame(p: BucketPolicy) -> pd.DataFrame:
    qs = [*p.quantiles, 1.0]
    f1 = p.floors[1] if len(p.floors) > 1 else p.floors[0]
    band = math.nan if p.neutral_from_bits is None else p.neutral_from_bits
    return pd.DataFrame([{"bucket": i, "mass_quantile_hi": qs[i], "mu": p.mu[i], "floor_stage0": p.floors[0][i],
                          "floor_stage1": f1[i], "depth_cap": p.depth_cap[i], "neutral_from_bits": band}
                         for i in range(p.num_buckets)])


def policy_from_frame(df: pd.DataFrame) -> BucketPolicy:
    """The ``BucketPolicy`` stored in a ``buckets`` table."""
    return BucketPolicy.from_frame(df)


@locked_stage
def run_search_buckets(model_dir: Path, artifact_dir: Path, cfg: SearchConfig, device: str = "auto",
                       force: bool = False, progress: Callable[[str, int, int], None] | None = None
                       ) -> dict[str, Any]:
    """The whole stage; returns its manifest entry (``{"skipped": True}`` if already complete). ``progress(label,
    done, total)``: sequences scored in each phase (``PHASES``), from 0 before the phase's first pass."""
    if not begin_stage(artifact_dir, model_dir, "search-buckets", asdict(cfg), force, defaults=RECORDED_BEFORE):
        return {"skipped": True}
    t0 = time.time()
    sens_cfg = recorded_config(artifact_dir, "sensitivity", SensitivityConfig, optional=OPTIONAL_FIELDS)
    # the held-out windows come after the sensitivity samples and the residual heads' default prompts, whether or
    # not (and with whatever --prompts) the heads were fit: the search never uses them, so it does not depend on
    # that optional stage
    res_cfg = ResidualConfig()
    art = APArtifact(artifact_dir, before="search-buckets")
    table = BlockTable.from_frames(art.table("sensitivity"), art.table("routing"))
    bad = [b for b in cfg.budgets_bits if not art.seed_bits <= b <= 8]
    if bad:
        raise PagedWeightError(f"--budget-bits {bad} outside [{art.seed_bits}, 8] (the artifact's bitwidths)")
    tok = load_tokenizer(model_dir)
    dtype = str(scoring_dtype(cfg.dtype, resolve_device(device))).removeprefix("torch.")
    base = load_model(model_dir, device=device, dtype=dtype, experts="skip")  # the artifact's experts are scored
    windows = calibration_windows(tok, sens_cfg.dataset, cfg.heldout_windows + cfg.confirm_windows,
                                  sens_cfg.seq_len, sens_cfg.seed, skip=sens_cfg.samples + res_cfg.prompts,
                                  vocab_size=base.spec.vocab_size,
                                  flags="--heldout-windows / --confirm-windows")
    select_text, confirm = windows[: cfg.heldout_windows], windows[cfg.heldout_windows:]
    space = search_space(art.seed_bits)
    neutral = BucketPolicy.neutral(art.seed_bits)
    candidates = [neutral, *(space[i] for i in sample(len(space), cfg.candidates, cfg.seed))]
    budgets = [table.uniform_bytes(b) for b in cfg.budgets_bits]
    fits = [[fit_budget(table, pol, budget) for budget in budgets] for pol in candidates]
    rounds = min(cfg.rounds, cfg.heldout_windows)  # at least one window per round
    bounds = round_bounds(cfg.heldout_windows, rounds)
    dense = WeightCache(art, base, CACHE_BYTES)  # dequantized blocks, shared by every round and the confirmation

    def scored(label: str, text: list[list[int]], allocations: list[np.ndarray]) -> np.ndarray:
        """Window NLLs [A, W] of ``allocations`` on ``text``, with a progress bar ``label``."""
        tick = None if progress is None else (lambda d, t: progress(label, d, t))
        if tick is not None:
            tick(0, len(allocations) * len(text))  # the bar (and its clock, for the ETA) starts before the first pass
        return score_allocations(art, base, table, allocations, text, progress=tick, weights=dense)

    def select_nll(allocations: list[np.ndarray], lo: int, hi: int) -> np.ndarray:
        r = bounds.index(lo) + 1
        return scored(PHASES["select"].format(r=r, rounds=rounds), select_text[lo:hi], allocations)

    race = select(fits, cfg.heldout_windows, rounds, cfg.keep, select_nll)
    rows = []
    for ci, pol in enumerate(candidates):
        seen = int(race.windows[ci])
        for budget, q in zip(budgets, fits[ci], strict=True):
            ppl = math.inf if q is None else math.exp(float(race.nll[q.tobytes()][:seen].mean()))
            rows.append({"candidate": ci, "setting": pol.to_json(), "split": "select", "budget_bytes": budget,
                         "expert_bytes": -1 if q is None else table.total_bytes(q), "windows": seen, "ppl": ppl,
                         "score": float(race.scores[ci])})
    best = race.best
    if not math.isfinite(race.scores[best]):
        raise PagedWeightError(f"no candidate fits the budgets {list(cfg.budgets_bits)}: raise --budget-bits")
    pairs = [(fits[best][k], fits[0][k]) for k in range(len(budgets))]
    unique = {q.tobytes(): q for pair in pairs for q in pair if q is not None}  # winner = neutral: scored once
    on_confirm = dict(zip(unique, scored(PHASES["confirm"], confirm, list(unique.values())), strict=True))
    gain, gains, z = [], [], budget_z(cfg.gain_z, len(budgets))
    for k, budget in enumerate(budgets):
        q_best, q_neutral = pairs[k]
        assert q_best is not None and q_neutral is not None  # neutral fits whatever the winner fits
        on_best, on_neutral = on_confirm[q_best.tobytes()], on_confirm[q_neutral.tobytes()]
        gain.append(float((on_neutral - on_best).mean()))
        gains.append(shows_gain(on_neutral, on_best, z))
        for ci, q, w in ((best, q_best, on_best), (0, q_neutral, on_neutral)):
            rows.append({"candidate": ci, "setting": candidates[ci].to_json(), "split": "confirm",
                         "budget_bytes": budget, "expert_bytes": table.total_bytes(q), "windows": len(confirm),
                         "ppl": math.exp(float(w.mean())), "score": math.nan})
    chosen = candidates[best]
    if best != 0:
        chosen = replace(chosen, neutral_from_bits=neutral_from(list(cfg.budgets_bits), gains))
    info = {"config": asdict(cfg), "files": ["buckets.parquet", "bucket_search.parquet"],
            "search_space_size": len(space), "candidates_scored": len(candidates),
            "allocations_scored": len(race.nll), "dtype": dtype,
            "candidates_per_round": [int((race.windows >= hi).sum()) for hi in bounds[1:]],
            "allocation_windows_scored": int(sum((~np.isnan(v)).sum() for v in race.nll.values())),
            "budgets_bytes": budgets,
            "best_candidate": best, "best_setting": chosen.to_json(),
            "heldout_dataset": sens_cfg.dataset, "heldout_tokens": len(select_text) * len(select_text[0]),
            "confirm_tokens": len(confirm) * len(confirm[0]),
            "best_ppl_per_budget": [r["ppl"] for r in rows if r["candidate"] == best and r["split"] == "select"],
            "neutral_ppl_per_budget": [r["ppl"] for r in rows if r["candidate"] == 0 and r["split"] == "select"],
            "confirm_gain_pct_per_budget": [100 * (math.exp(g) - 1) for g in gain],
            "confirm_shows_gain_per_budget": gains, "confirm_z_per_budget": z,
            "neutral_from_bits": chosen.neutral_from_bits,
            "seconds": round(time.time() - t0, 2)}
    with committing(artifact_dir, "search-buckets"):
        prov = art.manifest.provenance()
        write_table(pd.DataFrame(rows), artifact_dir / "bucket_search.parquet", "bucket_search", prov)
        write_table(policy_frame(chosen), artifact_dir / "buckets.parquet", "buckets", prov)
        finish_stage(artifact_dir, "search-buckets", info)
    return info
