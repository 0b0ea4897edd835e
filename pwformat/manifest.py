"""The artifact manifest: a typed, versioned record of what an artifact directory holds.

What it does: ``Manifest`` is ``manifest.json`` as a dataclass (format, bitwidths, the model's fingerprint,
per-layer files, one record per pwcal stage), validated on read (``Manifest.from_dict`` raises a one-line
``PagedWeightError`` naming the bad field); ``SCHEMA_VERSION`` is the version of this record (a manifest without
one is version 1). It also fingerprints a model checkpoint (sha256 of config.json; sha256 of the weight files,
and quick fingerprints from their names, sizes, headers and a few hundred bytes of every tensor that the
runtime can check without reading gigabytes) and checks that an artifact belongs to a checkpoint.
It imports no torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from pwformat.atomic import write_atomic
from pwformat.errors import PagedWeightError

MANIFEST = "manifest.json"


def package_version() -> str:
    try:
        return metadata.version("pagedweight")
    except metadata.PackageNotFoundError:
        return "unknown"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


SAMPLE_BYTES = 256  # per probe; three probes (start, middle, end) per tensor


def _sample_sha256(files: list[Path]) -> str:
    """sha256 of each safetensors file's name, size and header (tensor names, dtypes, shapes, offsets), and of
    SAMPLE_BYTES at the start, middle and end of every tensor's data: a few hundred bytes per tensor, yet a
    fine-tune of any tensor (experts only, routers only) changes it. A file whose header cannot be parsed is
    hashed by its first 64 KiB (the loader reports it)."""
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size};".encode())
        with f.open("rb") as fh:
            try:
                n = int.from_bytes(fh.read(8), "little")
                header = fh.read(n) if 0 < n <= size - 8 else b""
                spans = sorted(tuple(v["data_offsets"]) for k, v in json.loads(header).items() if k != "__metadata__")
            except (ValueError, TypeError, KeyError, AttributeError):
                fh.seek(0)
                h.update(fh.read(1 << 16))
                continue
            h.update(header)
            base = 8 + n
            for lo, hi in spans:
                for at in sorted({lo, max(lo, (lo + hi) // 2 - SAMPLE_BYTES // 2), max(lo, hi - SAMPLE_BYTES)}):
                    fh.seek(base + at)
                    h.update(fh.read(min(SAMPLE_BYTES, hi - at)))
    return h.hexdigest()


def model_fingerprint(model_dir: Path, full: bool = True) -> dict[str, str]:
    """{config_sha256, weights_quick, weights_sample, weights_sha256 (if ``full``)} of a checkpoint directory.

    weights_quick: names and sizes of the safetensors files; weights_sample: also each file's header and a few
    hundred bytes of every tensor (``_sample_sha256``), what the runtime checks; weights_sha256: every byte
    (``pwcal quantize``; the pwcal stages check it too)."""
    files = sorted(model_dir.glob("*.safetensors"))
    quick = hashlib.sha256("".join(f"{f.name}:{f.stat().st_size};" for f in files).encode()).hexdigest()
    out = {"config_sha256": _sha256(model_dir / "config.json"), "weights_quick": quick,
           "weights_sample": _sample_sha256(files)}
    if full:
        h = hashlib.sha256()
        for f in files:
            h.update(_sha256(f).encode())
        out["weights_sha256"] = h.hexdigest()
    return out


SCHEMA_VERSION = 1


def _field(where: Path | str, name: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise PagedWeightError(f"{where}: field '{name}' is {type(value).__name__} {value!r:.60}, not {want}: re-run "
                               "pwcal quantize with --force")
    return value


@dataclass
class ModelRecord:
    """The checkpoint an artifact was made from: its path and family, and ``model_fingerprint``'s hashes
    (``weights_sample``/``weights_sha256``: None where an older manifest lacks them)."""

    path: str
    family: str
    config_sha256: str
    weights_quick: str
    weights_sample: str | None = None
    weights_sha256: str | None = None


@dataclass
class Manifest:
    """``manifest.json`` of an AP artifact. ``stages``: stage name -> its record (``complete``, ``config``, outputs,
    timing, ``stale_because`` when a re-run left it incomplete); ``files``: layer index (str) -> file name."""

    format: str
    format_version: int
    parent_bits: int
    seed_bits: int
    bits: list[int]
    model: ModelRecord
    files: dict[str, str]
    stages: dict[str, dict[str, Any]]
    lut_dtype: str = "float16"
    packing: str = ""
    package_version: str = "unknown"
    schema_version: int = SCHEMA_VERSION
    updated: str | None = None

    def stage(self, name: str) -> dict[str, Any]:
        """The record of stage ``name`` ({} if it never ran)."""
        return self.stages.get(name, {})

    def complete(self, name: str) -> bool:
        return bool(self.stage(name).get("complete"))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: Any, where: Path | str) -> Manifest:
        """Validate ``d`` (parsed JSON); raises ``PagedWeightError`` naming the first bad field and the fix."""
        if not isinstance(d, dict):
            raise PagedWeightError(f"{where} is corrupt (not the JSON object pwcal writes): re-run pwcal quantize "
                                   "with --force")
        version = _field(where, "schema_version", d.get("schema_version", 1), int)
        if version > SCHEMA_VERSION:
            raise PagedWeightError(f"{where} has manifest schema {version}, newer than this version's "
                                   f"{SCHEMA_VERSION}: upgrade pagedweight")
        for name in ("format", "format_version", "parent_bits", "seed_bits", "bits", "model", "files", "stages"):
            if name not in d:
                raise PagedWeightError(f"{where}: field '{name}' is missing: re-run pwcal quantize with --force")
        m = d["model"]
        _field(where, "model", m, dict)
        for name in ("path", "family", "config_sha256", "weights_quick"):
            _field(where, f"model.{name}", m.get(name), str)
        for name in ("weights_sample", "weights_sha256"):
            _field(where, f"model.{name}", m.get(name), (str, type(None)))
        bits = _field(where, "bits", d["bits"], list)
        for b in bits:
            _field(where, "bits[]", b, int)
        files = _field(where, "files", d["files"], dict)
        stages = _field(where, "stages", d["stages"], dict)
        for name, rec in stages.items():
            _field(where, f"stages.{name}", rec, dict)
        return Manifest(
            format=_field(where, "format", d["format"], str),
            format_version=_field(where, "format_version", d["format_version"], int),
            parent_bits=_field(where, "parent_bits", d["parent_bits"], int),
            seed_bits=_field(where, "seed_bits", d["seed_bits"], int),
            bits=list(bits), files={str(k): str(v) for k, v in files.items()}, stages=stages,
            model=ModelRecord(**{f.name: m.get(f.name) for f in dataclasses.fields(ModelRecord)}),
            lut_dtype=_field(where, "lut_dtype", d.get("lut_dtype", "float16"), str),
            packing=_field(where, "packing", d.get("packing", ""), str),
            package_version=_field(where, "package_version", d.get("package_version", "unknown"), str),
            schema_version=version, updated=d.get("updated"))


def write_manifest(artifact_dir: Path, manifest: Manifest) -> None:
    """Write ``manifest`` (stamped with the time) to ``artifact_dir/manifest.json`` atomically."""
    manifest.updated = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_atomic(artifact_dir / MANIFEST, (json.dumps(manifest.to_dict(), indent=1) + "\n").encode())


def read_manifest(artifact_dir: Path) -> Manifest:
    """The manifest of ``artifact_dir``; raises ``PagedWeightError`` if missing, unreadable or invalid."""
    p = artifact_dir / MANIFEST
    if not p.is_file():
        raise PagedWeightError(f"{artifact_dir} is not a PagedWeight artifact (no {MANIFEST}): run "
                               "`pwcal run-all MODEL --out DIR` (or its first stage, `pwcal quantize`) first")
    try:
        out = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise PagedWeightError(f"{p} is corrupt ({exc.msg}): rerun the stage that wrote it with --force") from exc
    return Manifest.from_dict(out, p)



def check_same_model(manifest: Manifest, model_dir: Path, artifact_dir: Path, full: bool = False) -> None:
    """Raise ``PagedWeightError`` unless the artifact was made from the checkpoint in ``model_dir``: config and
    weight file names and sizes, the sampled fingerprint when the manifest has one, and with ``full`` (the pwcal
    stages: they read the whole model anyway) the sha256 of every weight byte when the manifest has it."""
    if not (model_dir / "config.json").is_file():
        raise PagedWeightError(f"{model_dir} is not a Hugging Face checkpoint directory (no config.json): pass the "
                               "model the artifact was made from")
    want = manifest.model
    fp = model_fingerprint(model_dir, full=full and want.weights_sha256 is not None)
    same = want.config_sha256 == fp["config_sha256"] and want.weights_quick == fp["weights_quick"]
    if same and want.weights_sample is not None:  # older artifacts lack the sampled fingerprint
        same = want.weights_sample == fp["weights_sample"]
    if same and "weights_sha256" in fp:
        same = want.weights_sha256 == fp["weights_sha256"]
    if not same:
        raise PagedWeightError(f"artifact {artifact_dir} was made for another model ({want.path}), not "
                               f"{model_dir}: pass the matching --model or re-run pwcal quantize")
