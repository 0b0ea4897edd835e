"""Calibration suite: ``pwcal quantize`` and ``pwcal sensitivity`` stages at a seed model's real shape.

What it does: builds the lean model of a seed config (default Qwen1.5-MoE-A2.7B, 14.3B parameters, 28.6 GB bf16
on the GPU) with random weights, AP-quantizes its experts with the production quantizer (``quantize_layer``,
nested k-means, unit Hessian) into an artifact on local disk, then times the stages of ``pwcal sensitivity`` as
the command runs them: the calibration pass of the lean model over ``--samples`` random-token windows of
``--seq-len`` with Hessian, routing-mass and norm-feature observers, then the column errors of the AP weights at
every bitwidth and the s_i^b / M_i^b table. One record per stage in ``bench/results/calibration.jsonl``.
Random weights: timing only.

Usage::

    python -m bench.calibration [--samples 128] [--seq-len 2048] [--layers N --experts N (smoke runs)]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common import QWEN, environment, random_model, write_records
from pwcal.quant.quantize import QuantizeConfig, layer_file, quantize_layer
from pwcal.sensitivity import block_hessians, sensitivity_table, weighted_sensitivities
from pwcal.stats.collect import Tee, observe
from pwcal.stats.features import NormFeatures
from pwcal.stats.hessian import HessianDiag
from pwcal.stats.routing import RoutingMass
from pwformat.layout import FORMAT, FORMAT_VERSION
from pwrun.ap.artifact import APArtifact
from pwrun.model.inventory import expert_blocks
from pwrun.model.weights import dense_weight


def shrunken_config(config_dir: Path, out: Path, layers: int | None, experts: int | None) -> Path:
    """``config_dir``'s config.json with only the first ``layers`` layers and ``experts`` routed experts (smoke
    runs), written to ``out``; ``config_dir`` itself when neither is given."""
    if layers is None and experts is None:
        return config_dir
    cfg = json.loads((config_dir / "config.json").read_text())
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    if experts is not None:
        for k in ("num_experts", "num_local_experts"):
            if k in cfg:
                cfg[k] = experts
        for k in ("num_experts_per_tok",):
            cfg[k] = min(cfg[k], experts)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-dir", type=Path, default=QWEN)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers (smoke runs)")
    ap.add_argument("--experts", type=int, default=None, help="keep only N routed experts (smoke runs)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--label", default=None)
    ap.add_argument("--out", type=Path, default=None, help="JSONL (default bench/results/calibration.jsonl)")
    args = ap.parse_args()
    env = environment(args.label)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        art_dir, cfg_dir = Path(d) / "art", Path(d) / "cfg"
        art_dir.mkdir()
        cfg_dir.mkdir()
        config = shrunken_config(args.config_dir, cfg_dir, args.layers, args.experts)
        model = random_model(config, torch.bfloat16 if dev.type == "cuda" else torch.float32, args.device)
        spec = model.spec
        blocks = expert_blocks(spec)
        t = time.perf_counter()
        cfg = QuantizeConfig()
        for layer in sorted({b.layer for b in blocks}):
            lb = [b for b in blocks if b.layer == layer]
            tensors, _ = quantize_layer(lb, lambda b: dense_weight(model, b), lambda b: None, cfg, 1 << 26)
            save_file(tensors, str(art_dir / layer_file(layer)))
        (art_dir / "manifest.json").write_text(json.dumps({
            "format": FORMAT, "format_version": FORMAT_VERSION, "bits": cfg.bits, "seed_bits": cfg.seed_bits,
            "files": {str(la): layer_file(la) for la in range(spec.num_layers)},
            "stages": {"quantize": {"complete": True}}}))
        sync()
        times["quantize experts"] = time.perf_counter() - t
        art = APArtifact(art_dir)
        g = torch.Generator().manual_seed(1)
        windows = [torch.randint(0, spec.vocab_size, (args.seq_len,), generator=g).tolist()
                   for _ in range(args.samples)]
        e = max(ls.moe.num_experts for ls in spec.layers if ls.moe is not None)
        hess, mass, feats = HessianDiag(), RoutingMass(spec.num_layers, e), NormFeatures()
        sync()
        t = time.perf_counter()
        observe(model, windows, Tee(hess, mass, feats), batch=args.batch)
        sync()
        times["sensitivity: calibration pass"] = time.perf_counter() - t
        t = time.perf_counter()
        h = block_hessians(hess, blocks, 16)
        sensitivity_table(blocks, h, weighted_sensitivities(model, art, blocks, h), art.bits, art.seed_bits)
        sync()
        times["sensitivity: column errors + table"] = time.perf_counter() - t
    times["sensitivity total"] = times["sensitivity: calibration pass"] + times["sensitivity: column errors + table"]
    base = {"model": args.config_dir.name, "layers": spec.num_layers, "blocks": len(blocks)}
    recs = [{**base, "stage": k, "seconds": round(v, 2),
             **({} if k == "quantize experts" else {"tokens": args.samples * args.seq_len})} for k, v in times.items()]
    write_records("calibration", recs, env, args.out)
    print(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
