"""Read an Any-Precision artifact written by ``pwcal`` (runtime side), trusting nothing it has not checked.

What it does: validates ``manifest.json`` (``pwformat.manifest``: its fields, the format and version, that the
quantize stage completed; on request that it belongs to a given checkpoint), refuses the artifact while a pwcal
stage is writing it (``pwformat.writer_lock.check_no_writer``), and checks every recorded file's size on opening;
``verify`` re-hashes the contents (``pwformat.checksums``). Each layer file's header names its layer and the
quantize run that wrote it, and every table records the model's fingerprint and that run's id; ``layer_tensors``
and ``table`` check both against the manifest (and a table's bytes against its checksum), so a file from another
layer, run or model is refused even unverified. It neither quantizes nor builds a model (``pwrun.ap.dense`` does,
for the reference path).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from safetensors import SafetensorError, safe_open

from pwformat.checksums import Progress, remake_command, verify_files
from pwformat.errors import PagedWeightError
from pwformat.layout import FORMAT, FORMAT_VERSION, PARENT_BITS
from pwformat.manifest import Manifest, check_same_model, read_manifest
from pwformat.tables import WRITTEN_BY, read_table
from pwformat.writer_lock import check_no_writer
from pwrun.model.inventory import SHARED_EXPERT, LinearBlock

NO_CHECKSUMS = ("{path} has no content checksums (made before they existed), so its files cannot be verified: "
                "`pwcal verify {path} --update` records them from the files as they are now")


class LayerTensors(dict[str, torch.Tensor]):
    """One layer file's tensors by name; looking up a name the file lacks (a damaged header, another model's file)
    raises a one-line ``PagedWeightError`` naming the file and ``remake``, not a ``KeyError``."""

    def __init__(self, tensors: dict[str, torch.Tensor], path: Path, remake: str) -> None:
        super().__init__(tensors)
        self.path, self.remake = path, remake

    def __missing__(self, key: str) -> torch.Tensor:
        raise PagedWeightError(f"{self.path} has no tensor {key!r} (a damaged header or another model's file): "
                               f"{self.remake}")


class APArtifact:
    """An AP artifact directory. ``bits``: supported bitwidths (seed..8). Raises ``PagedWeightError`` if the
    manifest is invalid, a stage is writing the directory, or a recorded file is missing or has another size."""

    def __init__(self, path: str | Path, before: str | None = None) -> None:
        """``before``: a pwcal stage opening the artifact it writes: only the files of the stages before it are
        checked (it remakes its own and the later stages' outputs, so their damage must not stop it)."""
        self.path = Path(path)
        check_no_writer(self.path)
        self.manifest: Manifest = read_manifest(self.path)
        if self.manifest.format != FORMAT or self.manifest.format_version != FORMAT_VERSION:
            raise PagedWeightError(f"{self.path} has format {self.manifest.format} v{self.manifest.format_version}; "
                                   f"this runtime reads {FORMAT} v{FORMAT_VERSION}: re-run pwcal quantize")
        if not self.manifest.complete("quantize"):
            raise PagedWeightError(f"{self.path}: the quantize stage did not complete: re-run pwcal quantize")
        self.bits: list[int] = list(self.manifest.bits)
        self.seed_bits: int = self.manifest.seed_bits
        self.verified = False
        if self.manifest.checksums is not None:
            verify_files(self.path, self.manifest.checksums, self.manifest.checked_files(before),
                         self.manifest.model.path, hashes=False)

    @property
    def no_checksums_warning(self) -> str | None:
        """The one-line warning for an artifact from before checksums (None if it has them)."""
        return None if self.manifest.checksums is not None else NO_CHECKSUMS.format(path=self.path)

    def checked_bytes(self) -> int:
        """Bytes ``verify`` reads."""
        sums = self.manifest.checksums or {}
        return sum(sums[f].size for f in self.manifest.checked_files() if f in sums)

    def verify(self, on_bytes: Progress | None = None) -> None:
        """Re-hash every layer file and every complete stage's table against the manifest (nothing for an artifact
        without checksums); raises ``PagedWeightError`` naming the first bad file and the command that remakes it.
        ``on_bytes(n)``: progress in bytes."""
        if self.manifest.checksums is not None:
            verify_files(self.path, self.manifest.checksums, self.manifest.checked_files(), self.manifest.model.path,
                         on_bytes=on_bytes)
        self.verified = True

    def check_model(self, model_dir: str | Path) -> None:
        """Raise ``PagedWeightError`` unless this artifact was made from ``model_dir``'s checkpoint."""
        check_same_model(self.manifest, Path(model_dir), self.path)

    def _remake(self, stage: str) -> str:
        return f"remake it with {remake_command(stage, self.manifest.model.path, self.path)}"

    def _file(self, layer: int) -> Path:
        name = self.manifest.files.get(str(layer))
        if name is None or not (self.path / name).is_file():
            raise PagedWeightError(f"{self.path}: file of layer {layer} is missing: {self._remake('quantize')}")
        return self.path / name

    def layer_tensors(self, layer: int, device: torch.device | str = "cpu") -> LayerTensors:
        """Every tensor of one layer's file (names and dtypes as in ``pwcal.quant.quantize``), after checking that
        its header names this layer and this artifact's quantize run and each tensor's dtype."""
        path = self._file(layer)
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                meta = f.metadata() or {}
                if self.manifest.run_id is not None and (meta.get("layer"), meta.get("run_id")) != (
                        str(layer), self.manifest.run_id):
                    raise PagedWeightError(
                        f"{path} holds layer {meta.get('layer')} of quantize run {meta.get('run_id')}, not layer "
                        f"{layer} of this artifact's run {self.manifest.run_id} (a swapped or foreign file): "
                        f"{self._remake('quantize')}")
                tensors = LayerTensors({k: f.get_tensor(k) for k in f.keys()}, path, self._remake("quantize"))
        except (SafetensorError, OSError) as exc:
            raise PagedWeightError(f"{path} is unreadable ({exc}): {self._remake('quantize')}") from exc
        lut = getattr(torch, self.manifest.lut_dtype, None)
        for k, v in tensors.items():  # a damaged header can name another dtype of the same size
            want = torch.int32 if k.endswith(".planes") else lut if ".lut" in k else None
            if isinstance(want, torch.dtype) and v.dtype != want:
                raise PagedWeightError(f"{path}: tensor {k!r} is {v.dtype}, not {want} (a damaged header): "
                                       f"{self._remake('quantize')}")
        for k, v in tensors.items():  # ... or another shape of the same size: planes and LUTs must agree
            if not k.endswith(".planes"):
                continue
            block, rows = k.removesuffix(".planes"), v.shape[1] if v.dim() == 3 else -1
            shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
                k: (tuple(v.shape), (PARENT_BITS, rows, v.shape[-1]))}
            shapes |= {f"{block}.lut{b}": (tuple(tensors[f"{block}.lut{b}"].shape), (rows, 2**b)) for b in self.bits
                       if f"{block}.lut{b}" in tensors}
            for name, (got, want_shape) in shapes.items():
                if got != want_shape or rows < 1:
                    raise PagedWeightError(f"{path}: tensor {name!r} has shape {list(got)}, not {list(want_shape)} "
                                           f"(a damaged header): {self._remake('quantize')}")
        return tensors

    def table(self, name: str) -> pd.DataFrame:
        """The calibration table ``name`` (``pwformat.tables.SCHEMAS``), checked against its checksum and this
        artifact's provenance where the manifest records them."""
        fname = f"{name}.parquet"
        sums = self.manifest.checksums or {}
        digest = sums[fname].xxh3_128 if fname in sums else None
        return read_table(self.path / fname, name, digest, self.manifest.provenance(), self._remake(WRITTEN_BY[name]))

    @staticmethod
    def key(block: LinearBlock) -> str:
        return f"{'shared' if block.expert == SHARED_EXPERT else block.expert}.{block.unit}"
