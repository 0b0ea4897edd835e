"""The run summary (``RunSummary``: what ``pwrun generate`` prints and ``--summary-json`` writes) and the trace file.

What it does: ``summarize`` turns an engine's totals and trace into one flat, typed summary: memory split
between expert weights and KV over time (min / mean / max bytes), the expert share of their 16-bit bytes,
the committed-bitwidth histogram at the end and the time-averaged mean bitwidth, demoted and promoted
blocks, bytes moved host -> device (nothing moves back: the host mirror keeps every plane), preemptions
and the tokens they made the engine compute again (counted in the prefill tokens, so tokens/s is tokens
computed per second, not served), tokens/s, planner time per step and, on CUDA, the peak device memory
against the budget, and the serving times of the requests (``pwrun.core.latency``: TTFT, TPOT and queueing
time at p50 / p99, goodput under the SLOs given, the offered request rate). ``format_summary`` renders it for
the terminal; ``write_trace`` writes the trace as
Parquet (``trace.trace_schema``; zstd, atomic) for the notebooks.
"""

from __future__ import annotations

import math
import os
import resource
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from pwformat.atomic import atomic_path
from pwformat.errors import PagedWeightError
from pwrun.core.latency import SLO, LatencyStats, latency_stats
from pwrun.engine.budget import format_budget, format_size
from pwrun.engine.llm_engine import LLMEngine
from pwrun.engine.trace import trace_table
from pwrun.runner.experts.dense import DenseExpertStore


