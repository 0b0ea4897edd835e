"""``pwcal quantize``: calibrate, quantize every expert linear block to nested AP codes, write the artifact.

What it does: (1) runs the lean model over calibration windows with a ``HessianDiag`` observer;
(2) for every MoE layer, quantizes all routed experts' ``gate_up`` / ``down`` rows (and the shared
expert, an always-active block) with ``nested_kmeans`` weighted by each block's Hessian diagonal
(uniform weights for experts that saw fewer than ``min_tokens`` tokens: reported); (3) packs
bit-planes and writes one safetensors file per layer plus ``manifest.json``, all inside
``OUT.partial/`` that is renamed to ``OUT`` only when complete (an existing ``OUT`` is first renamed to
``OUT.old``, put back if the run stops between the two renames, else removed). A rerun on a complete artifact
with the same model and parameters is a no-op unless ``force``.

Tensor names in ``layer_LLL.safetensors``: ``{e}.{unit}.planes`` int32 [8, N, Kw] and
``{e}.{unit}.lut{b}`` float16 [N, 2^b], e = expert id or ``shared``; format in ``pwrun.ap.format``.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pwcal.calib_data import calibration_windows
from pwcal.manifest import MANIFEST, model_fingerprint, package_version, read_manifest, write_manifest
from pwcal.quant.kmeans1d import nested_kmeans
from pwcal.stats.collect import observe
from pwcal.stats.hessian import HessianDiag
from pwcal.writer_lock import writer_lock
from pwrun.ap.artifact import FORMAT
from pwrun.ap.format import FORMAT_VERSION, PARENT_BITS, SUPPORTED_SEEDS, pack_planes
from pwrun.errors import PagedWeightError
from pwrun.model.inventory import SHARED_EXPERT, LinearBlock, expert_blocks
from pwrun.model.lean import LeanMoEModel
from pwrun.model.loader import load_model, load_tokenizer
from pwrun.model.weights import dense_weight


@dataclass(frozen=True)
class QuantizeConfig:
    """Parameters of one quantization run (all recorded in the manifest).

    ``min_tokens``: experts that saw fewer calibration tokens get uniform k-means weights.
    """

    seed_bits: int = 3
    calib: str = "c4-calib"
    samples: int = 64
    seq_len: int = 512
    calib_seed: int = 0
    min_tokens: int = 16
    kmeans_iters: int = 50

    def __post_init__(self) -> None:
        if self.seed_bits not in SUPPORTED_SEEDS:
            raise PagedWeightError(f"--seed-bits {self.seed_bits} is not supported: use 2 or 3")
        if self.samples < 1 or self.seq_len < 2:
            raise PagedWeightError("--samples must be >= 1 and --seq-len >= 2")
        if self.min_tokens < 1:
            raise PagedWeightError(f"--min-tokens {self.min_tokens} must be >= 1 (an expert that saw no token has no "
                                   "Hessian)")

    @property
    def bits(self) -> list[int]:
        return list(range(self.seed_bits, PARENT_BITS + 1))


def block_key(block: LinearBlock) -> str:
    e = "shared" if block.expert == SHARED_EXPERT else str(block.expert)
    return f"{e}.{block.unit}"


def layer_file(layer: int) -> str:
    return f"layer_{layer:03d}.safetensors"


def collect_hessian(model: LeanMoEModel, windows: list[list[int]], batch: int = 8,
                    progress: Callable[[str, int, int], None] | None = None) -> HessianDiag:
    """Diagonal Hessians of every expert block's inputs over ``windows`` (SPEC section 2)."""
    obs = HessianDiag()
    observe(model, windows, obs, batch=batch, progress=progress)
    return obs


