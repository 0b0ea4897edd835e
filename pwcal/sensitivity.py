"""``pwcal sensitivity``: sensitivity s_i^b (SPEC Eq. 2), bytes M_i^b (Eq. 3), routing mass (Eq. 1).

What it does: one calibration pass of the lean model over C4 windows collects, per linear block
i = (layer, expert, unit), the Hessian diagonal h_i of its inputs over the tokens routed to it
(gate_up: the layer input; down: silu(gate) * up; the shared expert: every token) and the token
count, and per expert the routing mass. The importance weighting the AP errors is ``--importance``:

* ``hessian`` (default): with the column errors ``e_i^b[j] = sum_r (W_rj - W^b_rj)^2``, ``s_i^b = h_i . e_i^b``,
  then (``layer_scale``, default) times the layer's c_l = KL_l / S_l: the measured output KL with only that layer's
  experts at the lowest bitwidth over the layer's summed s at it (``pwcal.stats.layer_scale``). The input Hessian
  cannot see how far a layer's error travels; served, the scale moved the bundled model's 1%-of-16-bit point from
  39% to 34% of the 16-bit expert bytes (``docs/eval/oracle/README.md``).
* ``fisher``: F_i [N, K], squared per-window gradients of the calibration loss (``pwcal.stats.fisher``),
  ``s_i^b = sum_rj F_i[r, j] (W_rj - W^b_rj)^2``. It sees how much an error in this layer moves the loss
  downstream, which the input Hessian does not (per unit of Hessian sensitivity, the measured KL differs ~20x
  across the tiny model's 4 layers), and ranks blocks far closer to their measured damage; served under the
  planner it was not consistently better on the tiny model (``docs/eval/oracle/README.md``), so it is not the
  default.

Writes ``sensitivity.parquet``, ``routing.parquet`` and ``block_features.parquet`` (each block's reference
input-norm features, the normaliser of the prompt-residual features; schemas in ``pwformat.tables``) and a
manifest entry.

Fallback (never a silent zero): an expert that saw fewer than ``min_tokens`` tokens gets, as importance,
``max(n, 1) x`` the mean per-token column profile of the well-observed experts of its layer and unit (the
Hessian diagonal, or the Fisher averaged over rows), i.e. typical inputs counted at its (tiny) frequency;
those rows have ``fallback = True``. So does an expert whose importance is all zero (a Fisher from tokens that
were all the last of their window, which has no target).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from pwcal.calib_data import calibration_windows
from pwcal.stages import begin_stage, committing, finish_stage, locked_stage
from pwcal.stats.collect import Tee, observe
from pwcal.stats.features import FEATURES, NormFeatures
from pwcal.stats.fisher import fisher_diagonal
from pwcal.stats.hessian import HessianDiag
from pwcal.stats.layer_scale import layer_kl, layer_scales
from pwcal.stats.routing import RoutingMass
from pwformat.ap import unpack_codes
from pwformat.cost import block_bytes
from pwformat.errors import PagedWeightError
from pwformat.tables import write_table
from pwrun.ap.artifact import APArtifact
from pwrun.model.inventory import LinearBlock, expert_blocks
from pwrun.model.lean import LeanMoEModel
from pwrun.model.loader import load_model, load_tokenizer
from pwrun.model.weights import dense_weight

IMPORTANCE = ("fisher", "hessian")
# what a manifest from before these parameters computed (no per-layer scale, the Hessian)
PRE_DEFAULTS = {"importance": "hessian", "layer_scale": False, "scale_samples": 16}
OPTIONAL_FIELDS = tuple(PRE_DEFAULTS)

Key = tuple[int, int, str]
Importance = dict[Key, tuple[torch.Tensor, int, bool]]  # per block: ([K] or [N, K] float, tokens, fallback)


@dataclass(frozen=True)
class SensitivityConfig:
    """``seed`` orders the calibration documents; windows 0..samples-1 of that order are used. ``importance``:
    one of ``IMPORTANCE`` (module docstring). ``layer_scale`` (Hessian only): scale each MoE layer's
    sensitivities by its measured output KL (``pwcal.stats.layer_scale``) on the first ``scale_samples``
    windows (all ``samples`` if fewer)."""

    dataset: str = "c4-calib"
    samples: int = 64
    seq_len: int = 512
    seed: int = 1
    min_tokens: int = 16
    importance: str = "hessian"
    layer_scale: bool = True
    scale_samples: int = 16

    @property
    def scaled(self) -> bool:
        """Whether the per-layer scale applies (the Fisher already sees the layers downstream)."""
        return self.layer_scale and self.importance == "hessian"

    def record(self) -> dict[str, Any]:
        """The parameters as the manifest records them: those of a scale that does not apply are recorded as
        off, so that they never make a run look different from one that computed the same table."""
        d = asdict(self)
        if not self.scaled:
            d.update(layer_scale=False, scale_samples=PRE_DEFAULTS["scale_samples"])
        return d

    def __post_init__(self) -> None:
        if self.importance not in IMPORTANCE:
            raise PagedWeightError(f"--importance {self.importance!r} is not one of {', '.join(IMPORTANCE)}")
        if self.samples < 1 or self.seq_len < 2:
            raise PagedWeightError(f"--samples {self.samples} must be >= 1 and --seq-len {self.seq_len} >= 2")
        if self.scale_samples < 1:
            raise PagedWeightError(f"--scale-samples {self.scale_samples} must be >= 1")
        if self.min_tokens < 1:
            raise PagedWeightError(f"--min-tokens {self.min_tokens} must be >= 1 (an expert that saw no token has no "
                                   "Hessian)")


def squared_errors(model: LeanMoEModel, art: APArtifact, blocks: list[LinearBlock]
                   ) -> Iterator[tuple[Key, Iterator[torch.Tensor]]]:
    """Per block, lazily per bitwidth of ``art``: (W - W^b)^2 [N, K] float64 on the model's device (the one loop
    over the artifact's planes and LUTs that ``column_errors`` and ``weighted_sensitivities`` reduce)."""
    for layer in sorted({b.layer for b in blocks}):
        t = art.layer_tensors(layer, model.device)
        for b in (x for x in blocks if x.layer == layer):
            w = dense_weight(model, b).double()
            key = art.key(b)
            code8 = unpack_codes(t[f"{key}.planes"], b.k, 8)  # unpack once; code_b = code8 >> (8 - b)
            yield (b.layer, b.expert, b.unit), (
                (w - t[f"{key}.lut{q}"].double().gather(1, code8 >> (8 - q))).pow(2) for q in art.bits)


