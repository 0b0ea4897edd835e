"""Benchmark: AP quantization of a full Qwen1.5-MoE-A2.7B-shaped expert set (issue 3 speed target).

What it does: builds, layer by layer, random bf16 expert weights of the real Qwen1.5-MoE-A2.7B
config (24 layers x (60 routed experts + 1 shared); gate_up [2816, 2048], down [2048, 1408];
shared gate_up [11264, 2048], down [2048, 5632]) and random positive Hessian diagonals, runs
the production path (``pwcal.quant.quantize.quantize_layer``: nested weighted k-means, plane
packing, copy to host) and writes each layer's safetensors file, timing everything end to end.
Optionally (``--flash1dkmeans-rows N``) times the PyPI ``flash1dkmeans`` library on N rows of
one gate_up block with the same seed + 5 split levels, against our code on the same rows and
device, to decide which to use by measurement.

Usage::

    python bench/quantize_speed.py --device cuda --out-md bench/results/quantize_h200.md
    python bench/quantize_speed.py --device cpu --layers 1 --experts 2 --flash1dkmeans-rows 64
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from pwcal.quant.kmeans1d import nested_kmeans
from pwcal.quant.quantize import QuantizeConfig, quantize_layer
from pwrun.model.families import qwen2_moe
from pwrun.model.inventory import expert_blocks

CONFIG = Path(__file__).resolve().parents[1] / "tests/fixtures/configs/Qwen__Qwen1.5-MoE-A2.7B/config.json"


def qwen_spec():  # type: ignore[no-untyped-def]
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(CONFIG.read_text())
        return qwen2_moe(AutoConfig.from_pretrained(d))


def flash1d_rows(x: np.ndarray, w: np.ndarray, seed_bits: int = 3) -> float:
    """Seconds for flash1dkmeans: seed k-means + 5 levels of weighted 2-means splits, row by row."""
    from flash1dkmeans import kmeans_1d

    warm = np.sort(np.random.default_rng(0).standard_normal(64))
    kmeans_1d(warm, 8, sample_weights=np.ones(64), is_sorted=True, return_cluster_borders=True)  # numba JIT
    kmeans_1d(warm, 2, sample_weights=np.ones(64), is_sorted=True, return_cluster_borders=True)
    t = time.perf_counter()
    for r in range(x.shape[0]):
        order = np.argsort(x[r])
        xs, ws = x[r][order], w[r][order]
        _, borders = kmeans_1d(xs, 2**seed_bits, sample_weights=ws, is_sorted=True, return_cluster_borders=True)
        intervals = list(itertools.pairwise(borders))
        for _ in range(8 - seed_bits):
            nxt = []
            for lo, hi in intervals:
                if hi - lo < 2:
                    nxt += [(lo, hi), (hi, hi)]
                    continue
                _, b = kmeans_1d(xs[lo:hi], 2, sample_weights=ws[lo:hi], is_sorted=True, return_cluster_borders=True)
                nxt += [(lo, lo + int(b[1])), (lo + int(b[1]), hi)]
            intervals = nxt
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="quantize only the first N layers")
    ap.add_argument("--experts", type=int, default=None, help="only the first N routed experts per layer")
    ap.add_argument("--max-elements", type=int, default=1 << 26)
    ap.add_argument("--flash1dkmeans-rows", type=int, default=0)
    ap.add_argument("--out-md", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    spec = qwen_spec()
    blocks = [b for b in expert_blocks(spec) if args.experts is None or b.expert < args.experts]
    layers = sorted({b.layer for b in blocks})[: args.layers]
    cfg = QuantizeConfig()
    gen = torch.Generator(device=dev).manual_seed(0)
    result: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "layers": len(layers),
                    "blocks": 0, "weights": 0, "layer_seconds": []}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory() as out:
        sync()
        t0 = time.perf_counter()
        for layer in layers:
            lb = [b for b in blocks if b.layer == layer]
            tl = time.perf_counter()

            def weight(b, gen=gen):  # type: ignore[no-untyped-def]
                return (torch.randn(b.n, b.k, generator=gen, device=dev) * 0.02).to(torch.bfloat16)

            def hessian(b, gen=gen):  # type: ignore[no-untyped-def]
                return torch.rand(b.k, generator=gen, device=dev, dtype=torch.float64) ** 2 + 1e-3

            tensors, _ = quantize_layer(lb, weight, hessian, cfg, args.max_elements)
            save_file(tensors, f"{out}/layer_{layer:03d}.safetensors")
            sync()
            result["layer_seconds"].append(round(time.perf_counter() - tl, 3))
            result["blocks"] += len(lb)
            result["weights"] += sum(b.n * b.k for b in lb)
            print(f"layer {layer}: {len(lb)} blocks in {result['layer_seconds'][-1]:.2f} s", flush=True)
        result["total_seconds"] = round(time.perf_counter() - t0, 2)
    if args.flash1dkmeans_rows:
        n = args.flash1dkmeans_rows
        x = torch.randn(n, 2048, generator=gen, device=dev) * 0.02
        w = torch.rand(n, 2048, generator=gen, device=dev) ** 2 + 1e-3
        sync()
        t = time.perf_counter()
        nested_kmeans(x, w, 3)
        sync()
        ours = time.perf_counter() - t
        try:
            flash: float | None = flash1d_rows(x.double().cpu().numpy(), w.double().cpu().numpy())
        except ImportError:
            flash = None  # not installed on this machine; the comparison is then ours only
        result["row_compare"] = {"rows": n, "K": 2048, "ours_seconds": round(ours, 4), "ours_device": str(dev),
                                 "flash1dkmeans_seconds": None if flash is None else round(flash, 4),
                                 "flash1dkmeans_device": "cpu (numba)"}
    print(json.dumps(result))
    if args.out_md:
        args.out_md.parent.mkdir(parents=True, exist_ok=True)
        args.out_md.with_suffix(".json").write_text(json.dumps(result, indent=1))
        target = 600.0
        full = len(layers) == spec.num_layers and args.experts is None
        verdict = ("met" if result["total_seconds"] <= target else "MISSED") if full else "n/a (partial model)"
        args.out_md.write_text(
            f"# AP quantization speed, Qwen1.5-MoE-A2.7B shape\n\nCommand: `python bench/quantize_speed.py "
            f"--device {args.device}{f' --layers {args.layers}' if args.layers is not None else ''}"
            f"{f' --experts {args.experts}' if args.experts else ''}"
            f"{f' --flash1dkmeans-rows {args.flash1dkmeans_rows}' if args.flash1dkmeans_rows else ''}`\n\n"
            f"Device: {result['device']}, torch {result['torch']}, {result['date']}\n\n"
            "| layers | blocks | weights | total (s) | per layer (s, mean) | target 600 s |\n"
            "|---|---|---|---|---|---|\n"
            f"| {len(layers)} | {result['blocks']} | {result['weights'] / 1e9:.2f} B | {result['total_seconds']} | "
            f"{np.mean(result['layer_seconds']):.2f} | {verdict} |\n"
            + (f"\nRow comparison on {result['row_compare']['rows']} rows x 2048: ours "
               f"{result['row_compare']['ours_seconds']} s on {result['row_compare']['ours_device']}, flash1dkmeans "
               f"{result['row_compare']['flash1dkmeans_seconds']} s on CPU.\n" if "row_compare" in result else ""))


if __name__ == "__main__":
    main()
