"""Markdown tables of an evaluation results table, and the quality targets checked on it (pandas only).

What it does: ``quality_memory_table`` (every text-suite run), ``glance_table`` (per budget, each policy against
16-bit), ``long_context_table``, ``ablation_table`` (paper Tables 2 and 4 analogues) and ``targets`` (the quality
targets (a), (b), (c): SPEC section 8's claims at this model's scale, with paired 95% intervals from the
per-request scores). ``figures.write_report`` writes them beside the figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pandas as pd

from pwrun.core.policy import ABLATIONS

MIB = 2**20
DATASETS = {"wikitext2": "WikiText-2", "c4": "C4"}
MEMORY_HEAD = ("| policy | budget | total MiB | fixed MiB | workspace MiB | experts in force MiB (% of 16-bit) "
               "| KV peak MiB | mean bits")
WITHIN = 0.01  # target (a): within 1% of the 16-bit perplexity
ORACLE_MARGIN = 0.05  # target (a): the 1% point at most 5 points of the 16-bit expert bytes above the oracle's
ORACLE_WITHIN = 0.005  # target (a): perplexity within 0.5% of the oracle's static allocation at the same bytes

def ok_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The runs of ``df`` (results rows, ``pweval.results.SCHEMA``) that completed: no ``note``."""
    return df[df.note.isna()]


WORKLOAD = ("requests", "prompt_tokens", "continuation_tokens", "seed")  # what makes two runs score the same tokens


def _workload_flags(r: pd.Series) -> str:
    """The ``pwrun eval run`` options that give row ``r``'s workload (text: windows per dataset = requests / 2)."""
    flags = (f"--prompt-tokens {int(r.prompt_tokens)} --continuation-tokens {int(r.continuation_tokens)} "
             f"--seed {int(r.seed)}")
    return f"--requests {int(r.requests) // 2} {flags}" if r.suite == "text" else \
        f"{flags} and the other runs' --requests / --questions"


def check_workloads(df: pd.DataFrame) -> None:
    """Raise ``ValueError`` if a suite's rows were scored on different workloads (windows, lengths or seed):
    their perplexities are not comparable, nor with the suite's 16-bit row."""
    for suite, d in df.groupby("suite"):
        kinds = d.drop_duplicates(list(WORKLOAD))
        if len(kinds) > 1:
            raise ValueError(f"the {suite} rows were scored on {len(kinds)} different workloads ("
                             + "; ".join(f"{int(r.requests)} requests of {int(r.prompt_tokens)} + "
                                         f"{int(r.continuation_tokens)} tokens, seed {int(r.seed)}"
                                         for _, r in kinds.iterrows())
                             + "): their perplexities cannot be compared; keep one workload per --out table")


def reference_row(df: pd.DataFrame, suite: str) -> pd.Series:
    """The last completed 16-bit run of ``suite``, the base of every change; ``ValueError`` (naming the command that
    adds it) if the suite has none or its 16-bit run failed."""
    ref = df[(df.suite == suite) & (df.policy == "16-bit")]
    out = f"--out {df.attrs['path']}" if "path" in df.attrs else "--out TABLE"
    if not ref.empty and ok_rows(ref).empty:
        raise ValueError(f"the {suite} suite's 16-bit run did not complete ({ref.note.iloc[-1]}): run it again with "
                         f"`pwrun eval run --suite {suite} --policy 16-bit {_workload_flags(ref.iloc[-1])} {out}` "
                         "(the same results table)")
    ref = ok_rows(ref)
    if ref.empty:
        any_row = df[df.suite == suite].iloc[-1]
        raise ValueError(f"the results have no 16-bit row for the {suite} suite: add one with `pwrun eval run "
                         f"--suite {suite} --policy 16-bit {_workload_flags(any_row)} {out}` (the same workload, "
                         "into the same results table)")
    return ref.iloc[-1]


def _pct(x: float, base: float) -> str:
    return f"{100 * (x / base - 1):+.2f}%"


