"""``pwcal quantize``: calibrate, quantize every expert linear block to nested AP codes, write the artifact.

What it does: (1) runs the lean model over calibration windows with a ``HessianDiag`` observer
(``method = kmeans``, the default) or, per group of layers whose matrices fit ``hessian_memory_gib``, a
``HessianFull`` one (``method = gptq``); (2) for every MoE layer, quantizes all routed experts' ``gate_up`` / ``down``
rows (and the shared expert, an always-active block) with ``nested_kmeans`` weighted by each block's Hessian
diagonal (uniform weights for experts that saw fewer than ``min_tokens`` tokens: reported), then for ``gptq``
refines every bitwidth's codes and LUT with error feedback on the full Hessian (``nested_gptq``); (3) packs
bit-planes and writes one safetensors file per layer (hashed as written: ``pwformat.checksums``) plus
``manifest.json``, all inside ``OUT.partial/`` that is renamed to ``OUT`` only when complete (an existing ``OUT``
is first renamed to ``OUT.old``, removed once the new one is in place). A run killed between those renames is
finished by the next run (``recover_leftovers``). A rerun on a complete artifact with the same model and
parameters is a no-op unless ``force``.

Tensor names in ``layer_LLL.safetensors``: ``{e}.{unit}.planes`` int32 [8, N, Kw] and
``{e}.{unit}.lut{b}`` float16 [N, 2^b], e = expert id or ``shared``; format in ``pwformat.ap``. The header
metadata names the format, the layer and the run's id (``run_id``, also in the manifest and every table).
"""

from __future__ import annotations

import errno
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial as partial_fn
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from pwcal.calib_data import calibration_windows
from pwcal.quant.gptq import nested_gptq
from pwcal.quant.kmeans1d import NestedCodes, nested_kmeans
from pwcal.quant.leftovers import recover_leftovers
from pwcal.stats.collect import observe
from pwcal.stats.hessian import HessianDiag
from pwcal.stats.hessian_full import HessianFull, layer_groups
from pwformat.ap import pack_planes
from pwformat.atomic import default_mode, fault_point
from pwformat.checksums import file_sum, verify_files
from pwformat.errors import PagedWeightError
from pwformat.layout import FORMAT, FORMAT_VERSION, PARENT_BITS, SUPPORTED_SEEDS
from pwformat.manifest import (
    MANIFEST,
    FileSum,
    Manifest,
    ModelRecord,
    config_matches,
    model_fingerprint,
    package_version,
    read_manifest,
    write_manifest,
)
from pwformat.writer_lock import writer_lock
from pwrun.model.inventory import SHARED_EXPERT, LinearBlock, expert_blocks
from pwrun.model.lean import LeanMoEModel
from pwrun.model.loader import load_model, load_tokenizer, read_config
from pwrun.model.weights import dense_weight

METHODS = ("gptq", "kmeans")
# A manifest written before --method existed records a k-means run (its gptq-only options do not count).
PRE_METHOD = {"method": "kmeans"}


@dataclass(frozen=True)
class QuantizeConfig:
    """Parameters of one quantization run (all recorded in the manifest).

    ``min_tokens``: experts that saw fewer calibration tokens get uniform k-means weights (and an identity
    Hessian). ``method``: ``kmeans`` = SqueezeLLM-style nested k-means on the Hessian diagonal (SPEC section 2);
    ``gptq`` = that, then error feedback on the full input Hessian and least-squares LUTs per bitwidth
    (``pwcal.quant.gptq``; ``docs/quantizer.md``). ``damp``: GPTQ's ridge as a fraction of the mean Hessian
    diagonal; ``feedback_bits``: the highest bitwidth quantized with feedback (above it, plain nested splits: the
    least-squares LUT's cost grows with 2^b; with feedback up to 6 bits, 8 bits measured +0.05% / -0.02% on the
    tiny model, feedback at 7-8 bits was not measured).
    ``hessian_memory_gib``: the full Hessians held at once (GiB, float64; more layers -> more
    calibration passes).
    """

    seed_bits: int = 3
    calib: str = "c4-calib"
    samples: int = 64
    seq_len: int = 512
    calib_seed: int = 0
    min_tokens: int = 16
    kmeans_iters: int = 50
    method: str = "kmeans"
    damp: float = 0.01
    feedback_bits: int = 6
    hessian_memory_gib: float = 8.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise PagedWeightError(f"--method {self.method!r} is not one of {', '.join(METHODS)}")
        if not 0 < self.damp < 1:
            raise PagedWeightError(f"--damp {self.damp} must be in (0, 1) (a fraction of the mean Hessian diagonal)")
        if not 2 <= self.feedback_bits <= PARENT_BITS:
            raise PagedWeightError(f"--feedback-bits {self.feedback_bits} must be in [2, {PARENT_BITS}]")
        if not (math.isfinite(self.hessian_memory_gib) and self.hessian_memory_gib > 0):
            raise PagedWeightError(f"--hessian-memory {self.hessian_memory_gib} must be a finite number of GiB > 0")
        if self.method == "gptq" and self.feedback_bits < self.seed_bits:
            raise PagedWeightError(f"--feedback-bits {self.feedback_bits} is below --seed-bits {self.seed_bits}: no "
                                   "bitwidth would get error feedback; give --feedback-bits >= --seed-bits")
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


