"""How good can ANY per-block bit allocation be? An oracle bound for quality target (a) (within 1% of 16-bit
perplexity at <= 30% of the 16-bit expert bytes).

What it does: for every expert linear block i and bitwidth b of an AP artifact, measures the true damage of
putting block i alone at b bits (all other blocks 16-bit): the mean per-token KL(p_16 || p_b) of the next-token
distribution on held-out C4 calibration windows. Assuming damage adds over blocks, the allocation that minimises
total damage under an expert-byte budget (planes + LUTs, SPEC Eq. 3) is found by Lagrangian relaxation, for a
range of budgets given as a share of the experts' 16-bit bytes. Each allocation is then served statically
(dequantized reference path) and scored on WikiText-2 and C4 like ``pwcal eval-uniform``. The same is done with
the artifact's diagonal sensitivity table (SPEC Eq. 2, what the planner ranks by) in place of the measured KL,
so the gap between the planner's proxy and the oracle is visible.

This is an analysis of the artifact (CPU is fine for the bundled tiny model), not a product feature:

    python tools/oracle_allocation.py --artifacts artifacts/runs/tiny-ap --out docs/eval/oracle

Writes ``damage.parquet`` (block, bits, kl, bytes) and ``allocations.md``.
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from pwcal.calib_data import calibration_windows
from pwformat.ap import dequantize
from pwformat.cost import block_bytes
from pwrun.ap.artifact import APArtifact
from pwrun.ap.dense import dense_model
from pwrun.data import read_text
from pwrun.model.inventory import SHARED_EXPERT, LinearBlock, expert_blocks
from pwrun.model.lean import LeanMoEModel
from pwrun.model.loader import load_model, load_tokenizer
from pwrun.model.weights import dense_weight
from pwrun.ppl import perplexity
from pwrun.runner.prefill import prefill_logits

Key = tuple[int, int, str]


def set_block(model: LeanMoEModel, b: LinearBlock, w: torch.Tensor) -> None:
    moe = model.weights.layers[b.layer].moe
    assert moe is not None
    if b.expert == SHARED_EXPERT:
        assert moe.shared is not None
        setattr(moe.shared, b.unit, w)
    else:
        getattr(moe, b.unit)[b.expert] = w


def logprobs(model: LeanMoEModel, windows: list[list[int]], batch: int = 8) -> torch.Tensor:
    """[windows * (seq_len - 1), V] float32 log-probabilities of the next token."""
    seq = len(windows[0])
    out = []
    for lo in range(0, len(windows), batch):
        rows = range(lo, min(len(windows), lo + batch))
        logits = prefill_logits(model, [windows[r] for r in rows]).view(len(rows), seq, -1)[:, :-1]
        out.append(F.log_softmax(logits.float(), -1).flatten(0, 1))
    return torch.cat(out)


def measure_damage(model: LeanMoEModel, art: APArtifact, blocks: list[LinearBlock], windows: list[list[int]]
                   ) -> pd.DataFrame:
    ref = logprobs(model, windows)
    pref = ref.exp()
    rows = []
    t0 = time.time()
    for layer in sorted({b.layer for b in blocks}):
        t = art.layer_tensors(layer, model.device)
        for b in (x for x in blocks if x.layer == layer):
            k = art.key(b)
            orig = dense_weight(model, b).clone()
            for q in art.bits:
                set_block(model, b, dequantize(t[f"{k}.planes"], t[f"{k}.lut{q}"], b.k, q, model.dtype))
                lp = logprobs(model, windows)
                kl = float((pref * (ref - lp)).sum(-1).mean())
                rows.append({"layer": b.layer, "expert": b.expert, "unit": b.unit, "bits": q, "kl": kl,
                             "bytes": block_bytes(b.n, b.k, q, art.seed_bits), "bytes16": 2 * b.n * b.k})
            set_block(model, b, orig)
            print(f"  block {b.layer}/{b.expert}/{b.unit}: kl@3 {rows[-len(art.bits)]['kl']:.2e} "
                  f"kl@8 {rows[-1]['kl']:.2e}  ({time.time() - t0:.0f} s)", flush=True)
    return pd.DataFrame(rows)


def allocate(damage: pd.DataFrame, col: str, budget: float) -> dict[Key, int]:
    """Per-block bitwidth minimising sum(col) with sum(bytes) <= budget (Lagrangian: bisection on lambda)."""
    groups = {k: g.sort_values("bits") for k, g in damage.groupby(["layer", "expert", "unit"])}

    def pick(lam: float) -> tuple[dict[Key, int], float]:
        choice, total = {}, 0.0
        for k, g in groups.items():
            cost = g[col].to_numpy() + lam * g["bytes"].to_numpy()
            j = int(cost.argmin())
            choice[k] = int(g["bits"].iloc[j])
            total += float(g["bytes"].iloc[j])
        return choice, total

    lo, hi = 0.0, 1.0
    while pick(hi)[1] > budget:
        hi *= 4
        if hi > 1e30:
            raise ValueError("budget below every block at its lowest bitwidth")
    for _ in range(100):
        mid = (lo + hi) / 2
        if pick(mid)[1] > budget:
            lo = mid
        else:
            hi = mid
    return pick(hi)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="artifacts/models/tiny-qwen2moe-wiki")
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--calib-windows", type=int, default=16)
    ap.add_argument("--calib-seq", type=int, default=256)
    ap.add_argument("--calib-seed", type=int, default=7, help="c4-calib order; the sensitivity stage used seed 1")
    ap.add_argument("--eval-windows", type=int, default=96)
    ap.add_argument("--rank", default="", help="comma-separated columns to rank by (default: all)")
    ap.add_argument("--shares", default="0.25,0.30,0.35,0.40,0.47,0.55,0.65")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    art = APArtifact(args.artifacts)
    tok = load_tokenizer(args.model)
    model = load_model(args.model, device="cpu", dtype="float32")
    blocks = expert_blocks(model.spec)
    dfile = out / "damage.parquet"
    if dfile.exists():
        damage = pd.read_parquet(dfile)
    else:
        windows = calibration_windows(tok, "c4-calib", args.calib_windows, args.calib_seq, args.calib_seed)
        damage = measure_damage(model, art, blocks, windows)
        damage.to_parquet(dfile)
    sens = pd.read_parquet(Path(args.artifacts) / "sensitivity.parquet")
    damage = damage.merge(sens[["layer", "expert", "unit", "bits", "sensitivity"]], on=["layer", "expert", "unit",
                                                                                       "bits"])
    mass = pd.read_parquet(Path(args.artifacts) / "routing.parquet")
    damage = damage.merge(mass[["layer", "expert", "mass"]], on=["layer", "expert"], how="left")
    damage["mass"] = damage["mass"].fillna(1.0)  # shared expert: every token
    damage["sens_x_mass"] = damage["sensitivity"] * damage["mass"]
    ranks = ["kl", "sensitivity", "sens_x_mass"]
    for extra in sorted(out.glob("rank_*.parquet")):  # more estimates to rank by: one column besides the keys
        more = pd.read_parquet(extra)
        damage = damage.merge(more, on=["layer", "expert", "unit", "bits"])
        ranks += [c for c in more.columns if c not in ("layer", "expert", "unit", "bits")]
    ranks = args.rank.split(",") if args.rank else ranks
    bytes16 = float(damage.groupby(["layer", "expert", "unit"])["bytes16"].first().sum())
    ids = {d: tok(read_text(d), add_special_tokens=False, verbose=False).input_ids for d in ("wikitext2", "c4")}
    base = {d: perplexity(model, x, max_windows=args.eval_windows).ppl for d, x in ids.items()}
    lines = [f"# Oracle per-block allocation ({datetime.date.today()}, CPU)", "",
             f"`python tools/oracle_allocation.py --artifacts {args.artifacts} --out {args.out}` "
             f"(damage: KL on {args.calib_windows} x {args.calib_seq} c4-calib tokens, order seed {args.calib_seed}; "
             f"scores: first {args.eval_windows} windows of 512).", "",
             f"16-bit: WikiText-2 {base['wikitext2']:.3f}, C4 {base['c4']:.3f}.", "",
             "| expert share | ranked by | mean bits | share used | sum of block KL | WikiText-2 ppl | C4 ppl |",
             "|---|---|---|---|---|---|---|"]
    for share in [float(s) for s in args.shares.split(",")]:
        for col in ranks:
            try:
                choice = allocate(damage, col, share * bytes16)
            except ValueError:
                continue
            sel = damage.set_index(["layer", "expert", "unit", "bits"])
            used = sum(sel.loc[(*k, q), "bytes"] for k, q in choice.items())
            kl_sum = sum(sel.loc[(*k, q), "kl"] for k, q in choice.items())
            nw = {k: damage[(damage.layer == k[0]) & (damage.expert == k[1]) & (damage.unit == k[2])]["bytes16"]
                  .iloc[0] for k in choice}
            mean_bits = sum(q * nw[k] for k, q in choice.items()) / sum(nw.values())
            qm = dense_model(art, model, choice)
            p = {d: perplexity(qm, x, max_windows=args.eval_windows).ppl for d, x in ids.items()}
            cells = " | ".join(f"{p[d]:.3f} ({100 * (p[d] / base[d] - 1):+.2f}%)" for d in ("wikitext2", "c4"))
            lines.append(f"| {share:.0%} | {col} | {mean_bits:.2f} | {used / bytes16:.1%} | {kl_sum:.4f} | {cells} |")
            print(lines[-1], flush=True)
    name = f"allocations_{args.rank.replace(',', '_')}.md" if args.rank else "allocations.md"
    (out / name).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