def row_at(d: pd.DataFrame, policy: str, label: str) -> pd.Series | None:
    """The last row of ``policy`` at budget ``label`` (None: none); uniform b runs at its own footprint U<b>, so
    uniform at ``label`` is the uniform run whose footprint that is."""
    rows = d[(d.policy == policy) & (d.budget == label)]
    return None if rows.empty else rows.iloc[-1]


def budget_of(d: pd.DataFrame, label: str) -> float:
    """Total memory in bytes of budget ``label`` (e.g. U4) in ``d``, its first row's."""
    return float(d[d.budget == label].gpu_memory.iloc[0])


def _memory_cols(r: pd.Series) -> list[str]:
    share = r.expert_bytes_mean / r.expert_bytes_16bit
    return [f"{r.gpu_memory / MIB:.2f}", f"{r.fixed_bytes / MIB:.2f}", f"{r.workspace_bytes / MIB:.2f}",
            f"{r.expert_bytes_mean / MIB:.2f} ({100 * share:.0f}%)", f"{r.kv_bytes_max / MIB:.2f}",
            f"{r.mean_bits:.2f}"]


def _speed_cols(r: pd.Series) -> list[str]:
    tps = "-" if pd.isna(r.tokens_per_second) else f"{r.tokens_per_second:.0f}"
    return [tps, str(int(r.preemptions))]


def _order(d: pd.DataFrame) -> pd.DataFrame:
    rank = {p: i for i, p in enumerate(["16-bit", "uniform", "static", "oracle", "pagedweight", *ABLATIONS])}
    return d.assign(_r=d.policy.map(rank), _m=d.gpu_memory).sort_values(["_r", "_m"]).drop(columns=["_r", "_m"])


def quality_memory_table(df: pd.DataFrame) -> str:
    """Markdown: every text-suite run (policy x budget) with its memory split and perplexities."""
    text = df[df.suite == "text"]
    ref = reference_row(df, "text")
    return _run_rows(text, " | WikiText-2 ppl (vs 16-bit) | C4 ppl (vs 16-bit) |", lambda r: [
        f"{r[f'{c}_ppl']:.3f} ({_pct(r[f'{c}_ppl'], ref[f'{c}_ppl'])})" for c in DATASETS])


def _run_rows(d: pd.DataFrame, quality_head: str, quality: Callable[[pd.Series], list[str]]) -> str:
    """Markdown: one row per run of ``d`` (policy order, then budget): its memory split, ``quality(r)`` under
    ``quality_head`` and its speed; a run that did not serve shows its note instead."""
    head = MEMORY_HEAD + quality_head + " tokens/s | preemptions |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for _, r in _order(d).iterrows():
        name = f"uniform {int(r.bits)}-bit" if r.policy == "uniform" else r.policy
        if isinstance(r.note, str):
            lines.append(f"| {name} | {r.budget} | {r.gpu_memory / MIB:.2f} | {r.note} |" + " |" * 9)
            continue
        lines.append(f"| {name} | {r.budget} | " + " | ".join(_memory_cols(r) + quality(r) + _speed_cols(r)) + " |")
    return "\n".join(lines)


GLANCE_LEGEND = (
    "U<b>: the static footprint of uniform b-bit experts (non-expert weights + workspace + b-bit experts + the "
    "workload's peak KV); U4.5: midway between U4 and U5; min: the smallest budget PagedWeight accepts. Uniform APL "
    "is read at its own footprint; between footprints the row names the widest uniform that fits (its numbers are "
    "on that footprint's row). Oracle static: the static allocation ranked by the measured per-block damage "
    "(`docs/eval/oracle/`; none below its floors, so none at min). Rows are matched by total memory.")


