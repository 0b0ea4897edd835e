"""Benchmark: ``pwcal sensitivity`` on a Qwen1.5-MoE-A2.7B-shaped model (issue 5 speed target).

What it does: builds the full-size model of the real Qwen1.5-MoE-A2.7B config in memory with
random bf16 weights on the GPU (14.3B parameters, 28.6 GB), AP-quantizes its experts with the
production quantizer (``quantize_layer``) into an artifact on local disk, then times the stages
of ``pwcal sensitivity`` exactly as the command runs them: the calibration pass of the lean
model over ``--samples`` random-token windows of ``--seq-len`` with Hessian, routing-mass and
norm-feature observers, the column errors of the AP weights at every bitwidth, and s_i^b / M_i^b.
Random weights give meaningless quality, so this is timing only.

Usage::

    python bench/calibration_speed.py --samples 128 --seq-len 2048 --out-md bench/results/sensitivity_h200.md
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantize_speed import qwen_spec

from pwcal.quant.quantize import FORMAT, QuantizeConfig, layer_file, quantize_layer
from pwcal.sensitivity import block_hessians, sensitivity_table, weighted_sensitivities
from pwcal.stats.collect import Tee, observe
from pwcal.stats.features import NormFeatures
from pwcal.stats.hessian import HessianDiag
from pwcal.stats.routing import RoutingMass
from pwrun.ap.artifact import APArtifact
from pwrun.ap.format import FORMAT_VERSION
from pwrun.model.inventory import expert_blocks
from pwrun.model.lean import LeanMoEModel
from pwrun.model.weights import AttentionWeights, LayerWeights, MLPWeights, ModelWeights, MoEWeights, dense_weight


def random_model(spec, dev: torch.device, dtype: torch.dtype) -> LeanMoEModel:  # type: ignore[no-untyped-def]
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * scale).to(dtype)

    h, v = spec.hidden_size, spec.vocab_size
    layers = []
    for ls in spec.layers:
        a, m = ls.attention, ls.moe
        qd, kd = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        attn = AttentionWeights(q=r(qd, h), k=r(kd, h), v=r(kd, h), o=r(h, qd), q_bias=r(qd), k_bias=r(kd),
                                v_bias=r(kd))
        moe = MoEWeights(router=r(m.num_experts, h, scale=0.5), gate_up=r(m.num_experts, 2 * m.expert_intermediate, h),
                         down=r(m.num_experts, h, m.expert_intermediate),
                         shared=MLPWeights(r(2 * m.shared_intermediate, h), r(h, m.shared_intermediate)),
                         shared_gate=r(1, h))
        layers.append(LayerWeights(attn_norm=torch.ones(h, device=dev, dtype=dtype),
                                   ffn_norm=torch.ones(h, device=dev, dtype=dtype), attn=attn, moe=moe))
    embed = r(v, h)
    return LeanMoEModel(spec, ModelWeights(embed=embed, lm_head=r(v, h), final_norm=torch.ones(h, device=dev,
                                                                                               dtype=dtype),
                                           layers=layers))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers (smoke runs)")
    ap.add_argument("--experts", type=int, default=None, help="keep only N routed experts (smoke runs)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out-md", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    spec = qwen_spec()
    if args.layers:
        from dataclasses import replace

        spec = replace(spec, layers=spec.layers[: args.layers])
    if args.experts:
        from dataclasses import replace

        spec = replace(spec, layers=tuple(replace(ls, moe=replace(ls.moe, num_experts=args.experts, top_k=min(
            ls.moe.top_k, args.experts))) for ls in spec.layers))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = random_model(spec, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    blocks = expert_blocks(spec)
    times: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        art_dir = Path(d)
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
        times["quantize_experts_s"] = time.perf_counter() - t
        art = APArtifact(art_dir)
        g = torch.Generator().manual_seed(1)
        windows = [torch.randint(0, spec.vocab_size, (args.seq_len,), generator=g).tolist()
                   for _ in range(args.samples)]
        hess, mass, feats = HessianDiag(), RoutingMass(spec.num_layers, spec.layers[0].moe.num_experts), NormFeatures()
        sync()
        t = time.perf_counter()
        observe(model, windows, Tee(hess, mass, feats), batch=args.batch)
        sync()
        times["calibration_pass_s"] = time.perf_counter() - t
        t = time.perf_counter()
        h = block_hessians(hess, blocks, 16)
        table = sensitivity_table(blocks, h, weighted_sensitivities(model, art, blocks, h), art.bits, art.seed_bits)
        sync()
        times["column_errors_and_table_s"] = time.perf_counter() - t
    total = times["calibration_pass_s"] + times["column_errors_and_table_s"]
    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "layers": spec.num_layers, "samples": args.samples,
              "seq_len": args.seq_len, "tokens": args.samples * args.seq_len, "rows": len(table),
              **{k: round(v, 2) for k, v in times.items()}, "sensitivity_total_s": round(total, 2)}
    print(json.dumps(result), flush=True)
    if args.out_md:
        args.out_md.with_suffix(".json").write_text(json.dumps(result, indent=1))
        full = spec.num_layers == 24 and args.samples >= 128 and args.seq_len >= 2048
        verdict = ("met" if total <= 600 else "MISSED") if full else "n/a (smaller run)"
        args.out_md.write_text(
            f"# pwcal sensitivity speed, Qwen1.5-MoE-A2.7B shape (random weights)\n\nCommand: `python "
            f"bench/calibration_speed.py --samples {args.samples} --seq-len {args.seq_len}`\n\nDevice: "
            f"{result['device']}, torch {result['torch']}, {result['date']}\n\n"
            "| tokens | calibration pass (s) | column errors + s_i^b table (s) | sensitivity total (s) | target 600 s |"
            f"\n|---|---|---|---|---|\n| {result['tokens']} | {result['calibration_pass_s']} | "
            f"{result['column_errors_and_table_s']} | {result['sensitivity_total_s']} | {verdict} |\n\n"
            f"(The AP quantization of the experts that sensitivity needs took {result['quantize_experts_s']} s in the "
            "same run; it is the `pwcal quantize` stage, see quantize_h200.md.)\n")


if __name__ == "__main__":
    main()