@dataclass
class RunSummary:
    """A finished run (bytes, seconds, tokens/s). Build fields come from ``build_engine``'s info; ``*_min/mean/max``
    are over steps, means weighted by step time; ``expert_share_16bit``: mean expert bytes / their 16-bit bytes;
    ``weight_bytes_decode_mean``: expert bytes in force during the decode tokens, weighted by decode tokens per step
    (in a teacher-forced evaluation nearly all scored tokens: each continuation's first is scored on its prompt's
    last chunk; they run late, at the largest KV cache; None: no decode);
    ``mean_bits``: time-averaged mean committed bits; ``final_bits_hist``: blocks by committed bits at the end;
    ``warm_up_seconds`` / ``graphs_captured_at_start``: the start-up warm-up (CUDA); ``startup_seconds``: seconds
    of each phase of the engine's build (``build_engine``, ``assemble_engine``; None for the 16-bit engine), after
    ``before_build``: the process's age when the build began (``process_age_seconds``; Linux);
    ``graph_captures_in_run``:
    steps that captured a CUDA graph (0 after a complete warm-up); ``host_peak_rss_bytes``: the process's peak
    resident host memory so far (``peak_rss_bytes``), ``host_mirror_bytes``: the host mirror's planes and LUTs,
    ``host_model_bytes``: what ``pwformat.cost.HostMemory.serve`` predicts above the interpreter's baseline.
    Serving times (``pwrun.core.latency.LatencyStats``; seconds from the start of the run, after the warm-up):
    ``request_rate``: the offered rate in requests/s (None: every request at t=0), ``realised_rate``: (n - 1) / the
    span of the arrival times drawn; ``ttft_*_s`` arrival -> first
    token, ``tpot_*_ms`` per output token after the first, ``queue_*_s`` arrival -> first scheduled (p50 / p99;
    None without a sample); ``duration_s``: start -> last finish; ``goodput_rps``: requests that met
    ``slo_ttft_ms`` / ``slo_tpot_ms`` (all completed ones without SLOs) per second of ``duration_s``;
    ``requests_unfinished``: requests a stop (Ctrl-C, SIGTERM) left not run to completion (None: not stopped).
    Busy and wall time: ``seconds`` sums the steps' time, and ``tokens_per_second`` / ``decode_tokens_per_second``
    divide by it (busy); ``wall_seconds``: the start of the run to the end of its last step, idle waits for
    arrivals included, and ``wall_tokens_per_second``: (prefill + decode) tokens per second of it."""

    device: str
    dtype: str
    policy: str
    bits: int | None
    gpu_memory: int
    fixed_bytes: int
    workspace_bytes: int
    pool_bytes: int
    page_bytes: int
    kv_block_bytes: int
    expert_bytes_16bit: int
    initial_expert_bytes: int
    initial_weight_pages: int
    initial_mean_bits: float
    floor_expert_bytes: int
    shared_expert: bool
    steps: int
    seconds: float
    prefill_tokens: int
    decode_tokens: int
    tokens_per_second: float
    decode_tokens_per_second: float
    demoted_blocks: int
    promoted_blocks: int
    bytes_host_to_device: int
    preemptions: int
    recomputed_tokens: int
    planner_ms_per_step: float
    planner_overlapped_ms_per_step: float
    planner_share_of_step: float
    final_mean_bits: float
    final_bits_hist: dict[int, int]
    pool_pages: int
    pool_peak_pages: int
    mean_bits: float
    weight_bytes_min: int | None = None
    weight_bytes_mean: float | None = None
    weight_bytes_max: int | None = None
    weight_bytes_decode_mean: float | None = None
    kv_bytes_min: int | None = None
    kv_bytes_mean: float | None = None
    kv_bytes_max: int | None = None
    expert_share_16bit: float | None = None
    planner_plans_prepared: int | None = None
    planner_plans_fresh: int | None = None
    device_peak_bytes: int | None = None
    warm_up_seconds: float | None = None
    startup_seconds: dict[str, float] | None = None
    graphs_captured_at_start: int | None = None
    graph_captures_in_run: int | None = None
    host_peak_rss_bytes: int | None = None
    host_mirror_bytes: int | None = None
    host_model_bytes: int | None = None
    request_rate: float | None = None
    realised_rate: float | None = None
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    queue_p50_s: float | None = None
    queue_p99_s: float | None = None
    requests_completed: int | None = None
    requests_met_slo: int | None = None
    requests_unfinished: int | None = None
    wall_seconds: float | None = None
    wall_tokens_per_second: float | None = None
    duration_s: float | None = None
    goodput_rps: float | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    trace_error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON-ready dict (fields that do not apply are left out)."""
        d = asdict(self)
        extra = d.pop("extra")
        return {**{k: v for k, v in d.items() if v is not None or k == "bits"}, **extra}


_ARROW = {"str": pa.string(), "int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(),
          "dict[int, int]": pa.map_(pa.int64(), pa.int64()), "dict[str, float]": pa.map_(pa.string(), pa.float64())}


def summary_schema() -> pa.Schema:
    """The Arrow schema of a table of run summaries: one column per ``RunSummary`` field (nullable where the field
    may not apply), except the free-form ``extra``."""
    return pa.schema([(f.name, _ARROW[str(f.type).removesuffix(" | None")]) for f in fields(RunSummary)
                      if f.name != "extra"])


def summary_table(summaries: list[RunSummary]) -> pa.Table:
    """``summaries`` as an Arrow table of ``summary_schema`` (one row each)."""
    schema = summary_schema()
    cols = {n: [list(getattr(s, n).items()) if isinstance(getattr(s, n), dict) else getattr(s, n) for s in summaries]
            for n in schema.names}
    return pa.table(cols, schema=schema)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, bytes (``VmHWM`` of /proc/self/status; elsewhere
    ``getrusage``'s ``ru_maxrss``, KiB on Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def process_age_seconds() -> float | None:
    """Seconds since this process started (Linux: its start time in /proc/self/stat against /proc/uptime, 10 ms
    steps; None elsewhere): the interpreter's start, imports and everything before a phase that is timed."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, counted after the command name
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def latency_fields(engine: LLMEngine, slo: SLO | None = None) -> dict[str, Any]:
    """The serving-time fields of ``RunSummary`` for ``engine``'s requests (NaN statistics as None)."""
    stats = latency_stats(list(engine.times.values()), slo)
    slo = slo or SLO()
    out = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(stats).items()}
    arrived = sorted(t.arrival for t in engine.times.values())
    span = arrived[-1] - arrived[0] if len(arrived) > 1 else 0.0
    return {**out, "request_rate": None if math.isinf(engine.request_rate) else engine.request_rate,
            "realised_rate": (len(arrived) - 1) / span if span > 0 and not math.isinf(engine.request_rate) else None,
            "slo_ttft_ms": slo.ttft_ms, "slo_tpot_ms": slo.tpot_ms}


