"""The artifact manifest: a typed, versioned record of what an artifact directory holds.

What it does: ``Manifest`` is ``manifest.json`` as a dataclass (format, bitwidths, the model's fingerprint,
per-layer files, one record per pwcal stage, the id of the quantize run, a ``FileSum`` per file), validated on
read (``Manifest.from_dict`` raises a one-line ``PagedWeightError`` naming the bad field, its value and what it
should be); ``SCHEMA_VERSION`` is the version of this record (a manifest without one is version 1; version 2 adds
``run_id`` and ``checksums``, which older ones lack). It also fingerprints a model checkpoint (sha256 of
config.json; sha256 of the weight files, and quick fingerprints from their names, sizes, headers and a few
hundred bytes of every tensor that the runtime can check without reading gigabytes) and checks that an artifact
belongs to a checkpoint.
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
from pwformat.checksums import FileSum
from pwformat.errors import PagedWeightError
from pwformat.layout import FORMAT, FORMAT_VERSION, PARENT_BITS, SUPPORTED_SEEDS
from pwformat.shards import checkpoint_problem, safetensors_header

MANIFEST = "manifest.json"
STAGES = ("quantize", "sensitivity", "fit-residual", "search-buckets")  # the pwcal stages, in the order they run
# side stages: no later stage reads their output (``pwcal run-all`` skips them unless asked), so they neither gate
# nor invalidate the stages after them
OPTIONAL_STAGES = ("fit-residual",)


def stages_after(stage: str) -> tuple[str, ...]:
    """The stages whose tables depend on ``stage``'s: the later ones but the optional side stages, none after one."""
    if stage in OPTIONAL_STAGES:
        return ()
    return tuple(s for s in STAGES[STAGES.index(stage) + 1:])


def stages_before(stage: str) -> tuple[str, ...]:
    """The stages ``stage`` reads the output of: the earlier ones but the optional side stages."""
    return tuple(s for s in STAGES[:STAGES.index(stage)] if s not in OPTIONAL_STAGES)