def glance_table(df: pd.DataFrame) -> str:
    """Markdown: one row per PagedWeight budget (text suite), each policy's perplexity change against 16-bit
    (WikiText-2 / C4) and expert bytes in force (share of 16-bit) at that total memory (rows matched by bytes, the
    last run of a policy at a budget); uniform at its own footprint, else the widest uniform that fits (paper
    Fig. 5 read as a table). A PagedWeight run that failed shows its note."""
    every = df[df.suite == "text"]
    text = ok_rows(every)
    ref = reference_row(df, "text")

    def at(policy: str, budget: int) -> pd.Series | None:
        rows = text[(text.policy == policy) & (text.gpu_memory == budget)]
        return None if rows.empty else rows.iloc[-1]

    def cell(r: pd.Series | None) -> str:
        if r is None:
            return ""
        if isinstance(r.note, str):
            return f"not run: {r.note}"
        share = r.expert_bytes_mean / r.expert_bytes_16bit if r.expert_bytes_16bit else math.nan
        return (" / ".join(_pct(r[f"{c}_ppl"], ref[f"{c}_ppl"]) for c in DATASETS)
                + ("" if math.isnan(share) else f" ({100 * share:.0f}%)"))

    pw = every[every.policy == "pagedweight"].sort_values("gpu_memory", kind="stable")
    pw = pw.drop_duplicates("gpu_memory", keep="last")
    if pw.empty:
        return "No PagedWeight run of the text suite: nothing to compare (`pwrun eval run --policy pagedweight`)."
    lines = ["| total memory | uniform APL at that footprint | static (same budget) | oracle static (same budget) "
             "| PagedWeight (same budget) |", "|---|---|---|---|---|"]
    for _, r in pw.iterrows():
        u = at("uniform", r.gpu_memory)
        fits = _uniform_at(text, r.gpu_memory)
        uni = (f"{int(u.bits)}-bit: {cell(u)}" if u is not None else
               f"({int(fits.bits)}-bit fits)" if fits is not None else "none fits")
        lines.append(f"| {r.budget} {r.gpu_memory / MIB:.1f} MiB | {uni} | {cell(at('static', r.gpu_memory))} | "
                     f"{cell(at('oracle', r.gpu_memory))} | {cell(r)} |")
    return "\n".join(lines) + "\n\n" + GLANCE_LEGEND


def long_context_table(df: pd.DataFrame) -> str:
    """Markdown: every long-suite run with retrieval accuracy and QMSum perplexity."""
    lon = df[df.suite == "long"]
    ref = reference_row(df, "long")
    note = (f"Retrieval: {int(ref.retrieval_questions)} questions of {int(ref.retrieval_candidates)} passages "
            f"(chance {1 / ref.retrieval_candidates:.3g}); QMSum: {int(ref.qmsum_tokens)} scored tokens.\n\n")
    return note + _run_rows(lon, " | retrieval top-1 | QMSum ppl (vs 16-bit) |", lambda r: [
        f"{r.retrieval_acc:.3f}", f"{r.qmsum_ppl:.3f} ({_pct(r.qmsum_ppl, ref.qmsum_ppl)})"])


def ablation_table(df: pd.DataFrame) -> str:
    """Markdown: full PagedWeight vs each ablation at the ablation budgets (text suite), perplexity and change."""
    text = ok_rows(df[df.suite == "text"])
    abl = [p for p in ABLATIONS if p in set(text.policy)]
    labels = list(dict.fromkeys(text[text.policy.isin(abl)].budget))
    head = "| budget | variant | WikiText-2 ppl (vs full) | C4 ppl (vs full) | mean bits | demoted / promoted blocks |"
    lines = [head, "|---|---|---|---|---|---|"]
    for lab in labels:
        full = row_at(text, "pagedweight", lab)
        if full is None:
            continue
        for policy in ["pagedweight", *abl]:
            r = row_at(text, policy, lab)
            if r is None:
                continue
            q = [f"{r[f'{c}_ppl']:.3f} ({_pct(r[f'{c}_ppl'], full[f'{c}_ppl'])})" for c in DATASETS]
            name = ("full PagedWeight" if policy == "pagedweight" else "with residual heads" if policy == "residual"
                    else f"w/o {policy.removeprefix('no-')}")
            lines.append(f"| {lab} ({r.gpu_memory / MIB:.2f} MiB) | {name} | {q[0]} | {q[1]} | {r.mean_bits:.2f} | "
                         f"{int(r.demoted_blocks)} / {int(r.promoted_blocks)} |")
    return "\n".join(lines)


def _uniform_at(text: pd.DataFrame, budget: float) -> pd.Series | None:
    """The best uniform run whose footprint fits ``budget`` (equal or less total memory)."""
    u = text[(text.policy == "uniform") & (text.gpu_memory <= budget)]
    return None if u.empty else u.sort_values("bits").iloc[-1]