def wall_fields(engine: LLMEngine) -> dict[str, float]:
    """``wall_seconds`` (the start of the run to the end of its last step, the trace's last ``t_s``, or of a stopped
    run to the stop) and the tokens computed per second of it; nothing before the first step."""
    if not engine.trace and engine.stopped_s is None:
        return {}
    wall = engine.stopped_s if engine.stopped_s is not None else engine.trace[-1].t_s
    tokens = engine.core.prefill_tokens + engine.core.decode_tokens
    return {"wall_seconds": wall, "wall_tokens_per_second": tokens / wall if wall > 0 else 0.0}


def summarize(engine: LLMEngine, slo: SLO | None = None) -> RunSummary:
    """The summary of a finished run of ``engine`` (see ``RunSummary``); ``slo``: what goodput counts."""
    core = engine.core
    tr = engine.trace
    pool = core.pool
    pb = pool.cfg.page_bytes
    w = core.weights
    q = np.zeros(0, np.int64) if core.wpt is None else core.wpt.q
    info = dict(engine.info)
    known = {k: info.pop(k) for k in list(info) if k in RunSummary.__dataclass_fields__}
    steps = core.steps
    secs = max(engine.seconds, 1e-9)
    hist = np.bincount(q, minlength=9)
    final_hist = {int(b): int(hist[b]) for b in range(9) if hist[b]}
    if isinstance(engine.runner.experts, DenseExpertStore):  # 16-bit experts in the pool
        final_hist = {16: len(engine.runner.experts.runs)}
    final_bits = float(q.mean()) if q.size else 16.0
    over: dict[str, Any] = {}
    mean_bits = final_bits
    if tr:
        wt = np.array([r.seconds for r in tr])
        weights = np.array([r.committed_weight_bytes for r in tr])
        kv = np.array([r.kv_pages for r in tr]) * pb
        mean_bits = float(np.average([r.mean_bits for r in tr], weights=wt))
        # in force during a step ~ what the previous step committed: the weight policy runs after the forward, but
        # demotions to make room for the step's KV (before it) and reloads committed at its start are missed
        # (measured on the evaluation's text suite: within 0.04 points of the expert share)
        in_force = np.concatenate([weights[:1], weights[:-1]])
        decode = np.array([r.step_tokens - r.prefill_tokens for r in tr], float)
        over = {"weight_bytes_min": int(weights.min()), "weight_bytes_mean": float(np.average(weights, weights=wt)),
                "weight_bytes_max": int(weights.max()),
                "weight_bytes_decode_mean": float(np.average(in_force, weights=decode)) if decode.sum() else None,
                "kv_bytes_min": int(kv.min()),
                "kv_bytes_mean": float(np.average(kv, weights=wt)), "kv_bytes_max": int(kv.max())}
        over["graph_captures_in_run"] = sum(r.graph_captured for r in tr)
        if known.get("expert_bytes_16bit"):
            over["expert_share_16bit"] = over["weight_bytes_mean"] / known["expert_bytes_16bit"]
    planner_s = 0.0 if w is None else w.planner_seconds
    if core.planner is not None:  # demotion plans taken ready-made vs made on the step's critical path
        over.update({f"planner_plans_{k}": v for k, v in core.planner.takes.items()})
    if engine.runner.device.type == "cuda":
        over["device_peak_bytes"] = engine.runner.peak_bytes()
    store = engine.runner.experts
    over["host_peak_rss_bytes"] = peak_rss_bytes()
    over |= latency_fields(engine, slo)
    over |= wall_fields(engine)
    return RunSummary(
        **known, steps=steps, seconds=engine.seconds, prefill_tokens=core.prefill_tokens,
        decode_tokens=core.decode_tokens, tokens_per_second=(core.prefill_tokens + core.decode_tokens) / secs,
        decode_tokens_per_second=core.decode_tokens / secs,
        demoted_blocks=0 if w is None else w.demoted_blocks, promoted_blocks=0 if w is None else w.promoted_blocks,
        bytes_host_to_device=0 if store is None else int(store.bytes_h2d), preemptions=core.scheduler.preemptions,
        recomputed_tokens=core.scheduler.recomputed_tokens, planner_ms_per_step=1e3 * planner_s / max(steps, 1),
        planner_overlapped_ms_per_step=1e3 * (0.0 if w is None else w.planner_overlapped_seconds) / max(steps, 1),
        planner_share_of_step=planner_s / secs, final_mean_bits=final_bits,
        final_bits_hist=final_hist, pool_pages=pool.cfg.num_pages,
        pool_peak_pages=pool.peak_used, mean_bits=mean_bits, extra=info, **over)


