"""Content checksums of an artifact's files: what a stage wrote is what a reader gets.

What it does: ``file_sum`` streams a file (4 MiB chunks, never held whole) through xxHash's XXH3-128 and returns
its ``FileSum`` (size, digest, the pwcal stage that wrote it, and for a layer file its layer index); the manifest
records one per file (``pwformat.manifest.Manifest.checksums``). ``verify_files`` compares every recorded size with the
file on disk (a ``stat`` per file: always done when an artifact is opened) and then re-hashes the contents (the
default on load; ``--no-verify`` skips it) with a progress callback in bytes; ``find_problems`` lists every bad
file (``pwcal verify``). Both raise one-line
``PagedWeightError``s naming the file and the command that remakes it. XXH3 hashes at several GB/s per core, so
verifying costs about the time the files take to read. It imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from pwformat.errors import PagedWeightError

CHUNK = 1 << 22  # bytes read at a time
ALGORITHM = "xxh3_128"

Progress = Callable[[int], None]  # called with the bytes hashed since the last call


@dataclass(frozen=True)
class FileSum:
    """One file of an artifact: ``size`` in bytes, ``xxh3_128`` hex digest, the pwcal ``stage`` that wrote it and,
    for a layer file, its ``layer`` index (so that the manifest's file map cannot point a layer at another
    layer's file)."""

    size: int
    xxh3_128: str
    stage: str
    layer: int | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"size": self.size, "xxh3_128": self.xxh3_128, "stage": self.stage}
        if self.layer is not None:
            d["layer"] = self.layer
        return d


def digest_bytes(data: bytes) -> str:
    """The XXH3-128 hex digest of ``data`` (a table already read into memory)."""
    return xxhash.xxh3_128_hexdigest(data)


def file_digest(path: Path, on_bytes: Progress | None = None) -> str:
    """XXH3-128 hex digest of ``path``, read in ``CHUNK``-byte pieces; ``on_bytes(n)`` after each piece."""
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return h.hexdigest()


def file_sum(path: Path, stage: str, layer: int | None = None) -> FileSum:
    """The ``FileSum`` of ``path`` as written by ``stage``."""
    return FileSum(path.stat().st_size, file_digest(path), stage, layer)


def remake_command(stage: str, model: str, artifact_dir: Path) -> str:
    """The command that rewrites the files of ``stage`` (``pwcal quantize`` rewrites the whole artifact)."""
    if stage == "quantize":
        return f"`pwcal quantize {model} --out {artifact_dir} --force` (then the later stages)"
    return f"`pwcal {stage} {model} --artifacts {artifact_dir} --force`"


def _size_problem(path: Path, rec: FileSum) -> str | None:
    try:
        size = path.stat().st_size
    except OSError:
        return f"{path} is missing"
    if not path.is_file():
        return f"{path} is not a regular file (a directory or a device)"
    if size != rec.size:
        return f"{path} has {size} bytes, the manifest records {rec.size} (truncated or overwritten)"
    return None


def find_problems(artifact_dir: Path, sums: dict[str, FileSum], names: Iterable[str], model: str,
                  hashes: bool = True, on_bytes: Progress | None = None) -> Iterator[str]:
    """One line per file of ``names`` that is missing, has another size than its record in ``sums`` or (with
    ``hashes``) whose contents hash to another digest, each naming the pwcal command that remakes it.
    ``on_bytes`` as in ``file_digest``."""
    for name in names:
        rec = sums[name]
        path = artifact_dir / name
        problem = _size_problem(path, rec)
        if problem is None and hashes and file_digest(path, on_bytes) != rec.xxh3_128:
            problem = f"{path} is corrupt (its contents differ from the checksum in the manifest)"
        if problem is not None:
            yield f"{problem}: remake it with {remake_command(rec.stage, model, artifact_dir)}"


def verify_files(artifact_dir: Path, sums: dict[str, FileSum], names: Iterable[str], model: str,
                 hashes: bool = True, on_bytes: Progress | None = None) -> None:
    """Check every file's size first (cheap), then (with ``hashes``) its contents; raises ``PagedWeightError`` with
    the first line of ``find_problems``."""
    names = list(names)
    for problem in find_problems(artifact_dir, sums, names, model, hashes=False):
        raise PagedWeightError(problem)
    if hashes:
        for problem in find_problems(artifact_dir, sums, names, model, True, on_bytes):
            raise PagedWeightError(problem)
