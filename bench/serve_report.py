"""Markdown report of ``bench/serve_speed.py``'s rows (issue 8): the results table and PagedWeight's ratios.

``render(meta, rows)`` -> the markdown written next to the JSON; ``ratio_lines`` adds, per batch and repeat,
PagedWeight's decode tokens/s against uniform 4-bit (equal committed bytes, issue #8's target) and against
uniform interpolated to the bits a PagedWeight token reads (equal bytes read), with median and range over
repeats (``--interleave``), and the whole run's served tokens/s against the highest uniform bitwidth (4, else 3)
that serves in PagedWeight's own budget (equal total memory: uniform cannot lower its weights, so it queues or
preempts requests where PagedWeight demotes).
No torch: plain dicts in, text out.
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

# serve_speed's rows of the highest uniform bitwidth that serves in PagedWeight's budget: "uniform {q}-bit" + this
# (a failed row, where not even the lowest tried fits: "uniform" + this)
EQUAL_MEMORY = ", PagedWeight's budget"


def _uniform_ms_at(uni: dict[int, float], bits: float) -> float:
    """Decode step ms of uniform runs {q: ms} at a fractional bits per weight (linear between the nearest two)."""
    qs = sorted(uni)
    if len(qs) < 2 or not qs[0] <= bits <= qs[-1]:
        return math.nan
    hi = next(q for q in qs if q >= bits)
    lo = max(q for q in qs if q <= bits)
    return uni[lo] if hi == lo else uni[lo] + (uni[hi] - uni[lo]) * (bits - lo) / (hi - lo)


def _pct(x: float) -> str:
    """A ratio - 1 as a signed percentage, or "n/a" (nan: no uniform runs at two bitwidths to interpolate)."""
    return "n/a" if math.isnan(x) else f"{100 * x:+.1f}%"


def _spread(v: list[float]) -> str:
    """Median (min .. max) of ratios - 1, as percentages; "n/a" when any is nan."""
    if any(math.isnan(x) for x in v):
        return "n/a"
    return f"{100 * statistics.median(v):+.1f}% ({100 * min(v):+.1f} .. {100 * max(v):+.1f})"


def ratio_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per batch and repeat: PagedWeight's decode tok/s vs uniform 4-bit (equal committed bytes; issue #8's
    target) and vs uniform interpolated to the bits a PagedWeight token reads (equal bytes read)."""
    out = ["", "## PagedWeight vs uniform, per repeat (decode tok/s ratio - 1)", "",
           "| batch | repeat | PW tok/s | uniform 4-bit tok/s | vs uniform 4-bit | bits read / token | "
           "vs uniform at equal bits read | served tok/s, whole run: PW / the highest uniform that fits PW's budget "
           "(ratio - 1) |",
           "|---|---|---|---|---|---|---|---|"]
    summary: dict[int, list[tuple[float, float]]] = {}
    refused = {(r["batch"], r.get("rep", 0)) for r in rows  # no uniform bitwidth tried fits PW's budget
               if r["system"].endswith(EQUAL_MEMORY) and "BudgetTooSmall" in r.get("error", "")}
    rows = [r for r in rows if "error" not in r]  # failed rows have no measurements
    for r in rows:
        if r["system"] != "PagedWeight under pressure":
            continue
        b, rep = r["batch"], r.get("rep", 0)
        uni = {int(u["system"].split()[2].split("-")[0]): u["decode_step_ms_median"] for u in rows
               if u["system"].startswith("ours uniform") and "eager" not in u["system"] and u["batch"] == b
               and u.get("rep", 0) == rep}
        u4 = next((u["decode_tps_measured"] for u in rows if u["system"] == "ours uniform 4-bit"
                   and u["batch"] == b and u.get("rep", 0) == rep), math.nan)
        pw = r.get("decode_tps_measured", math.nan)
        read = r.get("bits_read_per_token", math.nan)
        # tok/s ratio at equal bytes read = uniform step ms at those bits / PagedWeight step ms
        matched = _uniform_ms_at(uni, read) / r.get("decode_step_ms_median", math.nan) - 1
        eq = next((u for u in rows if u["system"].endswith(EQUAL_MEMORY) and u["batch"] == b
                   and u.get("rep", 0) == rep), {})
        # whole-run tokens served per second (prompt and generated tokens once each; queueing and preemption slow
        # it, recomputed prompt chunks do not count) in the same total memory
        run_pw, run_eq = r.get("served_tokens_per_second", math.nan), eq.get("served_tokens_per_second", math.nan)
        summary.setdefault(b, []).append((pw / u4 - 1, matched))
        eq_cell = "n/a" if math.isnan(run_eq) or math.isnan(run_pw) else \
            f"{run_pw:.0f} / {run_eq:.0f} at {eq.get('bits', '?')} bits ({_pct(run_pw / run_eq - 1)})"
        if (b, rep) in refused:
            eq_cell = f"{run_pw:.0f} / uniform does not fit"
        out.append(f"| {b} | {rep} | {pw:.1f} | {u4:.1f} | {_pct(pw / u4 - 1)} | {read:.2f} | {_pct(matched)} | "
                   f"{eq_cell} |")
    if any(len(v) > 1 for v in summary.values()):
        out += ["", "| batch | repeats | vs uniform 4-bit: median (min .. max) | "
                "vs equal bits read: median (min .. max) |", "|---|---|---|---|"]
        for b, v in summary.items():
            out.append(f"| {b} | {len(v)} | {_spread([x for x, _ in v])} | {_spread([y for _, y in v])} |")
    return out if summary else []


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = ["# End-to-end serving speed", "", f"Command: `{meta.get('command', 'python bench/serve_speed.py')}`", "",
             "`" + json.dumps(meta) + "`", "",
             "Decode tok/s leaves out the steps that capture a CUDA graph (one-off per engine and batch size; "
             "the next column keeps them); every timed run follows a 3-token warm-up run of the same prompts "
             "(Triton JIT compilation is not timed, except in the runs listed below the table, if any).", "",
             "| system | batch | prefill tok/s | decode tok/s | incl. capture | floor tok/s | % of floor | "
             "decode step ms (moving / still) | of which model ms | planner ms/step: all steps, decode steps "
             "(+ overlapped) | reloaded GiB (CPU -> GPU) | mean bits | "
             "bits read / token | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fl = r.get("floor_tps")
        dec = r.get("decode_tps_measured", math.nan)
        peak = r.get("device_peak_bytes", r.get("peak_device_bytes", math.nan))
        lines.append(
            f"| {r['system']} | {r['batch']} | {r.get('prefill_tps_measured', math.nan):.0f} | {dec:.1f} | "
            f"{r.get('decode_tps_incl_capture', math.nan):.1f} | "
            f"{fl if fl is None else round(fl, 1)} | {'' if fl is None else round(100 * dec / fl, 1)} | "
            f"{r.get('decode_step_ms_median', math.nan):.2f} ({r.get('decode_step_ms_moving', math.nan):.2f} / "
            f"{r.get('decode_step_ms_still', math.nan):.2f}) | {r.get('decode_model_ms_median', math.nan):.2f} | "
            f"{r.get('planner_ms_per_step', math.nan):.3f}, {r.get('planner_ms_per_decode_step', math.nan):.3f} "
            f"(+{r.get('planner_overlapped_ms_per_step', math.nan):.3f})"
            f" | {r.get('bytes_host_to_device', math.nan) / 2**30:.2f}"
            f" | {r.get('mean_bits_time_avg', math.nan):.2f} | {r.get('bits_read_per_token', math.nan):.2f} | "
            f"{peak / 2**30:.2f} |")
    errors = [f"- {r['system']}, batch {r['batch']} (repeat {r.get('rep', 0)}): {r['error']}" for r in rows
              if "error" in r]
    if errors:
        lines += ["", "Rows that failed (the run went on):", *errors]
    compiled = [f"{r['system']}, batch {r['batch']} (repeat {r.get('rep', 0)}): {r['triton_compiles_in_run']}"
                + (f" ({', '.join(sorted(set(r['triton_kernels_compiled_in_run'])))})"
                   if r.get("triton_kernels_compiled_in_run") else "")
                for r in rows if (r.get("triton_compiles_in_run") or 0) > 0]
    if compiled:  # prefill and capture-step figures of these runs include JIT compilation
        lines += ["", "Kernels Triton compiled inside a timed run (the warm-up missed them): " + "; ".join(compiled)]
        specs = sorted({u for r in rows for u in r.get("triton_specializations_compiled_in_run") or []})
        if specs:  # which specialization: argument classes and constexprs (bench/triton_cache.py::first_uses)
            lines += ["", "Their specializations:", *(f"- `{u}`" for u in specs)]
    return "\n".join(lines + ratio_lines(rows)) + "\n"