def _num(x: float, unit: str) -> str:
    """``x`` to 3 significant digits (whole numbers from 1000 on), or n/a for NaN."""
    if math.isnan(x):
        return "n/a"
    return f"{x:.0f} {unit}" if abs(x) >= 1000 else f"{x:.3g} {unit}"


def format_latency(stats: LatencyStats, rate: float | None, slo: SLO | None = None,
                   realised: float | None = None, unfinished: int | None = None) -> str:
    """Two terminal lines: the arrivals (offered ``rate``, requests/s; None or inf: all at t=0; ``realised``: the
    rate of the arrival times drawn, (n - 1) / their span, which a short Poisson run can put far from the offered
    one) with TTFT, TPOT and queueing time at p50 / p99, then goodput under ``slo`` (and the ``unfinished``
    requests a stop left, which it does not count)."""
    slo = slo or SLO()
    drawn = f" ({realised:.3g} realised)" if realised is not None else ""
    arrivals = ("all requests at t=0" if rate is None or math.isinf(rate)
                else f"arrivals at {rate:.3g} requests/s offered{drawn}")
    goals = [f"TTFT <= {slo.ttft_ms:g} ms" if slo.ttft_ms is not None else "",
             f"TPOT <= {slo.tpot_ms:g} ms" if slo.tpot_ms is not None else ""]
    span = f"in the {stats.duration_s:.2f} s from the start to the last finish"
    met = (f"{stats.requests_met_slo} of {stats.requests_completed} completed requests met "
           + " and ".join(g for g in goals if g) if any(goals) else f"{stats.requests_completed} requests completed")
    return (f"{arrivals}: TTFT p50 {_num(stats.ttft_p50_s, 's')}, p99 {_num(stats.ttft_p99_s, 's')}; TPOT p50 "
            f"{_num(stats.tpot_p50_ms, 'ms')}, p99 {_num(stats.tpot_p99_ms, 'ms')}; queueing p50 "
            f"{_num(stats.queue_p50_s, 's')}, p99 {_num(stats.queue_p99_s, 's')}\n"
            f"goodput {stats.goodput_rps:.3g} requests/s: {met} {span}"
            + (f"; {unfinished} more not run to completion (stopped)" if unfinished else ""))


def _stats_of(s: RunSummary) -> LatencyStats:
    def f(x: float | None) -> float:
        return math.nan if x is None else x

    return LatencyStats(f(s.ttft_p50_s), f(s.ttft_p99_s), f(s.tpot_p50_ms), f(s.tpot_p99_ms), f(s.queue_p50_s),
                        f(s.queue_p99_s), s.requests_completed or 0, s.requests_met_slo or 0, f(s.duration_s),
                        f(s.goodput_rps))


def _wall(wall_seconds: float | None) -> str:
    """`` (X s wall, idle waits included)`` for a run's ``wall_seconds``, or nothing without it."""
    return "" if wall_seconds is None else f" ({wall_seconds:.2f} s wall, idle waits for arrivals included)"


