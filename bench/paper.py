"""The paper's headline and Table 3 numbers (SPEC section 8) beside ours, for ``docs/performance.md``.

Ours come from the latest headline run (``bench/results/headline.jsonl``), the serving suite's decode tok/s at a
2048-token prompt (``serving.jsonl``) and the long-context quality table that ``pwrun eval report`` writes
(``docs/eval/long_context.md``). A ratio of ours is printed only where both of its numbers come from one run (one
GPU, one date and label): numbers from different machines are shown, never divided. Only the standard library.
"""

from __future__ import annotations

from typing import Any

Record = dict[str, Any]
QWEN = "Qwen__Qwen1.5-MoE-A2.7B"
# SPEC section 8: Qwen1.5-MoE at sequence 2048, decode tok/s at B=1 / B=4
TABLE3 = {"FP16": (67.1, 258.0), "APL 3.25-bit": (134.5, 429.9), "PagedWeight (7.63 GB)": (130.1, 419.4)}
# our serving suite's system names for the paper's three rows
OURS = {"FP16": "ours 16-bit", "APL 3.25-bit": "ours uniform 3-bit",
        "PagedWeight (7.63 GB)": "PagedWeight under pressure"}
# SPEC section 8, LongBench average on Qwen1.5-MoE: (score %, GB)
LONGBENCH = {"FP16": (17.0, 35.25), "APL 3-bit": (12.2, 9.40), "PagedWeight": (17.0, 9.86)}


def _num(x: Any, fmt: str = "{:.0f}") -> str:
    return fmt.format(x) if isinstance(x, int | float) else ""


def run_of(r: Record) -> tuple[str, str, str]:
    """The run a record came from: (gpu, date, label), as ``bench.common.environment`` stamps them."""
    return str(r.get("gpu", "")), str(r.get("date", "")), str(r.get("label", ""))


def _gpu(r: Record) -> str:
    return str(r.get("gpu", "")).replace("NVIDIA ", "").replace(" 80GB HBM3", "")


def _latest(records: list[Record], system: str, batch: int) -> Record | None:
    rows = [r for r in records if r.get("model") == QWEN and r.get("system") == system and r.get("batch") == batch
            and not r.get("workload") and not r.get("baseline") and "error" not in r
            and isinstance(r.get("decode_tps_measured"), int | float)]
    return max(rows, key=lambda r: (str(r.get("date", "")), str(r.get("label", ""))), default=None)


def _same_run_pair(records: list[Record], system: str, batch: int) -> tuple[Record, Record] | None:
    """The latest run that measured both ``system`` and the 16-bit engine at ``batch``."""
    pairs = []
    for r in records:
        if r.get("model") != QWEN or r.get("system") != system or r.get("batch") != batch or r.get("baseline"):
            continue
        base = next((b for b in records if b.get("system") == OURS["FP16"] and b.get("batch") == batch
                     and b.get("model") == QWEN and run_of(b) == run_of(r)
                     and isinstance(b.get("decode_tps_measured"), int | float)), None)
        if base is not None and isinstance(r.get("decode_tps_measured"), int | float):
            pairs.append((r, base))
    return max(pairs, key=lambda p: (str(p[0].get("date", "")), str(p[0].get("label", ""))), default=None)


def _table3_rows(serving: list[Record]) -> list[str]:
    lines = []
    for b, batch in enumerate((1, 4)):
        fp16_paper = TABLE3["FP16"][b]
        for row, paper in TABLE3.items():
            r = _latest(serving, OURS[row], batch)
            ratio = ""
            if row != "FP16":  # the value of the run that gives the ratio, where one does
                pair = _same_run_pair(serving, OURS[row], batch)
                r = pair[0] if pair else r
                ratio = (f"{pair[0]['decode_tps_measured'] / pair[1]['decode_tps_measured']:.2f}x FP16 "
                         f"({_gpu(pair[0])})" if pair else "x FP16: needs one run of both")
            ours = f"{_num(r.get('decode_tps_measured'))} ({OURS[row]}, {_gpu(r)})" if r else "not measured"
            paper_x = "" if row == "FP16" else f" ({paper[b] / fp16_paper:.2f}x FP16)"
            lines.append(f"| Table 3, decode tok/s at B={batch}, seq 2048: {row} | {paper[b]:g}{paper_x} | {ours} "
                         f"| {ratio} |")
    return lines


