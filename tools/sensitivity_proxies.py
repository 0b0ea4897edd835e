"""Which offline damage estimate ranks (block, bitwidth) like the measured oracle KL? (quality target (a))

What it does: one calibration pass (the sensitivity stage's default: 64 x 512 c4-calib tokens, order seed 1)
collects, per expert linear block i and bitwidth b of an AP artifact, several estimates of the damage of block i
at b bits:

- ``diag``: SPEC Eq. 2, s = sum_j h_j e_j with h the input Hessian diagonal (what ``pwcal sensitivity`` writes);
- ``full``: tr(dW H dW^T) with the full input Hessian H = X^T X (cross terms between input columns);
- ``full_r2``: the same with every token weighted by its squared routing weight (the expert's output is r * y);
- ``out_r2``: the expert's actual output error, sum_t r_t^2 ||y_t - y_t^b||^2, with only unit u of the expert at
  b bits (for gate_up this passes through SiLU-and-mul and the 16-bit down projection);
- ``fisher``: sum F (W - W^b)^2 with the Fisher diagonal of ``pwcal.stats.fisher`` (``--importance fisher``);

and compares them with the oracle KL of ``tools/oracle_allocation.py`` (``damage.parquet``): rank correlation over
all (block, b) and within each bitwidth, and the perplexity of the allocations each estimate picks.

    python tools/sensitivity_proxies.py --artifacts artifacts/runs/tiny-ap --oracle docs/eval/oracle
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from pwcal.calib_data import calibration_windows
from pwcal.sensitivity import weighted_sensitivities, with_fallback
from pwcal.stats.collect import observe
from pwcal.stats.fisher import fisher_diagonal
from pwformat.ap import dequantize
from pwrun.ap.artifact import APArtifact
from pwrun.model.inventory import SHARED_EXPERT, LinearBlock, expert_blocks
from pwrun.model.lean import LeanMoEModel
from pwrun.model.loader import load_model, load_tokenizer
from pwrun.model.weights import dense_weight


class Proxies:
    """Accumulates the four estimates per (layer, expert, unit, bits)."""

    def __init__(self, model: LeanMoEModel, art: APArtifact) -> None:
        self.model, self.art = model, art
        self.deq: dict[tuple[int, int, str], dict[int, torch.Tensor]] = {}
        for layer in sorted({b.layer for b in expert_blocks(model.spec)}):
            t = art.layer_tensors(layer, model.device)
            for b in (x for x in expert_blocks(model.spec) if x.layer == layer):
                k = art.key(b)
                self.deq[(b.layer, b.expert, b.unit)] = {
                    q: dequantize(t[f"{k}.planes"], t[f"{k}.lut{q}"], b.k, q, model.dtype) for q in art.bits}
        self.h: dict[tuple[int, int, str], torch.Tensor] = {}
        self.hr: dict[tuple[int, int, str], torch.Tensor] = {}
        self.out: dict[tuple[int, int, str, int], float] = {}
        self.tokens: dict[tuple[int, int], int] = {}

    def routing(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        pass

    def weights(self, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(dense_weight(self.model, LinearBlock(layer, expert, u, 0, 0))  # type: ignore[return-value]
                     for u in ("gate_up", "down"))

    def expert_inputs(self, layer: int, expert: int, x: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        self.tokens[(layer, expert)] = self.tokens.get((layer, expert), 0) + x.shape[0]
        r = w.double()
        if expert == SHARED_EXPERT:
            moe = self.model.weights.layers[layer].moe
            assert moe is not None
            if moe.shared_gate is not None:
                r = torch.sigmoid(F.linear(x, moe.shared_gate)).double().squeeze(-1)
        for unit, inp in (("gate_up", x), ("down", h)):
            key = (layer, expert, unit)
            a = inp.double()
            ar = a * r[:, None]
            self.h[key] = self.h.get(key, 0) + a.T @ a
            self.hr[key] = self.hr.get(key, 0) + ar.T @ ar
        _, dn = self.weights(layer, expert)
        y = F.linear(h, dn)
        for q in self.art.bits:
            g, u = F.linear(x, self.deq[(layer, expert, "gate_up")][q]).chunk(2, dim=-1)
            yq = F.linear(F.silu(g) * u, dn)
            self._add((layer, expert, "gate_up", q), ((y - yq).double().pow(2).sum(1) * r * r).sum())
            yq = F.linear(h, self.deq[(layer, expert, "down")][q])
            self._add((layer, expert, "down", q), ((y - yq).double().pow(2).sum(1) * r * r).sum())

    def _add(self, key: tuple[int, int, str, int], v: torch.Tensor) -> None:
        self.out[key] = self.out.get(key, 0.0) + float(v)

    def table(self) -> pd.DataFrame:
        rows = []
        for (layer, expert, unit), byb in self.deq.items():
            key = (layer, expert, unit)
            w = self.weights(layer, expert)[0 if unit == "gate_up" else 1].double()
            for q, wq in byb.items():
                d = w - wq.double()
                full = float(((d @ self.h[key]) * d).sum()) if key in self.h else 0.0
                full_r2 = float(((d @ self.hr[key]) * d).sum()) if key in self.hr else 0.0
                rows.append({"layer": layer, "expert": expert, "unit": unit, "bits": q, "full": full,
                             "full_r2": full_r2, "out_r2": self.out.get((layer, expert, unit, q), 0.0)})
        return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="artifacts/models/tiny-qwen2moe-wiki")
    ap.add_argument("--artifacts", required=True)
    ap.add_argument("--oracle", required=True, help="folder of damage.parquet (tools/oracle_allocation.py)")
    args = ap.parse_args()
    art = APArtifact(args.artifacts)
    tok = load_tokenizer(args.model)
    model = load_model(args.model, device="cpu", dtype="float32")
    pfile = Path(args.oracle) / "proxies.parquet"
    if pfile.exists():
        prox = pd.read_parquet(pfile)
    else:
        obs = Proxies(model, art)
        windows = calibration_windows(tok, "c4-calib", 64, 512, 1)
        observe(model, windows, obs)
        prox = obs.table()
        blocks = expert_blocks(model.spec)
        imp = with_fallback(fisher_diagonal(model, windows, blocks), obs.tokens, blocks, 16)
        fisher = weighted_sensitivities(model, art, blocks, imp)
        prox["fisher"] = [fisher[(la, e, u)][art.bits.index(q)] for la, e, u, q in
                          prox[["layer", "expert", "unit", "bits"]].itertuples(index=False)]
        prox.to_parquet(pfile)
    keys = ["layer", "expert", "unit", "bits"]
    dmg = pd.read_parquet(Path(args.oracle) / "damage.parquet").merge(prox, on=keys)
    sens = pd.read_parquet(Path(args.artifacts) / "sensitivity.parquet")[[*keys, "sensitivity"]]
    dmg = dmg.merge(sens, on=keys).rename(columns={"sensitivity": "diag"})
    cols = ["diag", "full", "full_r2", "out_r2", "fisher"]
    print("Spearman rank correlation with the oracle KL")
    print("all", {c: round(dmg["kl"].corr(dmg[c], method="spearman"), 3) for c in cols})
    for q, g in dmg.groupby("bits"):
        print(f"{q} bits", {c: round(g["kl"].corr(g[c], method="spearman"), 3) for c in cols})
    # the planner's damage is the increase from b to b' (Eq. 4): per block, against its 8-bit value
    dmg = dmg.sort_values(keys)
    for c in ["kl", *cols]:
        dmg[f"g_{c}"] = dmg[c] - dmg.groupby(["layer", "expert", "unit"])[c].transform("min")
    g = dmg[dmg.bits < 8]
    print("transitions to b (increase over the block's best):",
          {c: round(g["g_kl"].corr(g[f"g_{c}"], method="spearman"), 3) for c in cols})


if __name__ == "__main__":
    main()
