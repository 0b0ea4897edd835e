"""Figures and markdown tables from an evaluation results table (the analogues of the paper's Fig. 5, Tables 2, 4).

What it does: ``write_report`` reads ``results.parquet`` and writes into a folder:
``quality_memory.png`` (perplexity vs total memory for every policy, WikiText-2 and C4),
``expert_memory.png`` (perplexity vs expert bytes in force, as a share of their 16-bit bytes),
``long_context.png`` (retrieval accuracy and QMSum perplexity at the long suite's fixed budgets),
and the markdown tables ``quality_memory.md`` (a per-budget comparison, then every run), ``long_context.md``,
``ablations.md`` and ``targets.md`` (made by ``tables.py``). Pure reading and plotting (matplotlib, Agg backend);
the sweep that makes the results table is ``sweep.py``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from pweval.results import read_results, read_scores
from pweval.tables import (
    DATASETS,
    MIB,
    WITHIN,
    ablation_table,
    budget_of,
    check_workloads,
    glance_table,
    long_context_table,
    ok_rows,
    quality_memory_table,
    reference_row,
    row_at,
    targets,
)

STYLE = {"pagedweight": ("C3", "o", "-"), "static": ("C2", "s", "--"), "uniform": ("C0", "^", ":"),
         "oracle": ("C1", "*", "-."),
         "no-routing": ("C4", "v", "none"), "residual": ("C5", "<", "none"), "no-movement": ("C6", ">", "none"),
         "no-sensitivity": ("C7", "D", "none")}

def quality_memory_figure(df: pd.DataFrame, path: Path, x: str = "gpu_memory") -> None:
    """Perplexity vs memory (``x``: ``gpu_memory`` total bytes, or ``expert_share``) per dataset, every policy;
    a second row zooms on the budgets where the policies differ (uniform 3 to 6 bits' points)."""
    text = ok_rows(df[df.suite == "text"]).copy()
    text["expert_share"] = text.expert_bytes_mean / text.expert_bytes_16bit
    ref = reference_row(df, "text")
    scale = MIB if x == "gpu_memory" else 0.01
    uni = text[text.policy == "uniform"].drop_duplicates("bits", keep="last").set_index("bits")
    zoom = {3, 4, 6} <= set(uni.index) and x == "gpu_memory"
    fig, axes = plt.subplots(2 if zoom else 1, len(DATASETS), figsize=(12, 8.6 if zoom else 4.6), squeeze=False)
    for row in range(axes.shape[0]):
        for ax, (col, name) in zip(axes[row], DATASETS.items(), strict=True):
            base = ref[f"{col}_ppl"]
            ax.axhline(base, color="k", lw=1, label="16-bit")
            ax.axhspan(base, base * (1 + WITHIN), color="k", alpha=0.07, label="16-bit +1%")
            ax.plot([(ref.gpu_memory if x == "gpu_memory" else 1.0) / scale], [base], "k*", ms=12)
            for policy, (color, marker, ls) in STYLE.items():
                d = text[text.policy == policy].sort_values(x)
                if d.empty:
                    continue
                ax.plot(d[x] / scale, d[f"{col}_ppl"], color=color, marker=marker, ls=ls, label=policy)
                if policy == "uniform":
                    for _, r in d.iterrows():
                        ax.annotate(f"{int(r.bits)}b", (r[x] / scale, r[f"{col}_ppl"]), textcoords="offset points",
                                    xytext=(4, 4), fontsize=8, color=color)
            if row == 1:
                lo, hi = uni.gpu_memory[3] / MIB - 0.6, uni.gpu_memory[6] / MIB + 0.6
                ax.set_xlim(lo, hi)
                ax.set_ylim(base * 0.995, uni[f"{col}_ppl"][4] * 1.012)
                ax.set_title(f"{name}: zoom on {lo:.0f}-{hi:.0f} MiB")
            else:
                ax.set_title(f"{name}: continuations scored while serving")
            ax.set_xlabel("total memory (MiB)" if x == "gpu_memory" else "expert bytes in force (% of 16-bit, "
                          "time-avg)")
            ax.set_ylabel(f"{name} perplexity")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def long_context_figure(df: pd.DataFrame, path: Path) -> None:
    """Retrieval accuracy and QMSum perplexity per policy at each long-suite budget (uniform b at its own U<b>)."""
    lon = ok_rows(df[df.suite == "long"])
    ref = reference_row(df, "long")
    labels = [b for b in dict.fromkeys(lon[lon.policy == "pagedweight"].budget)]
    policies = ["uniform", "static", "pagedweight"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    width = 0.8 / len(policies)
    for ax, (col, name) in zip(axes, [("retrieval_acc", "retrieval top-1 accuracy"), ("qmsum_ppl", "QMSum perplexity")],
                               strict=True):
        for k, policy in enumerate(policies):
            rows = [row_at(lon, policy, lab) for lab in labels]
            vals = [np.nan if r is None else r[col] for r in rows]
            ax.bar(np.arange(len(labels)) + k * width, vals, width, label=policy, color=STYLE[policy][0])
        ax.axhline(ref[col], color="k", lw=1, label="16-bit")
        if col == "retrieval_acc":
            ax.axhline(1 / ref.retrieval_candidates, color="grey", lw=1, ls="--", label="chance")
            ax.set_ylim(0, 1)
        ax.set_xticks(np.arange(len(labels)) + width * (len(policies) - 1) / 2)
        ax.set_xticklabels([f"{lab}\n{budget_of(lon, lab) / MIB:.1f} MiB" for lab in labels])
        ax.set_ylabel(name)
        ax.grid(alpha=0.3, axis="y")
        if col == "qmsum_ppl":
            lo = np.nanmin([ref[col], *lon[col]])
            ax.set_ylim(lo * 0.95, None)
    axes[0].legend(fontsize=8)
    fig.suptitle("Long-context requests (1-2k-token contexts, 32 at once) at fixed budgets")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: Path, out_dir: Path) -> list[Path]:
    """Write every figure and table for the results table at ``results`` into ``out_dir``; returns their paths.
    Every table is made before any file is written, so a table that cannot be made leaves the folder as it was."""
    df = read_results(results)
    check_workloads(df)
    bad = ok_rows(df)[~(ok_rows(df).expert_bytes_16bit > 0)]
    if not bad.empty:
        raise ValueError(f"{len(bad)} completed runs have no 16-bit expert bytes (expert_bytes_16bit; first: "
                         f"{bad.policy.iloc[0]} at {bad.budget.iloc[0]}): the table is damaged; make it again with "
                         "`pwrun eval run` or `pwrun eval sweep`")
    source = f"Generated by `pwrun eval report` from `{results.name}`; every number is measured by `pwrun eval`.\n\n"
    tables: dict[str, str] = {}
    if (df.suite == "text").any():
        tables["quality_memory.md"] = (
            "# Quality vs memory (text suite)\n\n" + source + "## At a glance\n\nPerplexity change against 16-bit "
            "(WikiText-2 / C4) and expert bytes in force (time-averaged share of their 16-bit bytes), per total "
            "memory budget.\n\n" + glance_table(df) + "\n\n## Every run\n\n" + quality_memory_table(df) + "\n")
        tables["ablations.md"] = "# Ablations (text suite)\n\n" + source + ablation_table(df) + "\n"
        tables["targets.md"] = ("# Quality targets, checked\n\n" + source + targets(df, read_scores(results))
                                + "\n")
    if (df.suite == "long").any():
        tables["long_context.md"] = ("# Long context (retrieval + QMSum)\n\n" + source + long_context_table(df)
                                     + "\n")
    if not tables:
        raise ValueError(f"it holds no runs: add some with `pwrun eval run --out {results}`")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if "quality_memory.md" in tables:
        quality_memory_figure(df, out_dir / "quality_memory.png")
        quality_memory_figure(df, out_dir / "expert_memory.png", x="expert_share")
        written += [out_dir / "quality_memory.png", out_dir / "expert_memory.png"]
    if "long_context.md" in tables:
        long_context_figure(df, out_dir / "long_context.png")
        written.append(out_dir / "long_context.png")
    for name, text in tables.items():
        (out_dir / name).write_text(text)
        written.append(out_dir / name)
    return written


def memory_split_figure(series: dict[str, dict[str, list[float]]], budget: int, title: str, out: Path) -> None:
    """Stacked expert weights and KV (GiB) in the page pool over a run, one panel per system: ``series[system]``
    has ``t`` (seconds), ``weight_bytes`` and ``kv_bytes`` per step (``bench.headline``); the budget as a line."""
    width = max(7.0, 5.0 * len(series))
    fig, axes = plt.subplots(1, len(series), figsize=(width, 3.4), sharey=True, squeeze=False)
    for ax, (name, s) in zip(axes[0], series.items(), strict=True):
        w = [b / 2**30 for b in s["weight_bytes"]]
        kv = [b / 2**30 for b in s["kv_bytes"]]
        ax.stackplot(s["t"], w, kv, labels=["expert weights", "KV cache"], step="post")
        ax.axhline(budget / 2**30, color="k", lw=0.8, ls="--", label="budget")
        ax.set_title(name)
        ax.set_xlabel("busy seconds (steps only)")
    axes[0][0].set_ylabel("GiB in the page pool")
    axes[0][0].legend(loc="lower right", fontsize=8)
    fig.suptitle(textwrap.fill(title, width=int(width * 13)), fontsize=10)  # ~13 characters an inch at 10 pt
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