def column_errors(model: LeanMoEModel, art: APArtifact, blocks: list[LinearBlock]) -> dict[Key, torch.Tensor]:
    """e_i [len(bits), K] float64: per input column, the squared AP error summed over rows, per bitwidth."""
    return {key: torch.stack([d2.sum(0) for d2 in per_bit]) for key, per_bit in squared_errors(model, art, blocks)}


def with_fallback(imp: dict[Key, torch.Tensor], tokens: dict[tuple[int, int], int], blocks: list[LinearBlock],
                  min_tokens: int) -> Importance:
    """(importance, tokens, fallback) per block, with the documented fallback for rare experts.

    ``imp``: per block a Hessian diagonal [K] or a Fisher [N, K] (float, summed over calibration tokens);
    ``tokens[(layer, expert)]``: tokens routed to the expert. Raises ``PagedWeightError`` if a layer and unit
    has no expert with ``min_tokens`` tokens to take the typical profile from.
    """
    def observed(b: LinearBlock) -> bool:
        # an all-zero importance is not an observation: e.g. a Fisher whose expert saw only windows' last tokens
        # (no target, so no gradient) even though they count as routed tokens
        key = (b.layer, b.expert, b.unit)
        return tokens.get((b.layer, b.expert), 0) >= min_tokens and key in imp and bool(imp[key].any())

    typical: dict[tuple[int, str, int], torch.Tensor] = {}
    for layer, unit, k in {(b.layer, b.unit, b.k) for b in blocks}:
        per_token = [_columns(imp[(b.layer, b.expert, b.unit)]) / tokens[(b.layer, b.expert)]
                     for b in blocks if (b.layer, b.unit, b.k) == (layer, unit, k) and observed(b)]
        if per_token:
            typical[(layer, unit, k)] = torch.stack(per_token).mean(0)
    out = {}
    for b in blocks:
        n = tokens.get((b.layer, b.expert), 0)
        key = (b.layer, b.expert, b.unit)
        if observed(b):
            out[key] = (imp[key], n, False)
        else:
            base = typical.get((b.layer, b.unit, b.k))
            if base is None:
                raise PagedWeightError(f"layer {b.layer} has no expert with >= {min_tokens} calibration tokens: "
                                       "use more --samples or a lower --min-tokens")
            out[key] = (base * max(n, 1), n, True)
    return out