def quantize_rows(w: torch.Tensor, row_weights: torch.Tensor, cfg: QuantizeConfig,
                  max_elements: int = 1 << 24) -> tuple[torch.Tensor, dict]:
    """codes [R, K] uint8 and luts {b: [R, 2^b] fp16} for w [R, K] with k-means weights [R, K].

    Rows are processed in chunks of ``max_elements`` (memory ~130 bytes per element); results do
    not depend on the chunking.
    """
    codes, luts = [], []
    rows = max(1, max_elements // w.shape[1])
    for lo in range(0, w.shape[0], rows):
        nc = nested_kmeans(w[lo:lo + rows], row_weights[lo:lo + rows], cfg.seed_bits, cfg.kmeans_iters)
        codes.append(nc.codes)
        luts.append(nc.luts)
    return torch.cat(codes), {b: torch.cat([x[b] for x in luts]) for b in cfg.bits}


def quantize_layer(blocks: list[LinearBlock], weight_of: Callable[[LinearBlock], torch.Tensor],
                   hessian_of: Callable[[LinearBlock], torch.Tensor | None], cfg: QuantizeConfig,
                   max_elements: int = 1 << 24) -> tuple[dict[str, torch.Tensor], list[LinearBlock]]:
    """All AP tensors (on CPU) of one layer's expert blocks, and the blocks that used uniform weights.

    ``weight_of(block)``: the dense weight [N, K]; ``hessian_of(block)``: k-means weights [K] or
    ``None`` for the uniform fallback. Blocks of the same unit and shape are quantized together
    (rows stacked) for speed. Raises ``PagedWeightError`` if a weight holds NaN or Inf.
    """
    tensors: dict[str, torch.Tensor] = {}
    fallback: list[LinearBlock] = []
    groups: dict[tuple[str, int, int], list[LinearBlock]] = {}
    for b in blocks:
        groups.setdefault((b.unit, b.n, b.k), []).append(b)
    for group in groups.values():
        ws, rw = [], []
        for b in group:
            w = weight_of(b).float()
            if not torch.isfinite(w).all():
                raise PagedWeightError(f"the checkpoint's weight of layer {b.layer}, expert {b.expert}, unit {b.unit} "
                                       "holds NaN or Inf: fix or re-export the checkpoint before quantizing")
            h = hessian_of(b)
            if h is None:
                fallback.append(b)
                h = torch.ones(b.k, dtype=torch.float64, device=w.device)
            ws.append(w)
            rw.append(h.to(w.device).float().expand(b.n, b.k))
        codes, luts = quantize_rows(torch.cat(ws), torch.cat(rw), cfg, max_elements)
        for i, b in enumerate(group):
            rows = slice(i * b.n, (i + 1) * b.n)
            key = block_key(b)
            tensors[f"{key}.planes"] = pack_planes(codes[rows]).cpu().contiguous()
            for bits, lut in luts.items():
                tensors[f"{key}.lut{bits}"] = lut[rows].cpu().contiguous()
    return tensors, fallback


def _manifest(cfg: QuantizeConfig, model_dir: Path, family: str, model_fp: dict[str, str], layers: list[int],
              blocks: list[LinearBlock], fallback: list[LinearBlock], calibration_tokens: int,
              seconds: float) -> dict[str, Any]:
    """The artifact's ``manifest.json`` as the quantize stage writes it."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "parent_bits": PARENT_BITS,
        "seed_bits": cfg.seed_bits,
        "bits": cfg.bits,
        "lut_dtype": "float16",
        "packing": "planes int32 [8, N, ceil(K/32)], plane p = bit 7-p, column k at word k//32 bit k%32",
        "model": {"path": str(model_dir), "family": family, **model_fp},
        "package_version": package_version(),
        "files": {str(layer): layer_file(layer) for layer in layers},
        "stages": {"quantize": {
            "complete": True,
            "config": asdict(cfg),
            "calibration_tokens": calibration_tokens,
            "blocks": len(blocks),
            "fallback_blocks": [[b.layer, b.expert, b.unit] for b in fallback],
            "seconds": round(seconds, 2),
        }},
    }


def _existing_is_complete(out: Path, model_fp: dict[str, str], cfg: QuantizeConfig) -> bool:
    if not (out / MANIFEST).is_file():
        return False
    m = read_manifest(out)
    q = m.get("stages", {}).get("quantize", {})
    same_model = all(m.get("model", {}).get(k) == model_fp[k] for k in ("weights_sha256", "config_sha256"))
    if q.get("complete") and same_model and q.get("config") == asdict(cfg):
        return True
    raise PagedWeightError(f"{out} already holds an artifact of another model or other parameters: pass --force "
                           "to overwrite it or choose another --out")


def quantize(model_dir: Path, out: Path, cfg: QuantizeConfig, device: str = "auto", force: bool = False,
             progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Run the whole quantize stage; returns the manifest (written to ``out``).

    ``progress(stage, done, total)`` is called as calibration windows and layers complete.
    Raises ``PagedWeightError`` for bad input, and when another run is writing ``out`` (``pwcal.writer_lock``);
    nothing is left at ``out`` unless complete.
    """
    t0 = time.time()
    given, out = out, Path(os.path.abspath(out))  # "." and ".." get a name: OUT.partial and OUT.lock sit beside OUT
    if out == Path.cwd().absolute() or not out.name:
        raise PagedWeightError(f"--out {given} is the current directory (or the root): give the name of a new "
                               "directory, e.g. --out artifacts/tiny-ap")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST).is_file())):
        raise PagedWeightError(f"--out {out} exists and is not a PagedWeight artifact directory: choose a new or "
                               "empty directory (it is never overwritten)")
    if not out.parent.is_dir():
        raise PagedWeightError(f"cannot create {out}: the directory {out.parent} does not exist; create it "
                               f"(mkdir -p {out.parent}) or give --out in an existing directory")
    if not os.access(out.parent, os.W_OK):
        raise PagedWeightError(f"cannot create {out}: {out.parent} is not writable; give --out where you can write")
    with writer_lock(out):
        return _quantize_locked(model_dir, out, cfg, device, force, progress, t0)