def _headline_rows(headline: list[Record]) -> list[str]:
    ok = [r for r in headline if "error" not in r and r.get("model") == QWEN]
    pw = max((r for r in ok if r.get("system") == "pagedweight"), key=lambda r: str(r.get("date", "")), default=None)
    if pw is None:
        return ["| PagedWeight throughput x FP16, one budget, KV-heavy traffic | 1.94x | not measured | |"]
    fp16 = max((r for r in ok if r.get("system") == "fp16" and r.get("label") == pw.get("label")
                and r.get("request_rate") == pw.get("request_rate")),
               key=lambda r: str(r.get("date", "")), default=None)
    where = (f"{_gpu(pw)}, {_num(pw.get('gpu_memory_gib'), '{:g}')} GiB, {_num(pw.get('requests'))} requests at "
             f"{_num(pw.get('request_rate'), '{:g}')}/s")
    decode_x = ""
    if fp16 is not None and isinstance(pw.get("decode_tps"), int | float) and fp16.get("decode_tps"):
        decode_x = f"; {pw['decode_tps'] / fp16['decode_tps']:.2f}x in its decode-only steps"
    share = ""
    if fp16 is not None and all(isinstance(r.get("mixed_s"), int | float) and r.get("duration_s")
                                for r in (pw, fp16)):
        share = (f" (steps with prompt tokens: {100 * fp16['mixed_s'] / fp16['duration_s']:.0f}% of FP16's run, "
                 f"{100 * pw['mixed_s'] / pw['duration_s']:.0f}% of PagedWeight's)")
    below = pw.get("x_vs_uniform4")
    cap = max((r for r in ok if r.get("system") == "pagedweight-cap4.25" and r.get("label") == pw.get("label")
               and r.get("request_rate") == pw.get("request_rate")), key=lambda r: str(r.get("date", "")), default=None)
    cap_below = cap.get("x_vs_uniform4") if cap is not None else None
    capped = (f"; capped at 4.25 bits (`--max-mean-bits 4.25`): {100 * (1 - cap_below):.1f}% below, "
              f"{_num(cap.get('x_vs_fp16'), '{:.2f}')}x FP16" if cap is not None and isinstance(cap_below, int | float)
              else "")
    return [
        f"| PagedWeight throughput x FP16, one budget, KV-heavy traffic | 1.94x (= Table 3's B=1 ratio, "
        f"130.1 / 67.1) | {_num(pw.get('x_vs_fp16'), '{:.2f}')}x whole run{decode_x}{share} | {where} |",
        f"| PagedWeight throughput below uniform APL | at most 4.1% | "
        f"{_num(100 * (1 - below) if isinstance(below, int | float) else None, '{:.1f}')}% below uniform 4-bit"
        f"{capped} | "
        f"{where} |"]


def _eval_rows(long_context_md: str) -> list[str]:
    """Retrieval accuracy and QMSum perplexity of 16-bit, uniform 3-bit and PagedWeight at the uniform-3 budget."""
    lines = [ln for ln in long_context_md.splitlines() if ln.startswith("|")]
    if not lines:
        return ["| Quality at ~72% less memory (LongBench avg: FP16 / APL 3-bit / PagedWeight) | 17.0% / 12.2% / "
                "17.0% | not measured (`make eval`) | |"]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")), strict=False)) for ln in lines[2:]]
    pick = {"16-bit": ("16-bit", "FP16"), "uniform 3-bit": ("uniform 3-bit", "U3"),
            "PagedWeight": ("pagedweight", "U3")}
    got = {name: next((r for r in rows if r.get("policy") == p and r.get("budget") == b), None)
           for name, (p, b) in pick.items()}
    if any(v is None for v in got.values()):
        return []
    cells = " / ".join(f"{v['retrieval top-1']}, {v['QMSum ppl (vs 16-bit)'].split('(')[-1].rstrip(')')}"
                       for v in got.values() if v)
    mem = " / ".join(f"{v['total MiB']}" for v in got.values() if v)
    paper = " / ".join(f"{s:g}% at {gb:g} GB" for s, gb in LONGBENCH.values())
    return [f"| Quality at less memory, long context (FP16 / APL 3-bit / PagedWeight) | LongBench avg {paper} | "
            f"retrieval top-1, QMSum ppl vs 16-bit: {cells} (total MiB {mem}) | bundled model, "
            f"[docs/eval/long_context.md](eval/long_context.md), uniform 3-bit's budget |"]


def paper_table(serving: list[Record], headline: list[Record], long_context_md: str) -> str:
    """The markdown table: claim | paper | ours | where ours was measured."""
    lines = ["Beside the paper (SPEC section 8; Qwen1.5-MoE-A2.7B):", "",
             "| claim | paper | ours | ours: where, or x FP16 within one run |", "|---|---|---|---|"]
    lines += _headline_rows(headline) + _table3_rows(serving) + _eval_rows(long_context_md)
    return "\n".join(lines)