MAX_MANIFEST_BYTES = 64 << 20  # a manifest lists files and stage configs: far below this


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
    hashed by its first 64 KiB (``checkpoint_problem`` names it)."""
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size};".encode())
        with f.open("rb") as fh:
            parsed = safetensors_header(fh, size)
            if parsed is None:
                fh.seek(0)
                h.update(fh.read(1 << 16))
                continue
            header, spans = parsed
            h.update(header)
            base = 8 + len(header)
            for lo, hi in spans:
                for at in sorted({lo, max(lo, (lo + hi) // 2 - SAMPLE_BYTES // 2), max(lo, hi - SAMPLE_BYTES)}):
                    fh.seek(base + at)
                    h.update(fh.read(min(SAMPLE_BYTES, hi - at)))
    return h.hexdigest()


VOLATILE_CONFIG_KEYS = ("transformers_version",)  # rewritten by every save_pretrained: not the model


def config_sha256(path: Path) -> str:
    """sha256 of config.json's content: its keys sorted, compact separators, VOLATILE_CONFIG_KEYS left out, so
    that the same config re-saved (another key order, indentation or transformers version) is the same model.
    A file that is not a JSON object is hashed by its bytes."""
    try:
        obj = json.loads(path.read_bytes())
    except (ValueError, RecursionError):
        return _sha256(path)
    if not isinstance(obj, dict):
        return _sha256(path)
    obj = {k: v for k, v in obj.items() if k not in VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def config_matches(recorded: str, path: Path) -> bool:
    """Whether ``recorded`` (a manifest's config_sha256) is config.json at ``path``: its content hash
    (``config_sha256``), or its bytes' sha256, what artifacts made before the content hash recorded."""
    return recorded in (config_sha256(path), _sha256(path))


def model_fingerprint(model_dir: Path, full: bool = True) -> dict[str, str]:
    """{config_sha256, weights_quick, weights_sample, weights_sha256 (if ``full``)} of a checkpoint directory.
    config_sha256 hashes config.json's content (``config_sha256``; ``config_matches`` also takes its bytes' hash).

    weights_quick: names and sizes of the safetensors files; weights_sample: also each file's header and a few
    hundred bytes of every tensor (``_sample_sha256``), what the runtime checks; weights_sha256: every byte
    (``pwcal quantize``; the pwcal stages check it too)."""
    files = sorted(model_dir.glob("*.safetensors"))
    quick = hashlib.sha256("".join(f"{f.name}:{f.stat().st_size};" for f in files).encode()).hexdigest()
    out = {"config_sha256": config_sha256(model_dir / "config.json"), "weights_quick": quick,
           "weights_sample": _sample_sha256(files)}
    if full:
        h = hashlib.sha256()
        for f in files:
            h.update(_sha256(f).encode())
        out["weights_sha256"] = h.hexdigest()
    return out


SCHEMA_VERSION = 2
FIX = "re-run pwcal quantize with --force"


def _bad(where: Path | str, name: str, value: Any, want: str) -> PagedWeightError:
    return PagedWeightError(f"{where}: field '{name}' is {value!r:.60}, not {want}: {FIX}")


def _field(where: Path | str, name: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in kinds):
        want = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise PagedWeightError(f"{where}: field '{name}' is {type(value).__name__} {value!r:.60}, not {want}: {FIX}")
    return value


def _plain_name(where: Path | str, name: str, value: Any) -> str:
    """A file name inside the artifact directory (no directories, not hidden)."""
    _field(where, name, value, str)
    if not value or "/" in value or "\\" in value or value.startswith("."):
        raise _bad(where, name, value, "a file name inside the artifact directory")
    return str(value)


def _checksums(where: Path | str, raw: Any) -> dict[str, FileSum] | None:
    if raw is None:
        return None
    out = {}
    for name, rec in _field(where, "checksums", raw, dict).items():
        at = f"checksums.{name}"
        _plain_name(where, at, name)
        _field(where, at, rec, dict)
        size = _field(where, f"{at}.size", rec.get("size"), int)
        digest = _field(where, f"{at}.xxh3_128", rec.get("xxh3_128"), str)
        if size < 0:
            raise _bad(where, f"{at}.size", size, "a size in bytes >= 0")
        if len(digest) != 32 or any(c not in "0123456789abcdef" for c in digest):
            raise _bad(where, f"{at}.xxh3_128", digest, "32 lower-case hex digits")
        stage = _field(where, f"{at}.stage", rec.get("stage"), str)
        if stage not in STAGES:
            raise _bad(where, f"{at}.stage", stage, f"one of {', '.join(STAGES)}")
        out[name] = FileSum(size, digest, stage, _field(where, f"{at}.layer", rec.get("layer"), (int, type(None))))
    return out


@dataclass
class ModelRecord:
    """The checkpoint an artifact was made from: its path and family, ``model_fingerprint``'s hashes, and
    ``weights_served``: the digest of every weight serving reads from the checkpoint (all but the experts';
    ``ModelWeights.source_digest`` of a load without them), which the runtime compares with its own load. None
    where an older manifest lacks them."""

    path: str
    family: str
    config_sha256: str
    weights_quick: str
    weights_sample: str | None = None
    weights_sha256: str | None = None
    weights_served: str | None = None


@dataclass
class Manifest:
    """``manifest.json`` of an AP artifact. ``stages``: stage name -> its record (``complete``, ``config``, outputs
    (``files``), timing, ``stale_because`` when a re-run left it incomplete); ``files``: layer index (str) -> file
    name; ``run_id``: the id of the quantize run that made the layer files (every table records it);
    ``checksums``: file name -> ``FileSum`` (None: an artifact from before checksums)."""

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
    run_id: str | None = None
    checksums: dict[str, FileSum] | None = None

    def stage(self, name: str) -> dict[str, Any]:
        """The record of stage ``name`` ({} if it never ran)."""
        return self.stages.get(name, {})

    def complete(self, name: str) -> bool:
        return bool(self.stage(name).get("complete"))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.checksums is not None:
            d["checksums"] = {k: v.to_dict() for k, v in self.checksums.items()}
        return d

    def checked_files(self, before: str | None = None) -> list[str]:
        """The files a reader relies on: every layer file and the outputs of every complete stage; with ``before``
        (a stage of ``STAGES``) only those of the stages before it (what that stage reads: it remakes the rest)."""
        names = list(dict.fromkeys(self.files.values()))
        earlier = None if before is None else stages_before(before)
        for stage, rec in self.stages.items():
            if rec.get("complete") and (earlier is None or stage in earlier):
                names += [f for f in rec.get("files", []) if f not in names]
        return names

    def model_id(self) -> str:
        """A short fingerprint of the checkpoint (from its recorded hashes), recorded in every table."""
        m = self.model
        key = f"{m.config_sha256}:{m.weights_quick}:{m.weights_sample or ''}"
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def provenance(self) -> dict[str, str] | None:
        """What every table of this artifact records: the model's fingerprint and the quantize run's id (None for
        an artifact from before run ids)."""
        return None if self.run_id is None else {"model": self.model_id(), "run": self.run_id}

    @staticmethod
    def from_dict(d: Any, where: Path | str) -> Manifest:
        """Validate ``d`` (parsed JSON); raises ``PagedWeightError`` naming the first bad field, its value, what it
        should be and the fix."""
        if not isinstance(d, dict):
            raise PagedWeightError(f"{where} is corrupt (not the JSON object pwcal writes): {FIX}")
        version = _field(where, "schema_version", d.get("schema_version", 1), int)
        if version > SCHEMA_VERSION:
            by = d.get("package_version")
            reader = f"pagedweight {by} or later" if isinstance(by, str) and by != "unknown" else "a newer pagedweight"
            raise PagedWeightError(f"{where} has manifest schema {version}, newer than the {SCHEMA_VERSION} this "
                                   f"version reads: it was written by {reader}; upgrade to that to read it")
        if version < 1:
            raise _bad(where, "schema_version", version, f"1..{SCHEMA_VERSION}")
        for name in ("format", "format_version", "parent_bits", "seed_bits", "bits", "model", "files", "stages"):
            if name not in d:
                raise PagedWeightError(f"{where}: field '{name}' is missing: {FIX}")
        m = d["model"]
        _field(where, "model", m, dict)
        for name in ("path", "family", "config_sha256", "weights_quick"):
            _field(where, f"model.{name}", m.get(name), str)
        for name in ("weights_sample", "weights_sha256", "weights_served"):
            _field(where, f"model.{name}", m.get(name), (str, type(None)))
        parent = _field(where, "parent_bits", d["parent_bits"], int)
        seed = _field(where, "seed_bits", d["seed_bits"], int)
        if parent != PARENT_BITS:
            raise _bad(where, "parent_bits", parent, str(PARENT_BITS))
        if seed not in SUPPORTED_SEEDS:
            raise _bad(where, "seed_bits", seed, " or ".join(map(str, SUPPORTED_SEEDS)))
        bits = _field(where, "bits", d["bits"], list)
        for b in bits:
            _field(where, "bits[]", b, int)
        if bits != list(range(seed, parent + 1)):
            raise _bad(where, "bits", bits, f"every bitwidth from seed_bits to parent_bits, {seed}..{parent}")
        files = _field(where, "files", d["files"], dict)
        for k, v in files.items():
            if not (isinstance(k, str) and k.isdigit() and k.isascii() and len(k) <= 6):
                raise _bad(where, f"files.{k:.20}", k, "a layer index (a decimal integer below 10^6)")
            _plain_name(where, f"files.{k}", v)
        stages = _field(where, "stages", d["stages"], dict)
        for name, rec in stages.items():
            _field(where, f"stages.{name}", rec, dict)
            _field(where, f"stages.{name}.complete", rec.get("complete", False), bool)
            _field(where, f"stages.{name}.config", rec.get("config", {}), dict)
            for i, f in enumerate(_field(where, f"stages.{name}.files", rec.get("files", []), list)):
                _plain_name(where, f"stages.{name}.files[{i}]", f)
        sums = _checksums(where, d.get("checksums"))
        if sums is None and version >= 2:  # only an artifact from before schema 2 may lack them
            raise PagedWeightError(f"{where}: field 'checksums' is missing (schema {version} records them): {FIX}")
        if sums is not None:
            for k, v in files.items():
                if v not in sums:
                    raise _bad(where, f"files.{k}", v, "a file with a checksum record")
                if sums[v].layer is None:
                    raise _bad(where, f"checksums.{v}.layer", None, f"{k} (the layer the file map gives that file)")
                if sums[v].layer != int(k):
                    raise _bad(where, f"files.{k}", v, f"the file of layer {k} (its checksum record says layer "
                               f"{sums[v].layer}: the file map swaps layers)")
            for v, rec in sums.items():
                if rec.layer is not None and str(rec.layer) not in files:
                    raise _bad(where, f"files.{rec.layer}", None, f"{v} (the checksum record of that file says it "
                               f"holds layer {rec.layer})")
            for name, rec in stages.items():
                for f in rec.get("files", []) if rec.get("complete") else []:
                    if f not in sums:
                        raise _bad(where, f"stages.{name}.files", f, "a file with a checksum record")
        fmt, fmt_version = _field(where, "format", d["format"], str), _field(where, "format_version",
                                                                             d["format_version"], int)
        if fmt != FORMAT:
            raise _bad(where, "format", fmt, repr(FORMAT))
        if fmt_version != FORMAT_VERSION:
            raise _bad(where, "format_version", fmt_version, f"{FORMAT_VERSION} (the AP layout this version reads)")
        return Manifest(
            format=fmt, format_version=fmt_version,
            parent_bits=parent, seed_bits=seed,
            bits=list(bits), files=dict(files), stages=stages,
            model=ModelRecord(**{f.name: m.get(f.name) for f in dataclasses.fields(ModelRecord)}),
            lut_dtype=_field(where, "lut_dtype", d.get("lut_dtype", "float16"), str),
            packing=_field(where, "packing", d.get("packing", ""), str),
            package_version=_field(where, "package_version", d.get("package_version", "unknown"), str),
            schema_version=version, updated=_field(where, "updated", d.get("updated"), (str, type(None))),
            run_id=_field(where, "run_id", d.get("run_id"), (str, type(None))), checksums=sums)


def write_manifest(artifact_dir: Path, manifest: Manifest) -> None:
    """Write ``manifest`` (stamped with the time) to ``artifact_dir/manifest.json`` atomically."""
    manifest.updated = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_atomic(artifact_dir / MANIFEST, (json.dumps(manifest.to_dict(), indent=1) + "\n").encode())


def read_manifest(artifact_dir: Path) -> Manifest:
    """The manifest of ``artifact_dir``; raises ``PagedWeightError`` if missing, unreadable or invalid."""
    fix = f"re-run `pwcal quantize MODEL --out {artifact_dir} --force` (MODEL: the checkpoint it was made from)"
    p = artifact_dir / MANIFEST
    if (p.exists() or p.is_symlink()) and not p.is_file():
        raise PagedWeightError(f"{p} is not a regular file (a directory, a device or a broken link): {fix}")
    if not p.is_file():
        left = [x for x in (".old", ".partial") if (artifact_dir.parent / (artifact_dir.name + x)).is_dir()]
        if left:
            beside = " and ".join(artifact_dir.name + x for x in left)
            raise PagedWeightError(f"{artifact_dir} has no {MANIFEST}, but {beside} lie beside it: a pwcal quantize "
                                   f"into it was stopped; run `pwcal quantize MODEL --out {artifact_dir}` again to "
                                   "restore or finish it")
        what = f"is not a PagedWeight artifact (no {MANIFEST})" if artifact_dir.is_dir() else "does not exist"
        raise PagedWeightError(f"{artifact_dir} {what}: give the directory `pwcal run-all "
                               f"MODEL --out DIR` wrote, or make it with that command (or its first stage, `pwcal "
                               "quantize`)")
    if p.stat().st_size > MAX_MANIFEST_BYTES:
        raise PagedWeightError(f"{p} is corrupt ({p.stat().st_size} bytes, far more than pwcal writes): {fix}")
    try:
        out = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        why = exc.msg.removesuffix(" at")  # "Invalid control character at"
        raise PagedWeightError(f"{p} is corrupt ({why} at line {exc.lineno} column {exc.colno}): {fix}") from exc
    except UnicodeDecodeError as exc:
        raise PagedWeightError(f"{p} is corrupt (not UTF-8 text): {fix}") from exc
    except (ValueError, RecursionError) as exc:  # e.g. an integer of thousands of digits, or arrays nested too deep
        raise PagedWeightError(f"{p} is corrupt ({type(exc).__name__}: {str(exc)[:80]}): {fix}") from exc
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
    same_config = config_matches(want.config_sha256, model_dir / "config.json")
    same = want.weights_quick == fp["weights_quick"]
    if same and want.weights_sample is not None:  # older artifacts lack the sampled fingerprint
        same = want.weights_sample == fp["weights_sample"]
    if same and "weights_sha256" in fp:
        same = want.weights_sha256 == fp["weights_sha256"]
    if same and not same_config:
        raise PagedWeightError(f"artifact {artifact_dir} was made for another model: these weights with another "
                               "config.json (a value differs; key order and formatting do not count): restore "
                               f"{model_dir / 'config.json'} as it was, or re-run pwcal quantize for this config")
    if not same and (problem := checkpoint_problem(model_dir)):
        raise PagedWeightError(problem)
    if not same:
        raise PagedWeightError(f"artifact {artifact_dir} was made for another model ({want.path}), not "
                               f"{model_dir}: give the checkpoint it was made from, or re-run pwcal quantize for "
                               "this one")
