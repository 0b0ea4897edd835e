"""Artifact manifests and atomic writes (STYLE.md rule 4: artifacts carry their own meaning).

What it does: fingerprints a model checkpoint (sha256 of config.json; sha256 of the weight
files, and quick fingerprints from their names, sizes, headers and a few hundred bytes of every tensor that the
runtime can check without reading gigabytes), reads/writes ``manifest.json``, and writes files atomically (``.tmp`` then
rename). It imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

from pwrun.errors import PagedWeightError

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


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """The ``path.tmp`` to write: renamed to ``path`` when the block ends normally, removed when it raises anything
    (``OSError`` such as a full disk, Ctrl-C, or SIGTERM, which ``pwrun.cli_common.user_errors`` turns into an
    exception), so readers never see a partial file and nothing half-written is left. Re-raises."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via ``atomic_path`` (fsynced). Raises ``OSError`` (disk full, no permission)."""
    with atomic_path(path) as tmp, tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_manifest(artifact_dir: Path, manifest: dict[str, Any]) -> None:
    manifest = {**manifest, "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_atomic(artifact_dir / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())


def read_manifest(artifact_dir: Path) -> dict[str, Any]:
    """The manifest of ``artifact_dir``; raises ``PagedWeightError`` if missing or unreadable."""
    p = artifact_dir / MANIFEST
    if not p.is_file():
        raise PagedWeightError(f"{artifact_dir} is not a PagedWeight artifact (no {MANIFEST}): run "
                               "`pwcal quantize MODEL --out DIR` first")
    try:
        out = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise PagedWeightError(f"{p} is corrupt ({exc.msg}): rerun the stage that wrote it with --force") from exc
    if not isinstance(out, dict):
        raise PagedWeightError(f"{p} is corrupt (not a JSON object): rerun the stage that wrote it with --force")
    return out


def check_same_model(manifest: dict[str, Any], model_dir: Path, artifact_dir: Path, full: bool = False) -> None:
    """Raise ``PagedWeightError`` unless the artifact was made from the checkpoint in ``model_dir``: config and
    weight file names and sizes, the sampled fingerprint when the manifest has one, and with ``full`` (the pwcal
    stages: they read the whole model anyway) the sha256 of every weight byte when the manifest has it."""
    if not (model_dir / "config.json").is_file():
        raise PagedWeightError(f"{model_dir} is not a Hugging Face checkpoint directory (no config.json): pass the "
                               "model the artifact was made from")
    want = manifest.get("model", {})
    fp = model_fingerprint(model_dir, full=full and "weights_sha256" in want)
    same = want.get("config_sha256") == fp["config_sha256"] and want.get("weights_quick") == fp["weights_quick"]
    if same and "weights_sample" in want:  # artifacts written before the sampled fingerprint lack it
        same = want["weights_sample"] == fp["weights_sample"]
    if same and "weights_sha256" in fp:
        same = want["weights_sha256"] == fp["weights_sha256"]
    if not same:
        raise PagedWeightError(f"artifact {artifact_dir} was made for another model ({want.get('path', '?')}), not "
                               f"{model_dir}: pass the matching --model or re-run pwcal quantize")
