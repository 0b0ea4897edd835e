"""The whole evaluation: every policy x budget on both suites, into one results table (SPEC section 8).

What it does: for each suite it scores the 16-bit reference, measures the workload's peak KV, derives
the budget grid from static footprints (``U<b>``: uniform b's footprint, for every supported b;
``FP16``: the 16-bit model's; ``min``: the smallest budget the runtime accepts) and runs: uniform b at
``U<b>`` (equal memory by construction; on the long suite only at its grid's ``U<b>``),
``pagedweight`` and ``static`` at every grid budget, and the ablations (and ``residual``) at ``ablation_bits``'
budgets. Rows (and per-request scores) are appended as they finish to ``<out>/results.partial.parquet``,
renamed to ``results.parquet`` at the end; PagedWeight's run at ``trace_budget`` also leaves its
per-step trace (``trace_<suite>.parquet``, for the timeline notebook). ``QUICK`` is a seconds-long
version for tests. Budgets are named, never buried: ``SweepSpec`` holds every choice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pweval.results import append_rows, rename, scores_path
from pweval.retrieval import RetrievalSpec
from pweval.runs import Evaluator, LongSpec, Suite, TextSpec
from pwformat.errors import PagedWeightError
from pwrun.core.policy import ABLATIONS
from pwrun.engine.report import write_frame


@dataclass(frozen=True)
class SweepSpec:
    """``text``/``long``: the suites (``long`` None skips it); ``grid``: budget labels PagedWeight and static run
    at per suite (fractional ``U<b>`` between the bitwidths: where PagedWeight first comes within 1% of 16-bit);
    ``ablation_bits``: the ``U<b>`` budgets of the ablations (text suite); ``oracle``: a measured damage table
    (``tools/oracle_allocation.py``): the static policy ranked by it runs at every text grid budget but ``min``,
    as policy ``oracle``."""

    text: TextSpec = field(default_factory=TextSpec)
    long: LongSpec | None = field(default_factory=LongSpec)
    text_grid: tuple[str, ...] = ("min", "U3", "U3.5", "U4", "U4.25", "U4.5", "U4.75", "U5", "U5.5", "U6", "U7",
                                  "FP16", "U8")
    long_grid: tuple[str, ...] = ("U3", "U4", "U5")
    ablation_bits: tuple[int, ...] = (3, 4, 5)
    uniform_bits: tuple[int, ...] | None = None  # None: every bitwidth of the artifact
    trace_budget: str = "U4"  # PagedWeight's run at this budget also writes trace_<suite>.parquet (notebooks)
    oracle: Path | None = None


QUICK = SweepSpec(
    text=TextSpec(per_dataset=3, prompt_tokens=24, continuation_tokens=6, max_batch=4, max_step_tokens=64),
    long=LongSpec(RetrievalSpec(questions=2, context_tokens=160, candidates=2, answer_tokens=6), meetings=2,
                  per_meeting=1, prompt_tokens=96, continuation_tokens=6, max_batch=4, max_step_tokens=128),
    text_grid=("min", "U3", "U3.5", "U4", "FP16"), long_grid=("U4",), ablation_bits=(4,), uniform_bits=(3, 4, 8))


def is_label(text: str) -> bool:
    """True for budget labels (``min``, ``FP16``, ``U`` followed by a digit: ``U<b>`` with b a bitwidth or a
    fraction between two, such as ``U4.5``; ``budgets`` checks the rest), False for sizes such as ``48MiB``."""
    return text in ("min", "FP16") or (text[:1] == "U" and text[1:2].isdigit())


def _uniform_bits(label: str, bits: list[int]) -> float | None:
    """b of a well-formed ``U<b>`` label (ASCII digits, written as the shortest decimal: U4, U4.5; between two of
    ``bits``), else None."""
    if re.fullmatch(r"U[0-9]+(\.[0-9]+)?", label) is None:
        return None
    b = float(label[1:])
    if label[1:] != f"{b:g}" or math.floor(b) not in bits or math.ceil(b) not in bits:
        return None
    return b


def budgets(ev: Evaluator, suite: Suite, labels: tuple[str, ...]) -> dict[str, int]:
    """Bytes of each budget label (``min``, ``U<b>``, ``FP16``) for ``suite``; ``U<b>`` at a fractional b is the
    linear interpolation between the footprints of its neighbouring bitwidths (``U4.5``: midway between U4 and U5).
    Raises ``PagedWeightError`` for an unknown label. ``U<b>``/``FP16`` use the measured peak KV once
    ``ev.measure_peak_kv(suite)`` has run."""
    bits = ev.artifact.bits
    for label in labels:
        if label not in ("min", "FP16") and _uniform_bits(label, bits) is None:
            raise PagedWeightError(f"unknown budget {label!r}: use a size (48MiB), min, FP16 or U<b> with b in "
                                   f"{bits[0]}..{bits[-1]}, written as U4 or U4.5 (a fraction interpolates)")

    def uniform(b: float) -> int:
        lo, hi = ev.footprint(suite, math.floor(b)).total, ev.footprint(suite, math.ceil(b)).total
        return round(lo + (b - math.floor(b)) * (hi - lo))

    return {label: ev.minimum(suite) if label == "min" else ev.footprint(suite, 16).total if label == "FP16"
            else uniform(float(label[1:])) for label in labels}


def run_sweep(ev: Evaluator, spec: SweepSpec, out_dir: Path,
              on_row: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Run the sweep; returns the results table's path (``out_dir/results.parquet``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    partial, final = out_dir / "results.partial.parquet", out_dir / "results.parquet"
    partial.unlink(missing_ok=True)
    scores_path(partial).unlink(missing_ok=True)

    def emit(row: dict[str, Any]) -> None:
        append_rows(partial, [row], ev.scores(row))
        if on_row is not None:
            on_row(row)

    every = spec.uniform_bits or tuple(ev.artifact.bits)
    suites = [(ev.text_suite(spec.text), spec.text_grid, spec.ablation_bits, every)]
    if spec.long is not None:  # uniform only where the long figure compares it: its own budgets
        suites.append((ev.long_suite(spec.long), spec.long_grid, (),
                       tuple(b for b in every if f"U{b}" in spec.long_grid)))
    for suite, grid, ablation_bits, uniform_bits in suites:
        ev.measure_peak_kv(suite)
        emit(ev.reference(suite))
        for b in uniform_bits:
            emit(ev.run(suite, "uniform", ev.footprint(suite, b).total, f"U{b}", bits=b))
        for label, budget in budgets(ev, suite, grid).items():
            for policy in ("pagedweight", "static"):
                emit(ev.run(suite, policy, budget, label, infeasible_ok=True))
                if policy == "pagedweight" and label == spec.trace_budget and ev.last.trace is not None:
                    write_frame(ev.last.trace, out_dir / f"trace_{suite.name}.parquet")
        if spec.oracle is not None and suite.name == "text":
            for label, budget in budgets(ev, suite, tuple(x for x in grid if x != "min")).items():
                emit(ev.run(suite, "static", budget, label, infeasible_ok=True, damage=spec.oracle, name="oracle"))
        for label, budget in budgets(ev, suite, tuple(f"U{b}" for b in ablation_bits)).items():
            for policy in ABLATIONS:
                emit(ev.run(suite, policy, budget, label, infeasible_ok=True))
    rename(partial, final)
    return final
