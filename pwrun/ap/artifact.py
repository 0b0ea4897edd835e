"""Read an Any-Precision artifact written by ``pwcal quantize`` (runtime side).

What it does: validates ``manifest.json`` (format, version, that it belongs to the given model,
that the quantize stage completed), gives each block's bit-planes and LUTs, and builds dense
expert weights at a chosen bitwidth through the reference dequantization (the CPU path of the
runtime and the uniform-precision baselines). It does not quantize.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pwrun.ap.format import FORMAT_VERSION, dequantize
from pwrun.errors import PagedWeightError
from pwrun.model.inventory import SHARED_EXPERT, LinearBlock, expert_blocks
from pwrun.model.lean import LeanMoEModel

FORMAT = "pagedweight-ap"


class APArtifact:
    """An AP artifact directory. ``bits``: supported bitwidths (seed..8)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        mf = self.path / "manifest.json"
        if not mf.is_file():
            raise PagedWeightError(f"{self.path} is not a PagedWeight artifact (no manifest.json): run "
                                   "`pwcal run-all MODEL --out DIR` (or its first stage, `pwcal quantize`) first")
        try:
            self.manifest: dict[str, Any] = json.loads(mf.read_text())
        except json.JSONDecodeError as exc:
            raise PagedWeightError(f"{mf} is corrupt ({exc.msg}): re-run pwcal quantize with --force") from exc
        if not isinstance(self.manifest, dict) or not all(
                isinstance(self.manifest.get(k, {}), dict) for k in ("stages", "model", "files")):
            raise PagedWeightError(f"{mf} is corrupt (not the JSON object pwcal writes): re-run pwcal quantize with "
                                   "--force")
        if self.manifest.get("format") != FORMAT or self.manifest.get("format_version") != FORMAT_VERSION:
            raise PagedWeightError(f"{self.path} has format {self.manifest.get('format')} v"
                                   f"{self.manifest.get('format_version')}; this runtime reads {FORMAT} "
                                   f"v{FORMAT_VERSION}: re-run pwcal quantize")
        if not self.manifest.get("stages", {}).get("quantize", {}).get("complete"):
            raise PagedWeightError(f"{self.path}: the quantize stage did not complete: re-run pwcal quantize")
        self.bits: list[int] = list(self.manifest["bits"])
        self.seed_bits: int = int(self.manifest["seed_bits"])

    def check_model(self, model_dir: str | Path) -> None:
        """Raise ``PagedWeightError`` unless this artifact was made from ``model_dir``'s checkpoint."""
        from pwcal.manifest import check_same_model

        check_same_model(self.manifest, Path(model_dir), self.path)

    def _file(self, layer: int) -> Path:
        name = self.manifest["files"].get(str(layer))
        if name is None or not (self.path / name).is_file():
            raise PagedWeightError(f"{self.path}: file of layer {layer} is missing: re-run pwcal quantize --force")
        return self.path / name

    def layer_tensors(self, layer: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Every tensor of one layer's file (names as in ``pwcal.quant.quantize``)."""
        try:
            with safe_open(str(self._file(layer)), framework="pt", device=str(device)) as f:
                return {k: f.get_tensor(k) for k in f.keys()}
        except (SafetensorError, OSError) as exc:
            raise PagedWeightError(f"{self._file(layer)} is unreadable ({exc}): re-run pwcal quantize --force") from exc

    @staticmethod
    def key(block: LinearBlock) -> str:
        return f"{'shared' if block.expert == SHARED_EXPERT else block.expert}.{block.unit}"

    def dense_model(self, model: LeanMoEModel, bits: int | dict[tuple[int, int, str], int]) -> LeanMoEModel:
        """A copy of ``model`` whose expert weights are dequantized AP weights.

        ``bits``: one bitwidth for every block, or a map (layer, expert, unit) -> bitwidth.
        Raises ``PagedWeightError`` for an unsupported bitwidth.
        """
        out = LeanMoEModel(model.spec, copy.copy(model.weights))
        out.weights.layers = [copy.copy(layer) for layer in model.weights.layers]
        blocks = expert_blocks(model.spec)
        for layer in sorted({b.layer for b in blocks}):
            lw = out.weights.layers[layer]
            assert lw.moe is not None
            moe = copy.copy(lw.moe)
            moe.gate_up, moe.down = moe.gate_up.clone(), moe.down.clone()
            if moe.shared is not None:
                moe.shared = copy.copy(moe.shared)
            lw.moe = moe
            t = self.layer_tensors(layer, model.device)
            for b in (x for x in blocks if x.layer == layer):
                q = bits if isinstance(bits, int) else bits[(b.layer, b.expert, b.unit)]
                if q not in self.bits:
                    raise PagedWeightError(f"bitwidth {q} is not in this artifact's {self.bits}")
                k = self.key(b)
                w = dequantize(t[f"{k}.planes"], t[f"{k}.lut{q}"], b.k, q, model.dtype)
                if b.expert == SHARED_EXPERT:
                    assert moe.shared is not None
                    setattr(moe.shared, b.unit, w)
                else:
                    getattr(moe, b.unit)[b.expert] = w
        return out