def format_summary(s: RunSummary) -> str:
    """A few terminal lines from a ``RunSummary``."""
    wide = s.policy == "16-bit" and s.dtype == "float32"  # the checkpoint's experts at float32 on the CPU
    lines = [
        f"policy {s.policy}{' ' + str(s.bits) + ' bits' if s.bits else ''} on {s.device} "
        f"({s.dtype}{': experts held at 32 bits; --dtype bfloat16 holds them at 16' if wide else ''}); "
        f"{format_budget(s.gpu_memory, s.dtype, s.fixed_bytes, s.workspace_bytes, s.pool_bytes)}"
        + (" (no --gpu-memory: what this run needs)" if s.extra.get("budget_fitted") else ""),
    ]
    if s.weight_bytes_mean is not None and s.expert_share_16bit is not None:
        lines.append(
            f"experts in force {format_size(s.weight_bytes_min or 0)} .. {format_size(s.weight_bytes_max or 0)} (mean "
            f"{format_size(s.weight_bytes_mean)} = {100 * s.expert_share_16bit:.1f}% of "
            f"their 16-bit {format_size(s.expert_bytes_16bit)}); KV {format_size(s.kv_bytes_min or 0)} .. "
            f"{format_size(s.kv_bytes_max or 0)} (mean {format_size(s.kv_bytes_mean or 0)})")
        if s.policy != "16-bit" and s.expert_share_16bit > 1:
            lines.append("  (above their 16-bit bytes: on short rows each row's lookup table of 2^bits 16-bit values "
                         "outweighs its planes at high bits; here --policy 16-bit would hold the experts in less)")
    hist = " ".join(f"{b}b:{n}" for b, n in s.final_bits_hist.items())
    lines += [
        f"committed bits at the end: {hist} (mean {s.final_mean_bits:.2f}; time-averaged {s.mean_bits:.2f})",
        f"{s.demoted_blocks} demoted blocks, {s.promoted_blocks} promoted blocks, "
        f"{format_size(s.bytes_host_to_device)} host->device, {s.preemptions} preemptions",
        f"{s.steps} steps in {s.seconds:.2f} s busy{_wall(s.wall_seconds)}: {s.prefill_tokens} prefill "
        + (f"({s.recomputed_tokens} of them recomputed after preemptions) " if s.recomputed_tokens else "")
        + f"+ {s.decode_tokens} decode tokens = {s.tokens_per_second:.1f} tokens/s busy"
        + (f", {s.wall_tokens_per_second:.1f} tokens/s wall" if s.wall_tokens_per_second is not None else "")
        + "; planner "
        f"{s.planner_ms_per_step:.2f} ms/step ({100 * s.planner_share_of_step:.2f}% of step time; "
        f"+{s.planner_overlapped_ms_per_step:.2f} ms/step while the device computed)",
    ]
    if s.requests_completed is not None:
        lines.append(format_latency(_stats_of(s), s.request_rate, SLO(s.slo_ttft_ms, s.slo_tpot_ms),
                                    s.realised_rate, s.requests_unfinished))
    if s.host_peak_rss_bytes is not None:
        lines.append(f"peak host RSS {format_size(s.host_peak_rss_bytes)}"
                     + (f" (host mirror {format_size(s.host_mirror_bytes)})" if s.host_mirror_bytes is not None
                        else ""))
    if s.device_peak_bytes is not None:
        lines.append(f"peak device memory {format_size(s.device_peak_bytes)} of the "
                     f"{format_size(s.gpu_memory)} budget")
    return "\n".join(lines)


def write_frame(df: pd.DataFrame, path: Path, what: str = "") -> None:
    """Any DataFrame as Parquet (zstd; ``.tmp`` then rename). Raises ``PagedWeightError`` naming ``what``
    (e.g. ``--trace``) and the reason if the path is unwritable; nothing half-written is left."""
    try:
        with atomic_path(path) as tmp:
            df.to_parquet(tmp, compression="zstd", index=False)
    except OSError as exc:
        raise PagedWeightError(f"cannot write {what + ' ' if what else ''}{path}: {exc.strerror or exc}") from exc


def trace_frame(engine: LLMEngine) -> pd.DataFrame:
    """The engine's per-step trace as a DataFrame (columns of ``trace.trace_schema``)."""
    return trace_table(engine.trace).to_pandas()


def write_trace(engine: LLMEngine, path: Path) -> None:
    """The engine's per-step trace as Parquet with ``trace.trace_schema`` (zstd; atomic, see ``write_frame``)."""
    try:
        with atomic_path(path) as tmp:
            pq.write_table(trace_table(engine.trace), tmp, compression="zstd")
    except OSError as exc:
        raise PagedWeightError(f"cannot write --trace {path}: {exc.strerror or exc}") from exc
