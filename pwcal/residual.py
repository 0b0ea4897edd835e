"""``pwcal fit-residual``: prompt-residual heads (SPEC Eq. 4-6), one linear head per (unit, transition).

What it does: on calibration prompts held apart from the sensitivity windows (the next windows
of the same seeded document order), runs each prompt alone through the lean model and records,
for every block i = (layer, expert, unit) the prompt routes tokens to: the prompt's Hessian
diagonal h_i(p), its routed-token count n_i(p) and its input-norm features. Then, for every
transition b -> b' (b > b'):

* prompt damage per routed token:  g_i(p) = max(h_i(p) . (e_i^{b'} - e_i^b), 0) / n_i(p)
* global damage per routed token:  g_i    = max(s_i^{b'} - s_i^b, 0) / n_i            (Eq. 4 / tokens), with
  the Hessian-diagonal s_i^b on the sensitivity windows (recomputed if that stage used the Fisher)
* **target**:  rho = log(g_i(p) / g_i)  -- how much more (rho > 0) or less this prompt is hurt
  than the calibration average, per routed token (routing frequency is the planner's online
  statistics' business, not the residual's).
* **features** phi: log of the prompt's (routing-weighted mean, routing-weighted RMS, max) input
  norm over the same quantities on the sensitivity calibration set (``block_features.parquet``),
  so one head serves all layers.

A scikit-learn ``LinearRegression`` per (unit, b, b') is fit on 75% of the prompts; its R^2 on
the other 25% is the confidence c = clip(R^2, 0, 1) of Eq. 6 and [rho_min, rho_max] are the 1st
and 99th percentiles of the training targets. Rows with zero damage (no log) and experts with
the sensitivity fallback are left out. Writes ``residual_heads.parquet``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pwcal.calib_data import calibration_windows
from pwcal.sensitivity import (
    OPTIONAL_FIELDS,
    SensitivityConfig,
    block_hessians,
    column_errors,
    sensitivity_table,
    unscaled,
    weighted_sensitivities,
)
from pwcal.stages import begin_stage, committing, finish_stage, locked_stage, recorded_config
from pwcal.stats.collect import Tee, observe
from pwcal.stats.features import FEATURES, NormFeatures
from pwcal.stats.hessian import HessianDiag
from pwformat.errors import PagedWeightError
from pwformat.tables import write_table
from pwrun.ap.artifact import APArtifact
from pwrun.model.inventory import expert_blocks
from pwrun.model.lean import LeanMoEModel
from pwrun.model.loader import load_model, load_tokenizer


@dataclass(frozen=True)
class ResidualConfig:
    prompts: int = 32
    heldout_fraction: float = 0.25
    min_prompt_tokens: int = 4

    def __post_init__(self) -> None:
        if self.prompts < 2 or not 0 < self.heldout_fraction < 1:
            raise PagedWeightError("--prompts must be >= 2 and --heldout-fraction in (0, 1)")


def prompt_rows(errors: dict, sens: pd.DataFrame, ref: pd.DataFrame, per_prompt: list[tuple[HessianDiag,
                NormFeatures]], bits: list[int], min_prompt_tokens: int) -> pd.DataFrame:
    """One row per (prompt, block, transition) with features f0..f2 and target rho (see module doc)."""
    nb = len(bits)
    s_glob: dict[tuple, np.ndarray] = {}
    for key, g in sens.sort_values("bits").groupby(["layer", "expert", "unit"]):
        s_glob[key] = g.sensitivity.to_numpy()
    meta = {k: (int(n), bool(f)) for k, n, f in zip(
        zip(sens.layer, sens.expert, sens.unit, strict=True), sens.tokens, sens.fallback, strict=True)}
    refs = {(la, e, u): np.array(v) for la, e, u, *v in ref[["layer", "expert", "unit", *FEATURES]].itertuples(
        index=False)}
    lo, hi = np.triu_indices(nb, k=1)  # every transition bits[hi] -> bits[lo], lo < hi
    out: dict[str, list] = {k: [] for k in ("prompt", "layer", "expert", "unit", "bits_from", "bits_to", "f0", "f1",
                                            "f2", "rho")}
    for p, (hess, feats) in enumerate(per_prompt):
        phi = feats.features()
        for key, e in errors.items():
            layer, expert, unit = key
            n_p = hess.tokens.get((layer, expert), 0)
            n, fallback = meta[key]
            if n_p < min_prompt_tokens or key not in phi or fallback or n == 0:
                continue
            x = np.log(phi[key] / refs[key])
            s_p = (e @ hess.diag[key].to(e.device)).cpu().numpy()
            g_p = np.maximum(s_p[lo] - s_p[hi], 0.0) / n_p
            g = np.maximum(s_glob[key][lo] - s_glob[key][hi], 0.0) / n
            ok = (g_p > 0) & (g > 0)
            k = int(ok.sum())
            out["prompt"] += [p] * k
            out["layer"] += [layer] * k
            out["expert"] += [expert] * k
            out["unit"] += [unit] * k
            out["bits_from"] += [bits[i] for i in hi[ok]]
            out["bits_to"] += [bits[i] for i in lo[ok]]
            for j in range(3):
                out[f"f{j}"] += [x[j]] * k
            out["rho"] += np.log(g_p[ok] / g[ok]).tolist()
    return pd.DataFrame(out)


def hessian_reference(model: LeanMoEModel, art: APArtifact, tok: Any, sens_cfg: SensitivityConfig, sens: pd.DataFrame,
                      progress: Callable[[str, int, int], None] | None = None) -> pd.DataFrame:
    """The sensitivity table with the Hessian-diagonal importance on the sensitivity stage's windows: ``sens``
    itself if that stage used it (without its per-layer scale), else recomputed (one calibration pass). The
    residual compares a prompt's Hessian damage with this calibration average, so its target is the prompt's
    deviation whatever importance the global damage g uses (with the Fisher or the layer scale, g also carries
    the downstream effect the prompt's inputs do not)."""
    if sens_cfg.importance == "hessian":
        return unscaled(sens, art.manifest.stage("sensitivity"))
    windows = calibration_windows(tok, sens_cfg.dataset, sens_cfg.samples, sens_cfg.seq_len, sens_cfg.seed)
    hess = HessianDiag()
    observe(model, windows, hess, progress=progress, label="hessian reference")
    blocks = expert_blocks(model.spec)
    imp = block_hessians(hess, blocks, sens_cfg.min_tokens)
    return sensitivity_table(blocks, imp, weighted_sensitivities(model, art, blocks, imp), art.bits, art.seed_bits)


def fit_heads(rows: pd.DataFrame, prompts: int, heldout_fraction: float) -> pd.DataFrame:
    """One LinearRegression head per (unit, bits_from, bits_to), scored on held-out prompts."""
    from sklearn.linear_model import LinearRegression  # here: scikit-learn is ~0.9 s of every pwcal command's start-up
    from sklearn.metrics import r2_score

    n_held = max(1, round(prompts * heldout_fraction))
    held = rows.prompt >= prompts - n_held
    heads = []
    for (unit, b, b2), g in rows.groupby(["unit", "bits_from", "bits_to"]):
        tr, te = g[~held.loc[g.index]], g[held.loc[g.index]]
        if len(tr) < 8 or len(te) < 2:
            continue
        x_tr, x_te = tr[["f0", "f1", "f2"]].to_numpy(), te[["f0", "f1", "f2"]].to_numpy()
        reg = LinearRegression().fit(x_tr, tr.rho.to_numpy())
        r2 = float(r2_score(te.rho.to_numpy(), reg.predict(x_te)))
        lo, hi = np.percentile(tr.rho.to_numpy(), [1, 99])
        heads.append({"unit": unit, "bits_from": int(b), "bits_to": int(b2), "w_mean_norm": float(reg.coef_[0]),
                      "w_rms_norm": float(reg.coef_[1]), "w_max_norm": float(reg.coef_[2]),
                      "intercept": float(reg.intercept_), "r2_heldout": r2, "confidence": float(np.clip(r2, 0, 1)),
                      "rho_min": float(lo), "rho_max": float(hi), "n_train": len(tr), "n_heldout": len(te)})
    return pd.DataFrame(heads)


@locked_stage
def run_fit_residual(model_dir: Path, artifact_dir: Path, cfg: ResidualConfig, device: str = "auto",
                     force: bool = False, progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """The whole stage; returns its manifest entry (``{"skipped": True}`` if already complete)."""
    if not begin_stage(artifact_dir, model_dir, "fit-residual", asdict(cfg), force):
        return {"skipped": True}
    t0 = time.time()
    sens_cfg = recorded_config(artifact_dir, "sensitivity", SensitivityConfig, optional=OPTIONAL_FIELDS)
    art = APArtifact(artifact_dir, before="fit-residual")
    sens, ref = art.table("sensitivity"), art.table("block_features")
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, device=device, dtype="float32", experts="stream")  # experts layer by layer
    windows = calibration_windows(tok, sens_cfg.dataset, cfg.prompts, sens_cfg.seq_len, sens_cfg.seed,
                                  skip=sens_cfg.samples, flags="--prompts", vocab_size=model.spec.vocab_size)
    per_prompt = []
    for i, w in enumerate(windows):
        hess, feats = HessianDiag(), NormFeatures()
        observe(model, [w], Tee(hess, feats))
        per_prompt.append((hess, feats))
        if progress:
            progress("prompts", i + 1, len(windows))
    errors = column_errors(model, art, expert_blocks(model.spec))
    rows = prompt_rows(errors, hessian_reference(model, art, tok, sens_cfg, sens, progress), ref, per_prompt,
                       art.bits, cfg.min_prompt_tokens)
    heads = fit_heads(rows, cfg.prompts, cfg.heldout_fraction)
    if heads.empty:
        raise PagedWeightError("no residual head could be fit: use more --prompts (and a --heldout-fraction in "
                               "(0, 1))")
    info = {"config": asdict(cfg), "files": ["residual_heads.parquet"], "rows": len(rows), "heads": len(heads),
            "mean_r2_heldout": float(heads.r2_heldout.mean()), "heads_r2_positive": int((heads.r2_heldout > 0).sum()),
            "seconds": round(time.time() - t0, 2)}
    with committing(artifact_dir, "fit-residual"):
        write_table(heads, artifact_dir / "residual_heads.parquet", "residual_heads", art.manifest.provenance())
        finish_stage(artifact_dir, "fit-residual", info)
    return info