def _quantize_locked(model_dir: Path, out: Path, cfg: QuantizeConfig, device: str, force: bool,
                     progress: Callable[[str, int, int], None] | None, t0: float) -> dict[str, Any]:
    """``quantize`` once its output checks passed and it holds ``out``'s writer lock (same returns and errors)."""
    from pwrun.model.loader import read_config

    hf_cfg = read_config(model_dir)  # a clear error for a missing or bad checkpoint before hashing anything
    context = getattr(hf_cfg, "max_position_embeddings", None)
    if context is not None and cfg.seq_len > context:
        raise PagedWeightError(f"--seq-len {cfg.seq_len} is longer than the model's context of {context} tokens: "
                               f"give --seq-len in [2, {context}]")
    model_fp = model_fingerprint(model_dir)
    old = out.with_name(out.name + ".old")  # the previous artifact while the new one is renamed into place
    if old.exists() and not out.exists():
        old.replace(out)  # a run killed between its two final renames (SIGKILL: no cleanup ran)
    shutil.rmtree(old, ignore_errors=True)
    if out.exists() and not force and _existing_is_complete(out, model_fp, cfg):
        return {**read_manifest(out), "skipped": True}
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, device=device, dtype="float32")
    windows = calibration_windows(tok, cfg.calib, cfg.samples, min(cfg.seq_len, model.spec.max_position_embeddings),
                                  cfg.calib_seed)
    hess = collect_hessian(model, windows, progress=progress)
    partial = out.with_name(out.name + ".partial")
    fallback: list[LinearBlock] = []
    try:  # from the mkdir on: a SIGTERM right after it (seventeenth session's CI) must remove OUT.partial too
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        blocks = expert_blocks(model.spec)
        layers = sorted({b.layer for b in blocks})
        for i, layer in enumerate(layers):
            tensors, fb = quantize_layer([b for b in blocks if b.layer == layer], lambda b: dense_weight(model, b),
                                         lambda b: hess.weights_for(b, cfg.min_tokens)[0], cfg)
            fallback += fb
            save_file(tensors, str(partial / layer_file(layer)),
                      metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)})
            if progress:
                progress("quantize", i + 1, len(layers))
        manifest = _manifest(cfg, model_dir, model.spec.family, model_fp, layers, blocks, fallback,
                             len(windows) * len(windows[0]), time.time() - t0)
        write_manifest(partial, manifest)
        if out.exists():  # two renames: OUT is always the old artifact or the new one, never half of either
            out.replace(old)
        partial.replace(out)
    except BaseException:
        if old.exists() and not out.exists():
            old.replace(out)  # interrupted between the renames: the previous artifact comes back
        shutil.rmtree(partial, ignore_errors=True)  # never leave a half-written artifact behind
        raise
    shutil.rmtree(old, ignore_errors=True)
    return manifest