def paired_change(scores: pd.DataFrame, run_a: str, run_b: str, task: str) -> tuple[float, float, float] | None:
    """Perplexity change of run a against run b on ``task``, paired by request: (point, low, high) of the
    95% interval, from the per-request mean NLL differences (normal approximation). None without scores."""
    a = scores[(scores.run_id == run_a) & (scores.task == task)].set_index("request")
    b = scores[(scores.run_id == run_b) & (scores.task == task)].set_index("request")
    if a.empty or len(a) != len(b) or len(a) < 2:
        return None
    d = (a.nll / a.tokens - (b.nll / b.tokens).reindex(a.index)).to_numpy(dtype=float)
    mean, se = float(d.mean()), float(d.std(ddof=1) / np.sqrt(d.size))
    return math.expm1(mean), math.expm1(mean - 1.96 * se), math.expm1(mean + 1.96 * se)


def _ci(c: tuple[float, float, float] | None) -> str:
    return "" if c is None else f" [95% CI {100 * c[1]:+.2f}%, {100 * c[2]:+.2f}%]"


def _within(d: pd.DataFrame, ref: pd.Series) -> np.ndarray:
    """[len(d)] bool: within 1% of the 16-bit perplexity on every dataset."""
    ok = np.ones(len(d), bool)
    for c in DATASETS:
        ok &= (d[f"{c}_ppl"] <= ref[f"{c}_ppl"] * (1 + WITHIN)).to_numpy()
    return ok


def _share(d: pd.DataFrame, col: str = "expert_bytes_mean") -> np.ndarray:
    return (d[col] / d.expert_bytes_16bit).to_numpy(float)


def _vs_oracle(r: pd.Series, sh: float, oracle: pd.DataFrame, o_share: np.ndarray) -> list[float]:
    """Perplexity change of row ``r`` against the oracle at expert share ``sh`` per text (log-perplexity
    interpolated linearly in the share); [] outside the oracle's range."""
    if len(oracle) < 2 or not o_share[0] <= sh <= o_share[-1]:
        return []
    return [r[f"{c}_ppl"] / math.exp(float(np.interp(sh, o_share, np.log(oracle[f"{c}_ppl"].to_numpy(float))))) - 1
            for c in DATASETS]


def _suite_noise(ref: pd.Series) -> str:
    """What the text suite's size says about the resolution of a 0.5% comparison (from the 16-bit run's scored
    tokens: target (b)'s paired intervals are about +-0.5% at 3,072 tokens and shrink as 1 / sqrt(tokens))."""
    tokens = ref.get("wikitext2_tokens")
    if tokens is None or not tokens == tokens or tokens < 1:  # not recorded (NaN)
        return "A paired 95% interval of a change between two runs is about +-0.5% at 3,072 scored tokens per text."
    noise = 0.005 * math.sqrt(3072 / float(tokens))
    return (f"This text suite scores {int(tokens):,} tokens per dataset: the paired 95% interval of a change between "
            f"two runs is about +-{100 * noise:.2f}% at these budgets (+-0.5% at 3,072 tokens, target (b)'s "
            "intervals, shrinking as 1 / sqrt(tokens))" + (", as wide as this target." if noise >= ORACLE_WITHIN
                                                           else "."))


