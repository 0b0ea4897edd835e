"""``pwcal sensitivity``, ``pwcal fit-residual``, ``pwcal search-buckets``, ``pwcal run-all``: thin wrappers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from pwcal import cli_quant
from pwcal.bucket_search import SearchConfig, run_search_buckets
from pwcal.residual import ResidualConfig, run_fit_residual
from pwcal.sensitivity import SensitivityConfig, run_sensitivity
from pwrun.cli_common import DeviceOpt, ModelArg, make_console, user_errors
from pwrun.progress import progress

console = make_console(stderr=True)
ArtifactsOpt = Annotated[Path, typer.Option(help="Artifact directory made by `pwcal quantize`.")]
ForceOpt = Annotated[bool, typer.Option(help="Redo the stage even if it is complete.")]


class Bars:
    """One progress bar (lines with an ETA when not on a terminal) per stage label."""

    def __init__(self) -> None:
        cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("ETA"), TimeRemainingColumn())
        self.progress = progress(console, *cols)
        self.tasks: dict[str, TaskID] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(stage, total=total)
        self.progress.update(self.tasks[stage], completed=done)


def _report(stage: str, info: dict[str, Any], extra: str = "") -> None:
    if info.get("skipped"):
        console.print(f"{stage}: already complete with these parameters, nothing to do (--force to redo)")
    else:
        console.print(f"{stage}: wrote {', '.join(info['files'])} in {info['seconds']:.1f} s{extra}")


def sensitivity(
    model: ModelArg,
    artifacts: ArtifactsOpt,
    dataset: Annotated[str, typer.Option(help="Calibration text: bundled c4-calib, a local .json/.jsonl/.json.gz/"
                                         ".parquet/.txt file, or allenai/c4 (online, needs `datasets`).")] = "c4-calib",
    samples: Annotated[int, typer.Option(help="Calibration windows.")] = 64,
    seq_len: Annotated[int, typer.Option(help="Tokens per window.")] = 512,
    seed: Annotated[int, typer.Option(help="Seed of the document order (reproducible sampling).")] = 1,
    min_tokens: Annotated[int, typer.Option(help="Experts with fewer routed tokens use the documented "
                                            "fallback importance.")] = 16,
    importance: Annotated[str, typer.Option(help="What weights the AP errors in s_i^b: hessian (diag(X^T X) of the "
                                            "block's inputs; one pass, local) or fisher (squared per-window "
                                            "gradients of the calibration loss, one forward+backward pass per "
                                            "window; also sees the layers downstream; docs/eval/oracle).")
                  ] = "hessian",
    layer_scale: Annotated[bool, typer.Option(help="With the Hessian: scale each MoE layer's sensitivities by the "
                                              "output KL (nats per token) measured with only that layer's experts "
                                              "at the lowest bitwidth, so that layers rank by how far their errors "
                                              "travel (one forward pass per MoE layer and window).")] = True,
    scale_samples: Annotated[int, typer.Option(help="Calibration windows (the first ones; all --samples if "
                                               "fewer) that measure the per-layer scale.")] = 16,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
) -> None:
    """Sensitivity s_i^b (Fisher or Hessian) and bytes M_i^b per block and bitwidth; routing mass (Eq. 1-3)."""
    with user_errors():
        cfg = SensitivityConfig(dataset, samples, seq_len, seed, min_tokens, importance, layer_scale,
                                scale_samples)  # bad values: before bars
        bars = Bars()
        with bars.progress:
            info = run_sensitivity(model, artifacts, cfg, device, force, bars)
        warn = ""
        if info.get("fallback_experts"):
            warn = (f"; warning: {len(info['fallback_experts'])} experts saw fewer than {min_tokens} calibration "
                    f"tokens{' (or got no loss gradient)' if importance == 'fisher' else ''} and use the fallback "
                    "importance")
        _report("sensitivity", info, warn)


def fit_residual(
    model: ModelArg,
    artifacts: ArtifactsOpt,
    prompts: Annotated[int, typer.Option(help="Held-apart calibration prompts (windows after the sensitivity "
                                         "ones).")] = 32,
    heldout_fraction: Annotated[float, typer.Option(help="Share of prompts kept to score the heads (R^2).")] = 0.25,
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
) -> None:
    """Fit the prompt-residual heads (one linear regression per unit and transition, Eq. 5-6)."""
    with user_errors():
        bars = Bars()
        with bars.progress:
            info = run_fit_residual(model, artifacts, ResidualConfig(prompts, heldout_fraction), device, force, bars)
        extra = "" if info.get("skipped") else (
            f"; {info['heads']} heads, held-out R^2 mean {info['mean_r2_heldout']:.3f}, "
            f"{info['heads_r2_positive']} of {info['heads']} above 0")
        _report("fit-residual", info, extra)


def search_buckets(
    model: ModelArg,
    artifacts: ArtifactsOpt,
    budget_bits: Annotated[list[float] | None, typer.Option(help="Memory budgets as uniform-equivalent bits per "
                                                            "expert weight, one per flag (--budget-bits 3.5 "
                                                            "--budget-bits 4; 3.5 = midway between uniform 3 and 4 "
                                                            "bits). Default: 3.5, 4, 4.5, 5 and 6.")] = None,
    candidates: Annotated[int | None, typer.Option(help="Grid settings scored besides the neutral one (a seeded "
                                                        "sample; default: the whole grid of 64: "
                                                        "bucket boundaries x hot multiplier x hot floor x depth "
                                                        "cap).")] = None,
    heldout_windows: Annotated[int, typer.Option(help="Held-out calibration windows the settings are selected "
                                                      "on (each as long as the sensitivity stage's --seq-len, 512 "
                                                      "tokens by default).")] = 12,
    confirm_windows: Annotated[int, typer.Option(help="Later held-out windows on which the winner must beat the "
                                                      "neutral policy to be used at a budget.")] = 24,
    seed: Annotated[int, typer.Option(help="Seed of the candidate sample.")] = 0,
    gain_z: Annotated[float, typer.Option(help="Standard errors by which the winner's gain over the neutral "
                                               "policy on the confirmation windows must exceed 0, for all budgets "
                                               "together (1.645: one-sided 95%; each budget's test then needs "
                                               "the Bonferroni z, 2.33 for five budgets).")] = 1.645,
    rounds: Annotated[int, typer.Option(help="Rounds of successive halving over the held-out windows (cut into "
                                             "this many chunks): after each round but the last only the best "
                                             "--keep of the settings go on; at most --heldout-windows. 1: every "
                                             "setting on every window.")] = 6,
    keep: Annotated[float, typer.Option(help="Fraction of the feasible settings (those that fit every budget) "
                                             "that go on to the next round (rounded up, at least 2; ties go on "
                                             "together).")] = 0.5,
    dtype: Annotated[str, typer.Option(help="Dtype of the scoring passes: auto (bfloat16, the served dtype, on "
                                            "CUDA and on CPUs with AVX512-BF16 or AMX; float32 elsewhere), bfloat16 "
                                            "or float32.")] = "auto",
    device: DeviceOpt = "auto",
    force: ForceOpt = False,
) -> None:
    """Search routing buckets, multipliers mu, floors and depth caps by held-out perplexity under budgets."""
    with user_errors():
        cfg = SearchConfig(tuple(budget_bits or SearchConfig.budgets_bits), candidates, heldout_windows,
                           confirm_windows, seed, gain_z, rounds, keep, dtype)
        bars = Bars()
        with bars.progress:
            info = run_search_buckets(model, artifacts, cfg, device, force, bars)
        if info.get("skipped"):
            extra = ""
        else:
            band = info["neutral_from_bits"]
            lowest = cfg.budgets_bits.index(min(cfg.budgets_bits))
            lines = [f"searched: {info['candidates_scored']} of {info['search_space_size'] + 1} settings in "
                     f"{info['dtype']} ({info['candidates_per_round']} per round), scored by perplexity on held-out "
                     f"{info['heldout_dataset']} text ({info['heldout_tokens']} tokens past the calibration ones) at "
                     f"budgets {list(cfg.budgets_bits)} bits"]
            if info["best_candidate"] == 0:
                neutral = [round(p, 2) for p in info["neutral_ppl_per_budget"]]
                lines.append(f"used: the neutral setting, at every budget (it scored best: {neutral})")
            else:
                lines.append(f"best {[round(p, 2) for p in info['best_ppl_per_budget']]} vs neutral "
                             f"{[round(p, 2) for p in info['neutral_ppl_per_budget']]}; on the next "
                             f"{info['confirm_tokens']} tokens the best changes perplexity by "
                             f"{[round(-g, 2) for g in info['confirm_gain_pct_per_budget']]}% against neutral "
                             f"(a gain confirmed, beyond {info['confirm_z_per_budget']:.2f} standard errors at each "
                             f"budget and {cfg.gain_z} over all: {info['confirm_shows_gain_per_budget']})")
                where = "at every budget" if band is None else f"below {band} bits, the neutral setting from there on"
                if band is not None and not info["confirm_shows_gain_per_budget"][lowest]:
                    where += " (below the lowest budget searched nothing can be confirmed: the tuned buckets stay)"
                lines.append(f"used: the winner ({info['best_setting']}) {where}")
            extra = "".join(f"\n  {line}" for line in lines)
        _report("search-buckets", info, extra)


def run_all(
    model: ModelArg,
    out: Annotated[Path, typer.Option(help="Artifact directory.")],
    device: DeviceOpt = "auto",
    force: Annotated[bool, typer.Option(help="Redo every stage even if complete.")] = False,
    residual_heads: Annotated[bool, typer.Option(
        "--residual-heads/--no-residual-heads",
        help="Also fit the prompt-residual heads (served by --policy residual only; off: on the bundled model they "
             "changed no served perplexity measurably).")] = False,
) -> None:
    """quantize -> sensitivity -> [fit-residual] -> search-buckets with defaults (completed stages are skipped)."""
    cli_quant.quantize(model, out, device=device, force=force)
    sensitivity(model, out, device=device, force=force)
    if residual_heads:
        fit_residual(model, out, device=device, force=force)
    search_buckets(model, out, device=device, force=force)