def feedback_rows(ws: list[torch.Tensor], hs: list[torch.Tensor], row_weights: torch.Tensor,
                  init: tuple[torch.Tensor, dict], cfg: QuantizeConfig, max_elements: int = 1 << 24
                  ) -> tuple[torch.Tensor, dict]:
    """``quantize_rows``' result ``init`` refined by ``nested_gptq`` for blocks ws [N, K] float (same shape) with
    Hessians hs [K, K] float64 and the k-means weights row_weights [len(ws) * N, K] that ``init`` used; blocks
    are processed a few at a time (at most ``max_elements`` weights, at least one block)."""
    n, k = ws[0].shape
    per = max(1, max_elements // (n * k))
    codes, luts = init
    out_codes, out_luts = [], []
    for lo in range(0, len(ws), per):
        hi = min(lo + per, len(ws))
        rows = slice(lo * n, hi * n)
        seed = NestedCodes(codes=codes[rows], luts={b: v[rows] for b, v in luts.items()})
        nc = nested_gptq(torch.stack(ws[lo:hi]), torch.stack(hs[lo:hi]), seed, row_weights[rows], cfg.seed_bits,
                         cfg.damp, cfg.feedback_bits)
        out_codes.append(nc.codes)
        out_luts.append(nc.luts)
    return torch.cat(out_codes), {b: torch.cat([x[b] for x in out_luts]) for b in cfg.bits}


def quantize_layer(blocks: list[LinearBlock], weight_of: Callable[[LinearBlock], torch.Tensor],
                   hessian_of: Callable[[LinearBlock], torch.Tensor | None], cfg: QuantizeConfig,
                   max_elements: int = 1 << 24, full_of: Callable[[LinearBlock], torch.Tensor | None] | None = None
                   ) -> tuple[dict[str, torch.Tensor], list[LinearBlock]]:
    """All AP tensors (on CPU) of one layer's expert blocks, and the blocks that used uniform weights.

    ``weight_of(block)``: the dense weight [N, K]; ``hessian_of(block)``: k-means weights [K] or
    ``None`` for the uniform fallback; ``full_of(block)``: the full Hessian [K, K] for ``method = gptq``
    (``None``: an identity, i.e. no error feedback, for fallback blocks). Blocks of the same unit and shape are
    quantized together (rows stacked) for speed. Raises ``PagedWeightError`` if a weight holds NaN or Inf.
    """
    tensors: dict[str, torch.Tensor] = {}
    fallback: list[LinearBlock] = []
    groups: dict[tuple[str, int, int], list[LinearBlock]] = {}
    for b in blocks:
        groups.setdefault((b.unit, b.n, b.k), []).append(b)
    for group in groups.values():
        ws, rw, hs = [], [], []
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
            if full_of is not None:
                full = full_of(b)
                hs.append(torch.eye(b.k, dtype=torch.float64, device=w.device) if full is None
                          else full.to(w.device))
        row_weights = torch.cat(rw)
        codes, luts = quantize_rows(torch.cat(ws), row_weights, cfg, max_elements)
        if full_of is not None:
            codes, luts = feedback_rows(ws, hs, row_weights, (codes, luts), cfg, max_elements)
        for i, b in enumerate(group):
            rows = slice(i * b.n, (i + 1) * b.n)
            key = block_key(b)
            tensors[f"{key}.planes"] = pack_planes(codes[rows]).cpu().contiguous()
            for bits, lut in luts.items():
                tensors[f"{key}.lut{bits}"] = lut[rows].cpu().contiguous()
    return tensors, fallback


def _result_keys(config: dict[str, Any]) -> dict[str, Any]:
    """The parameters that change a quantize stage's output: not ``hessian_memory_gib`` (calibration passes
    only), nor gptq's ``damp`` / ``feedback_bits`` for a k-means run."""
    unused = {"hessian_memory_gib"} | ({"damp", "feedback_bits"} if config.get("method") == "kmeans" else set())
    return {k: v for k, v in config.items() if k not in unused}


def _save_layer(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``save_file`` whose I/O failures (a full disk) are ``OSError``s naming the file, as every other write's:
    safetensors reports them as its own error with the OS message inside."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        msg = str(exc)
        code = errno.ENOSPC if "No space left" in msg else errno.EDQUOT if "quota" in msg.lower() else errno.EIO
        raise OSError(code, os.strerror(code), str(path)) from exc


def _first(lookup: Callable[[LinearBlock, int], tuple[torch.Tensor | None, int]], min_tokens: int
           ) -> Callable[[LinearBlock], torch.Tensor | None]:
    """``block -> lookup(block, min_tokens)[0]``: a Hessian observer's tensor for a block, without its count."""
    return lambda block: lookup(block, min_tokens)[0]


def _manifest(cfg: QuantizeConfig, model_dir: Path, family: str, model_fp: dict[str, str], layers: list[int],
              blocks: list[LinearBlock], fallback: list[LinearBlock], calibration_tokens: int,
              seconds: float, run_id: str, sums: dict[str, FileSum]) -> Manifest:
    """The artifact's ``manifest.json`` as the quantize stage writes it."""
    return Manifest(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        parent_bits=PARENT_BITS,
        seed_bits=cfg.seed_bits,
        bits=cfg.bits,
        lut_dtype="float16",
        packing="planes int32 [8, N, ceil(K/32)], plane p = bit 7-p, column k at word k//32 bit k%32",
        model=ModelRecord(path=str(Path(model_dir).resolve()), family=family, **model_fp),  # hints work from anywhere
        package_version=package_version(),
        files={str(layer): layer_file(layer) for layer in layers},
        run_id=run_id,
        checksums=sums,
        stages={"quantize": {
            "complete": True,
            "config": asdict(cfg),
            "files": [layer_file(layer) for layer in layers],
            "calibration_tokens": calibration_tokens,
            "blocks": len(blocks),
            "fallback_blocks": [[b.layer, b.expert, b.unit] for b in fallback],
            "seconds": round(seconds, 2),
        }},
    )


def _existing_is_complete(out: Path, model_dir: Path, model_fp: dict[str, str], cfg: QuantizeConfig) -> bool:
    if not (out / MANIFEST).is_file():
        return False
    m = read_manifest(out)
    q = m.stage("quantize")
    same_model = (m.model.weights_sha256 == model_fp["weights_sha256"]
                  and config_matches(m.model.config_sha256, model_dir / "config.json"))
    recorded = {**PRE_METHOD, **q.get("config", {})}  # artifacts from before --method were k-means ones
    if q.get("complete") and same_model and _result_keys(recorded) == _result_keys(asdict(cfg)):
        if m.checksums is not None:  # the skip vouches for the layer files and the quantize tables
            verify_files(out, m.checksums, m.checked_files("sensitivity"), m.model.path)
        return True
    raise PagedWeightError(f"{out} already holds an artifact of another model or other parameters: pass --force "
                           "to overwrite it or choose another --out")


def quantize(model_dir: Path, out: Path, cfg: QuantizeConfig, device: str = "auto", force: bool = False,
             progress: Callable[[str, int, int], None] | None = None,
             notice: Callable[[str], None] = lambda _line: None) -> dict[str, Any]:
    """Run the whole quantize stage; returns the manifest (written to ``out``).

    ``progress(stage, done, total)`` is called as calibration windows and layers complete; ``notice(line)`` with
    what was done about a killed run's leftovers (``recover_leftovers``).
    Raises ``PagedWeightError`` for bad input, and when another run is writing ``out`` (``pwformat.writer_lock``);
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
        recover_leftovers(out, notice)
        return _quantize_locked(model_dir, out, cfg, device, force, progress, t0)


def _quantize_locked(model_dir: Path, out: Path, cfg: QuantizeConfig, device: str, force: bool,
                     progress: Callable[[str, int, int], None] | None, t0: float) -> dict[str, Any]:
    """``quantize`` once its output checks passed and it holds ``out``'s writer lock (same returns and errors)."""
    hf_cfg = read_config(model_dir)  # a clear error for a missing or bad checkpoint before hashing anything
    context = getattr(hf_cfg, "max_position_embeddings", None)
    if context is not None and cfg.seq_len > context:
        raise PagedWeightError(f"--seq-len {cfg.seq_len} is longer than the model's context of {context} tokens: "
                               f"give --seq-len in [2, {context}]")
    model_fp = model_fingerprint(model_dir)
    old = out.with_name(out.name + ".old")  # the previous artifact while the new one is renamed into place
    if out.exists() and not force and _existing_is_complete(out, Path(model_dir), model_fp, cfg):
        return {**read_manifest(out).to_dict(), "skipped": True}
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, device=device, dtype="float32", experts="stream")  # experts layer by layer
    model_fp["weights_served"] = model.weights.source_digest  # the non-expert reads, as serving makes them
    assert model_fp["weights_served"], "experts='stream' loads with a digest"
    windows = calibration_windows(tok, cfg.calib, cfg.samples, min(cfg.seq_len, model.spec.max_position_embeddings),
                                  cfg.calib_seed, vocab_size=model.spec.vocab_size)
    blocks = expert_blocks(model.spec)
    groups = ([sorted({b.layer for b in blocks})] if cfg.method == "kmeans" else
              layer_groups(blocks, int(cfg.hessian_memory_gib * 2**30)))
    hess = collect_hessian(model, windows, progress=progress) if cfg.method == "kmeans" else None
    partial = out.with_name(out.name + ".partial")
    fallback: list[LinearBlock] = []
    run_id = uuid.uuid4().hex
    sums: dict[str, FileSum] = {}
    try:  # from the mkdir on: a SIGTERM right after it must remove OUT.partial too
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        layers = sorted({b.layer for b in blocks})
        done = 0
        if progress:
            progress("quantize", 0, len(layers))
        for group in groups:
            full: HessianFull | None = None
            if cfg.method == "gptq":  # one calibration pass per group of layers whose full Hessians fit
                full = HessianFull(set(group))
                observe(model, windows, full, progress=progress)
            obs: HessianFull | HessianDiag | None = full if full is not None else hess
            assert obs is not None
            for layer in group:
                tensors, fb = quantize_layer(
                    [b for b in blocks if b.layer == layer], partial_fn(dense_weight, model),
                    _first(obs.weights_for, cfg.min_tokens), cfg,
                    full_of=None if full is None else _first(full.matrix_for, cfg.min_tokens))
                fallback += fb
                path = partial / layer_file(layer)
                _save_layer(tensors, path, {"format": FORMAT, "format_version": str(FORMAT_VERSION),
                                            "layer": str(layer), "run_id": run_id})
                default_mode(path)
                fault_point()
                sums[path.name] = file_sum(path, "quantize", layer)  # read back while in the page cache
                done += 1
                if progress:
                    progress("quantize", done, len(layers))
            del full
        manifest = _manifest(cfg, model_dir, model.spec.family, model_fp, layers, blocks, fallback,
                             len(windows) * len(windows[0]), time.time() - t0, run_id, sums)
        write_manifest(partial, manifest)
        if out.exists():  # two renames: OUT is always the old artifact or the new one, never half of either
            fault_point()
            out.replace(old)
        fault_point()
        partial.replace(out)
    except BaseException:
        if old.exists() and not out.exists():
            old.replace(out)  # interrupted between the renames: the previous artifact comes back
        shutil.rmtree(partial, ignore_errors=True)  # never leave a half-written artifact behind
        raise
    fault_point()
    shutil.rmtree(old, ignore_errors=True)
    return manifest.to_dict()