def _columns(x: torch.Tensor) -> torch.Tensor:
    """A per-column profile [K]: a Hessian diagonal as it is, a Fisher [N, K] averaged over rows."""
    return x if x.dim() == 1 else x.mean(0)


def block_hessians(hess: HessianDiag, blocks: list[LinearBlock], min_tokens: int) -> Importance:
    """(h_i [K] float64, tokens, fallback) per block (``with_fallback`` of the Hessian diagonals)."""
    return with_fallback(hess.diag, hess.tokens, blocks, min_tokens)


def weighted_sensitivities(model: LeanMoEModel, art: APArtifact, blocks: list[LinearBlock], imp: Importance
                           ) -> dict[Key, list[float]]:
    """s_i^b = sum_rj F_i[r, j] (W_rj - W^b_rj)^2 per block and bitwidth of ``art`` (Eq. 2); an importance of
    shape [K] (a Hessian diagonal, or the fallback) weights every row alike: ``h_i . e_i^b``."""
    out = {}
    for key, per_bit in squared_errors(model, art, blocks):
        f = imp[key][0]
        out[key] = [float((d2 * f.to(d2.device, torch.float64)).sum()) for d2 in per_bit]
    return out


def sensitivity_table(blocks: list[LinearBlock], imp: Importance, sens: dict[Key, list[float]], bits: list[int],
                      seed_bits: int) -> pd.DataFrame:
    """One row per (block, bits): s_i^b (Eq. 2, ``weighted_sensitivities``) and
    M_i^b (Eq. 3), with the block's token count and fallback flag from ``imp``."""
    rows = []
    for b in blocks:
        key = (b.layer, b.expert, b.unit)
        _, n, fb = imp[key]
        for q, sq in zip(bits, sens[key], strict=True):
            rows.append({"layer": b.layer, "expert": b.expert, "unit": b.unit, "bits": q, "sensitivity": sq,
                         "bytes": block_bytes(b.n, b.k, q, seed_bits), "tokens": n, "fallback": fb})
    return pd.DataFrame(rows)


def scale_by_layer(model: LeanMoEModel, art: APArtifact, table: pd.DataFrame, windows: list[list[int]],
                   progress: Callable[[str, int, int], None] | None = None
                   ) -> tuple[pd.DataFrame, dict[int, dict[str, float]]]:
    """``table`` with each MoE layer's sensitivities times c_l = KL_l / S_l (``pwcal.stats.layer_scale``, at the
    artifact's lowest bitwidth), and per layer {"kl", "sensitivity", "scale"} (the manifest's record; dividing by
    "scale" gives the unscaled Hessian table back)."""
    low = min(art.bits)
    kl = layer_kl(model, art, windows, low, progress=progress)
    at_low = table[table.bits == low].groupby("layer").sensitivity.sum()
    c = layer_scales(kl, {int(la): float(v) for la, v in at_low.items()})
    out = table.copy()
    out["sensitivity"] = out.sensitivity * out.layer.map(c)
    return out, {la: {"kl": kl[la], "sensitivity": float(at_low.get(la, 0.0)), "scale": c[la]} for la in kl}


