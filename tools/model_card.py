"""Measure the bundled tiny MoE with the project's own code and write its model card.

What it does: WikiText-2 test and C4 (evaluation sample) perplexity with ``pwrun.ppl``; the
oracle unigram baseline (entropy of the test set's own token distribution: no unigram model can
do better); routing mass per (layer, expert) on WikiText-2 (SPEC Eq. 1, ``pwcal.stats``); and a
quantization-sensitivity probe: every expert linear fake-quantized to b bits by plain per-row
1-D k-means with nested upscaling (``pwcal.quant.kmeans1d``, uniform weights: no Hessian), then
WikiText-2 perplexity. Writes ``eval.json`` and ``README.md`` next to the model.

Usage::

    python tools/model_card.py [--model artifacts/models/tiny-qwen2moe-wiki] [--probe-windows 200]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path

import numpy as np
import torch

from pwcal.quant.kmeans1d import nested_kmeans
from pwcal.stats.routing import RoutingMass
from pwrun.data import default_model_dir, read_text
from pwrun.model.inventory import parameter_counts
from pwrun.model.lean import LeanMoEModel
from pwrun.model.loader import load_model, load_tokenizer
from pwrun.ppl import perplexity


def fake_quantize_experts(model: LeanMoEModel, bits: int) -> LeanMoEModel:
    """Every expert linear at ``bits`` via the AP quantizer with uniform k-means weights (no Hessian)."""
    out = copy.deepcopy(model)

    def q(t: torch.Tensor) -> torch.Tensor:
        nc = nested_kmeans(t, torch.ones_like(t), seed_bits=min(bits, 3))
        return nc.luts[bits].float().gather(1, nc.codes.long() >> (8 - bits))

    for layer in out.weights.layers:
        m = layer.moe
        if m is None:
            continue
        for name in ("gate_up", "down"):
            t = getattr(m, name)
            setattr(m, name, q(t.flatten(0, 1)).view_as(t))
        if m.shared is not None:
            m.shared.gate_up = q(m.shared.gate_up)
            m.shared.down = q(m.shared.down)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_model_dir())
    ap.add_argument("--probe-windows", type=int, default=200)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = load_tokenizer(args.model)
    model = load_model(args.model, device="cpu", dtype="float32")
    spec = model.spec
    wt = tok(read_text("wikitext2"), add_special_tokens=False, verbose=False).input_ids
    c4 = tok(read_text("c4"), add_special_tokens=False, verbose=False).input_ids
    moe = next(layer.moe for layer in spec.layers if layer.moe is not None)
    assert moe is not None
    obs = RoutingMass(spec.num_layers, moe.num_experts)
    res = {"wikitext2": perplexity(model, wt, args.seq_len, observer=obs), "c4": perplexity(model, c4, args.seq_len)}
    counts = np.bincount(np.asarray(wt), minlength=spec.vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    unigram = math.exp(-(p * np.log(p)).sum())
    mass = obs.mass()
    ent = -(mass * np.log(np.where(mass > 0, mass, 1))).sum(1) / math.log(moe.num_experts)
    probe = {"16": perplexity(model, wt, args.seq_len, max_windows=args.probe_windows).ppl}
    for bits in (8, 4, 3, 2):
        probe[str(bits)] = perplexity(fake_quantize_experts(model, bits), wt, args.seq_len,
                                      max_windows=args.probe_windows).ppl
        print(f"probe {bits} bits: {probe[str(bits)]:.2f} (16-bit {probe['16']:.2f})", flush=True)
    out = {
        "seq_len": args.seq_len,
        "wikitext2_test": {"ppl": res["wikitext2"].ppl, "tokens": res["wikitext2"].tokens},
        "c4_eval_sample": {"ppl": res["c4"].ppl, "tokens": res["c4"].tokens},
        "wikitext2_oracle_unigram_ppl": unigram,
        "routing_mass_wikitext2": mass.round(4).tolist(),
        "routing_mass_max_over_mean": (mass.max(1) * moe.num_experts).round(3).tolist(),
        "routing_mass_normalized_entropy": ent.round(3).tolist(),
        "probe_windows": args.probe_windows,
        "probe_kmeans_ppl": probe,
        "parameters": parameter_counts(spec),
    }
    (args.model / "eval.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if "routing_mass_wikitext2" != k}, indent=1))


if __name__ == "__main__":
    main()
