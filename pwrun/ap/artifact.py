"""Read an Any-Precision artifact written by ``pwcal quantize`` (runtime side).

What it does: validates ``manifest.json`` (``pwformat.manifest``: its fields, the format and version, that
the quantize stage completed; on request that it belongs to a given checkpoint) and gives each layer's
bit-planes and LUTs. It neither quantizes nor builds a model (``pwrun.ap.dense`` does, for the reference path).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pwformat.errors import PagedWeightError
from pwformat.layout import FORMAT, FORMAT_VERSION
from pwformat.manifest import Manifest, check_same_model, read_manifest
from pwrun.model.inventory import SHARED_EXPERT, LinearBlock


class APArtifact:
    """An AP artifact directory. ``bits``: supported bitwidths (seed..8)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest: Manifest = read_manifest(self.path)
        if self.manifest.format != FORMAT or self.manifest.format_version != FORMAT_VERSION:
            raise PagedWeightError(f"{self.path} has format {self.manifest.format} v{self.manifest.format_version}; "
                                   f"this runtime reads {FORMAT} v{FORMAT_VERSION}: re-run pwcal quantize")
        if not self.manifest.complete("quantize"):
            raise PagedWeightError(f"{self.path}: the quantize stage did not complete: re-run pwcal quantize")
        self.bits: list[int] = list(self.manifest.bits)
        self.seed_bits: int = self.manifest.seed_bits

    def check_model(self, model_dir: str | Path) -> None:
        """Raise ``PagedWeightError`` unless this artifact was made from ``model_dir``'s checkpoint."""
        check_same_model(self.manifest, Path(model_dir), self.path)

    def _file(self, layer: int) -> Path:
        name = self.manifest.files.get(str(layer))
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