def unscaled(table: pd.DataFrame, info: dict[str, Any]) -> pd.DataFrame:
    """The sensitivity table as the Hessian gave it: ``table`` with the per-layer scale recorded in the stage's
    manifest entry ``info`` divided out (``table`` itself if none was applied)."""
    scales = {int(k): v["scale"] for k, v in (info.get("layer_scale") or {}).items()}
    if not scales:
        return table
    out = table.copy()
    out["sensitivity"] = out.sensitivity / out.layer.map(scales)
    return out


@locked_stage
def run_sensitivity(model_dir: Path, artifact_dir: Path, cfg: SensitivityConfig, device: str = "auto",
                    force: bool = False, progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """The whole stage; returns its manifest entry (``{"skipped": True}`` if already complete)."""
    if not begin_stage(artifact_dir, model_dir, "sensitivity", cfg.record(), force, defaults=PRE_DEFAULTS):
        return {"skipped": True}
    t0 = time.time()
    art = APArtifact(artifact_dir, before="sensitivity")
    tok = load_tokenizer(model_dir)
    # the Fisher differentiates through every layer's experts at once: it loads them; else layer by layer
    model = load_model(model_dir, device=device, dtype="float32",
                       experts="load" if cfg.importance == "fisher" else "stream")
    windows = calibration_windows(tok, cfg.dataset, cfg.samples, cfg.seq_len, cfg.seed,
                                  vocab_size=model.spec.vocab_size)
    blocks = expert_blocks(model.spec)
    moe = next(layer.moe for layer in model.spec.layers if layer.moe is not None)
    assert moe is not None
    hess, mass, feats = HessianDiag(), RoutingMass(model.spec.num_layers, moe.num_experts), NormFeatures()
    observe(model, windows, Tee(hess, mass, feats), progress=progress)
    imp = block_hessians(hess, blocks, cfg.min_tokens)  # also refuses too few tokens before the Fisher pass
    if cfg.importance == "fisher":
        imp = with_fallback(fisher_diagonal(model, windows, blocks, progress=progress), hess.tokens, blocks,
                            cfg.min_tokens)
    table = sensitivity_table(blocks, imp, weighted_sensitivities(model, art, blocks, imp), art.bits, art.seed_bits)
    scales: dict[int, dict[str, float]] = {}
    if cfg.scaled:
        table, scales = scale_by_layer(model, art, table, windows[: cfg.scale_samples], progress)
    prov = art.manifest.provenance()
    m = mass.mass()
    routing = pd.DataFrame([{"layer": layer, "expert": e, "mass": float(m[layer, e]),
                             "tokens": int(mass.tokens[layer, e])}
                            for layer in model.spec.moe_layers for e in range(moe.num_experts)])
    phi = feats.features()
    features = pd.DataFrame([{"layer": k[0], "expert": k[1], "unit": k[2], **dict(zip(FEATURES, v, strict=True))}
                             for k, v in sorted(phi.items())])
    fallback = sorted({(b[0], b[1]) for b, v in imp.items() if v[2]})
    info = {"config": cfg.record(), "files": ["sensitivity.parquet", "routing.parquet", "block_features.parquet"],
            "calibration_tokens": len(windows) * cfg.seq_len, "layer_scale": {str(k): v for k, v in scales.items()},
            "layer_scale_windows": min(cfg.scale_samples, len(windows)) if cfg.scaled else 0,
            "fallback_experts": [list(x) for x in fallback],
            "seconds": round(time.time() - t0, 2)}
    with committing(artifact_dir, "sensitivity"):
        write_table(table, artifact_dir / "sensitivity.parquet", "sensitivity", prov)
        write_table(routing, artifact_dir / "routing.parquet", "routing", prov)
        write_table(features, artifact_dir / "block_features.parquet", "block_features", prov)
        finish_stage(artifact_dir, "sensitivity", info)
    return info