def target_a(pw: pd.DataFrame, oracle: pd.DataFrame, ref: pd.Series) -> list[str]:
    """Markdown lines of target (a): the smallest expert share at which PagedWeight is within 1% of 16-bit against
    the oracle's (its static allocation ranked by the measured per-block damage, policy ``oracle``), and at each
    PagedWeight run the perplexity change against the oracle's at the same expert bytes (log-perplexity
    interpolated linearly in the share between the oracle's runs; runs outside the oracle's range are not judged).
    The verdict reads the time-averaged bytes; beside it the same comparison at the bytes in force while the scored
    tokens ran (``expert_bytes_scored``). A dynamic run holds more bytes early, while it prefills the prompts, and
    the scored tokens read the KV those bytes computed: the truth lies between the two readings (the time average
    charges PagedWeight for memory free early; the scored share credits it with the early bytes' KV for free)."""
    out = ["## (a) PagedWeight against the oracle's static allocation", ""]
    share, within = _share(pw), _within(pw, ref)
    scored = _share(pw, "expert_bytes_scored") if "expert_bytes_scored" in pw else np.full(len(pw), np.nan)
    first = float(share[within].min()) if within.any() else None
    oracle = oracle.sort_values("expert_bytes_mean")
    o_share, o_within = _share(oracle), _within(oracle, ref)
    o_first = float(o_share[o_within].min()) if o_within.any() else None
    own = ("PagedWeight is never within 1% of 16-bit on both texts" if first is None else
           f"PagedWeight is first within 1% of 16-bit (both texts) at {100 * first:.1f}% of the 16-bit expert bytes")
    if oracle.empty:
        out.append(f"**not evaluated**: no oracle runs (`pwrun eval sweep --oracle DAMAGE.parquet`); {own}.")
    elif first is None or o_first is None:
        out.append(f"**not met**: {'PagedWeight' if first is None else 'the oracle'} is never within 1% of 16-bit.")
    else:
        met = first <= o_first + ORACLE_MARGIN
        out.append(f"**1% point {'met' if met else 'NOT met'}**: PagedWeight is first within 1% of 16-bit (both "
                   f"texts) at {100 * first:.1f}% of the 16-bit expert bytes, the oracle at {100 * o_first:.1f}% "
                   f"(target: at most {100 * ORACLE_MARGIN:.0f} points above).")
    out += ["", "Per PagedWeight run: expert bytes in force (time-averaged, planes + LUTs) as a share of their 16-bit "
            "bytes; perplexity change against 16-bit; and against the oracle at the same share (target: at most "
            f"+{100 * ORACLE_WITHIN:.1f}% on each text). \"while scoring\": the expert bytes in force during the "
            "decode tokens (nearly all the scored ones), averaged over them, and the oracle compared at that share: "
            "a lower bound on the memory behind the scores, since the prompts' KV, which every scored token reads, "
            "was computed earlier at more bytes; the truth lies between the two readings.", "",
            "| budget | MiB | experts in force | WikiText-2 vs 16-bit | C4 vs 16-bit | both within 1% | "
            "WikiText-2 vs oracle | C4 vs oracle | verdict | in force while scoring | WikiText-2 / C4 vs oracle "
            "at it |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    verdicts, at_scored = [], []
    for (_, r), sh, sc, w in zip(pw.iterrows(), share, scored, within, strict=True):
        cells = [_pct(r[f'{c}_ppl'], ref[f'{c}_ppl']) for c in DATASETS]
        vs = _vs_oracle(r, sh, oracle, o_share)
        verdict = "no oracle at this share"
        if vs:
            verdict = "met" if all(v <= ORACLE_WITHIN for v in vs) else "NOT met"
            verdicts.append(verdict)
        vs_sc = [] if math.isnan(sc) else _vs_oracle(r, sc, oracle, o_share)
        if vs_sc:
            at_scored.append(all(v <= ORACLE_WITHIN for v in vs_sc))
        vs_cells = [f"{100 * v:+.2f}%" for v in vs] or ["", ""]
        sc_cells = (" / ".join(f"{100 * v:+.2f}%" for v in vs_sc) if vs_sc else
                    "" if math.isnan(sc) else "outside the oracle's range")
        out.append(f"| {r.budget} | {r.gpu_memory / MIB:.2f} | {100 * sh:.1f}% | {cells[0]} | {cells[1]} | "
                   f"{'yes' if w else 'no'} | {vs_cells[0]} | {vs_cells[1]} | {verdict} | "
                   f"{'' if math.isnan(sc) else f'{100 * sc:.1f}%'} | {sc_cells} |")
    if verdicts:
        out += ["", f"Within {100 * ORACLE_WITHIN:.1f}% of the oracle at {sum(v == 'met' for v in verdicts)} of "
                f"{len(verdicts)} runs in the oracle's range. {_suite_noise(ref)}"]
    if at_scored:
        out += ["", f"At the expert bytes in force while scoring: within {100 * ORACLE_WITHIN:.1f}% of the oracle at "
                f"{sum(at_scored)} of {len(at_scored)} runs in the oracle's range."]
    return out


def targets(df: pd.DataFrame, scores: pd.DataFrame | None = None) -> str:
    """Markdown: the quality targets (a), (b), (c) (SPEC section 8's claims at this model's scale) checked on the
    text suite's numbers.

    ``scores``: the per-request scores (``results.read_scores``); with them each comparison of (b) gets a
    paired 95% interval, and a miss whose interval straddles zero is reported as within noise.
    """
    scores = pd.DataFrame(columns=["run_id", "request", "task", "nll", "tokens"]) if scores is None else scores
    text = ok_rows(df[df.suite == "text"])
    ref = reference_row(df, "text")
    pw = text[text.policy == "pagedweight"].sort_values("gpu_memory")
    out = target_a(pw, text[text.policy == "oracle"], ref)
    head = ("## (b) PagedWeight no worse than uniform APL at equal total memory; strictly better where uniform "
            "loses > 1%")
    rows = ["| budget | MiB | uniform | WikiText-2: PagedWeight / uniform | C4: PagedWeight / uniform | verdict |",
            "|---|---|---|---|---|---|"]
    verdicts = []
    any_uniform = bool((text.policy == "uniform").any())
    for _, r in pw.iterrows():
        u = _uniform_at(text, r.gpu_memory)
        if u is None:
            rows.append(f"| {r.budget} | {r.gpu_memory / MIB:.2f} | {'none fits' if any_uniform else 'no uniform run'}"
                        " | | | n/a |")
            continue
        oks, noise, sig, cells = [], [], [], []
        for c in DATASETS:
            p, q, base = r[f"{c}_ppl"], u[f"{c}_ppl"], ref[f"{c}_ppl"]
            strict = q > base * (1 + WITHIN)
            ok = bool(p < q) if strict else bool(p <= q)
            ci = paired_change(scores, r.run_id, u.run_id, c)
            oks.append(ok)
            sig.append(not strict or ci is None or ci[2] < 0)
            noise.append(ok or (ci is not None and not strict and ci[1] <= 0 <= ci[2]))
            cells.append(f"{p:.3f} / {q:.3f} ({_pct(p, q)}){_ci(ci)}{' (must be lower)' if strict else ''}")
        verdict = ("met" if all(oks) and all(sig) else "met (point estimate; interval includes 0)" if all(oks)
                   else "not met, within noise" if all(noise) else "NOT met")
        verdicts.append(verdict)
        rows.append(f"| {r.budget} | {r.gpu_memory / MIB:.2f} | {int(u.bits)}-bit | {cells[0]} | {cells[1]} | "
                    f"{verdict} |")
    met_n = sum(v.startswith("met") for v in verdicts)
    summary = ("not evaluated: no uniform run fits any PagedWeight budget (serve --policy uniform at these budgets)"
               if not verdicts else "met at every budget" if met_n == len(verdicts) else
               f"met at {met_n} of {len(verdicts)} budgets ({sum(v == 'met' for v in verdicts)} with intervals "
               f"excluding 0 where it must be lower); {sum(v == 'not met, within noise' for v in verdicts)} misses "
               f"are within noise, {sum(v == 'NOT met' for v in verdicts)} are not")
    out += ["", head, "", f"**{summary}.**", "",
            "Uniform b is charged its static footprint U<b> (non-expert weights + workspace + b-bit experts + the "
            "workload's measured peak KV, so it serves the same concurrency without queueing); PagedWeight runs "
            "under exactly that budget. At other budgets the best uniform whose footprint fits is used. Brackets: "
            "paired 95% interval of the change over the workload's requests (the same tokens scored by both runs).",
            "", *rows]
    abl = ablation_table(df)
    out += ["", "## (c) The ablations and the residual heads", "",
            "As measured (also in ablations.md):" if abl.count("\n") > 1 else
            "**not evaluated**: no ablation runs at a budget with a PagedWeight run.", "", abl]
    return "\n".join(out)
