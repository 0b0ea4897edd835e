"""The serving summary and the per-step trace (what ``pwrun generate`` prints and ``--trace`` writes).

What it does: ``summarize`` turns an engine's totals and trace into one flat dict: memory split
between expert weights and KV over time (min / mean / max bytes), the committed-bitwidth
histogram at the end and the time-averaged mean bitwidth, demotions and promotions (blocks),
bytes moved host -> device (device -> host is always 0: the host mirror keeps every plane),
preemptions and the tokens they made the engine compute again (counted in the prefill tokens, so
tokens/s is tokens computed per second, not served), tokens/s, planner time per step and, on CUDA, the
peak device memory against the budget. ``format_summary`` renders it for the terminal; ``write_trace``
writes the trace as Parquet (zstd, atomic) for the notebooks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from pwrun.engine.budget import dtype_label, format_size
from pwrun.engine.engine import Engine
from pwrun.errors import PagedWeightError


def summarize(engine: Engine, info: dict[str, Any]) -> dict[str, Any]:
    """Flat summary dict of a finished run (bytes, seconds, tokens/s; see module docstring)."""
    t = engine.totals
    tr = pd.DataFrame(t.trace)
    pb = engine.pool.cfg.page_bytes
    w = engine.store.wpt
    out: dict[str, Any] = dict(info)
    secs = max(t.seconds, 1e-9)
    if len(tr):
        wt = tr.seconds.to_numpy()
        weights = tr.committed_weight_bytes.to_numpy()
        kv = tr.kv_pages.to_numpy() * pb
        out.update({
            "weight_bytes_min": int(weights.min()), "weight_bytes_mean": float(np.average(weights, weights=wt)),
            "weight_bytes_max": int(weights.max()), "kv_bytes_min": int(kv.min()),
            "kv_bytes_mean": float(np.average(kv, weights=wt)), "kv_bytes_max": int(kv.max()),
            "mean_bits_time_avg": float(np.average(tr.mean_bits.to_numpy(), weights=wt)),
        })
    hist = np.bincount(w.q, minlength=9)
    out.update({
        "steps": t.steps, "seconds": t.seconds, "prefill_tokens": t.prefill_tokens, "decode_tokens": t.decode_tokens,
        "tokens_per_second": (t.prefill_tokens + t.decode_tokens) / secs, "decode_tokens_per_second":
        t.decode_tokens / secs, "demoted_blocks": t.demoted_blocks, "promoted_blocks": t.promoted_blocks,
        "bytes_host_to_device": int(engine.store.bytes_h2d), "bytes_device_to_host": int(engine.store.bytes_d2h),
        "preemptions": t.preemptions, "recomputed_tokens": engine.scheduler.recomputed_tokens,
        "planner_ms_per_step": 1e3 * t.planner_seconds / max(t.steps, 1),
        "planner_overlapped_ms_per_step": 1e3 * t.planner_overlapped_seconds / max(t.steps, 1),
        "planner_share_of_step": t.planner_seconds / secs, "final_mean_bits": float(w.q.mean()),
        "final_bits_hist": {int(b): int(hist[b]) for b in range(9) if hist[b]},
        "pool_pages": engine.pool.cfg.num_pages, "pool_peak_pages": engine.pool.peak_used,
    })
    if engine.planner is not None:  # demotion plans taken ready-made vs made on the step's critical path
        out.update({f"planner_plans_{k}": v for k, v in engine.planner.takes.items()})
    if engine.model.device.type == "cuda":
        out["device_peak_bytes"] = int(torch.cuda.max_memory_allocated(engine.model.device))
    return out


def format_summary(s: dict[str, Any]) -> str:
    """A few terminal lines from ``summarize``'s dict."""
    lines = [
        f"policy {s['policy']}{' ' + str(s['bits']) + ' bits' if s.get('bits') else ''} on {s['device']} "
        f"({s['dtype']}); budget {format_size(s['gpu_memory'])} = non-expert weights ({dtype_label(s['dtype'])}) "
        f"{format_size(s['fixed_bytes'])}"
        f" + workspace {format_size(s['workspace_bytes'])} + page pool {format_size(s['pool_bytes'])}",
    ]
    if "weight_bytes_mean" in s:
        lines.append(
            f"experts in force {format_size(s['weight_bytes_min'])} .. {format_size(s['weight_bytes_max'])} (mean "
            f"{format_size(s['weight_bytes_mean'])} = {100 * s['weight_bytes_mean'] / s['expert_bytes_16bit']:.1f}% of "
            f"their 16-bit {format_size(s['expert_bytes_16bit'])}); KV {format_size(s['kv_bytes_min'])} .. "
            f"{format_size(s['kv_bytes_max'])} (mean {format_size(s['kv_bytes_mean'])})")
    hist = " ".join(f"{b}b:{n}" for b, n in s["final_bits_hist"].items())
    lines += [
        f"committed bits at the end: {hist} (mean {s['final_mean_bits']:.2f}; time-averaged "
        f"{s.get('mean_bits_time_avg', s['final_mean_bits']):.2f})",
        f"{s['demoted_blocks']} demotions, {s['promoted_blocks']} promotions, {format_size(s['bytes_host_to_device'])}"
        f" host->device, {format_size(s['bytes_device_to_host'])} device->host, {s['preemptions']} preemptions",
        f"{s['steps']} steps in {s['seconds']:.2f} s: {s['prefill_tokens']} prefill "
        + (f"({s['recomputed_tokens']} of them recomputed after preemptions) " if s.get("recomputed_tokens") else "")
        + f"+ {s['decode_tokens']} decode tokens = {s['tokens_per_second']:.1f} tokens/s; planner "
        f"{s['planner_ms_per_step']:.2f} ms/step ({100 * s['planner_share_of_step']:.2f}% of step time; "
        f"+{s['planner_overlapped_ms_per_step']:.2f} ms/step while the device computed)",
    ]
    if "device_peak_bytes" in s:
        lines.append(f"peak device memory {format_size(s['device_peak_bytes'])} of the "
                     f"{format_size(s['gpu_memory'])} budget")
    return "\n".join(lines)


def write_frame(df: pd.DataFrame, path: Path, what: str = "") -> None:
    """Any DataFrame as Parquet (zstd; ``.tmp`` then rename). Raises ``PagedWeightError`` naming ``what``
    (e.g. ``--trace``) and the reason if the path is unwritable; nothing half-written is left."""
    from pwcal.manifest import atomic_path

    try:
        with atomic_path(path) as tmp:
            df.to_parquet(tmp, compression="zstd", index=False)
    except OSError as exc:
        raise PagedWeightError(f"cannot write {what + ' ' if what else ''}{path}: {exc.strerror or exc}") from exc


def write_trace(engine: Engine, path: Path) -> None:
    """The engine's per-step trace as Parquet (see ``write_frame``)."""
    write_frame(pd.DataFrame(engine.totals.trace), path, "--trace")
