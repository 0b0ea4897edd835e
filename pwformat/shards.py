"""A Hugging Face checkpoint's safetensors files, read without torch: which files hold the weights, their headers,
and what is wrong with a directory whose files are missing, cut short or not the checkpoint's.

What it does: ``safetensors_files`` lists the weight files (the index's shards, or every ``*.safetensors``),
``safetensors_header`` parses one file's header into its tensors' data spans, ``checkpoint_problem`` names a
missing, damaged or stray file with its fix. ``pwformat.manifest`` fingerprints checkpoints with them and
``pwrun.model.checkpoint`` loads the files they list.
It imports no torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import BinaryIO

from pwformat.errors import PagedWeightError

INDEX = "model.safetensors.index.json"


def _listed(model_dir: Path) -> set[str] | None:
    """The shard names the index lists (None without an index); ``PagedWeightError`` for a corrupt index."""
    index = model_dir / INDEX
    if not index.is_file():
        return None
    try:
        return {str(n) for n in json.loads(index.read_text())["weight_map"].values()}
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError) as exc:
        raise PagedWeightError(f"{index} is corrupt (no valid weight_map): re-download the checkpoint") from exc


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files, sorted: the shards its index lists, or every ``*.safetensors`` without one.
    Raises ``PagedWeightError`` for a corrupt index, a listed shard that is missing, or no weight file at all."""
    listed = _listed(model_dir)
    if listed is not None:
        missing = sorted(n for n in listed if not (model_dir / n).is_file())
        if missing:
            raise PagedWeightError(f"{model_dir}: shard(s) {', '.join(missing)} listed in the index are missing: "
                                   "copy the complete checkpoint")
        return [model_dir / n for n in sorted(listed)]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickled = list(model_dir.glob("*.bin")) + list(model_dir.glob("*.pt"))
        hint = " (only pickle *.bin files found: convert them to safetensors)" if pickled else ""
        raise PagedWeightError(f"no *.safetensors weights in {model_dir}{hint}")
    return files


def safetensors_header(fh: BinaryIO, size: int) -> tuple[bytes, list[tuple[int, int]]] | None:
    """From the start of an open safetensors file of ``size`` bytes: its header bytes and its tensors' data spans
    (start, end) in bytes after the header, sorted; None where the header is not one (a length past the file, not a
    JSON object, offsets that are not two ordered non-negative ints)."""
    n = int.from_bytes(fh.read(8), "little")
    if not 0 < n <= size - 8:
        return None
    raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    if not isinstance(header, dict):
        return None
    spans = []
    for key, v in header.items():
        if key == "__metadata__":
            continue
        off = v.get("data_offsets") if isinstance(v, dict) else None
        if not (isinstance(off, list) and len(off) == 2 and all(type(x) is int for x in off) and 0 <= off[0] <= off[1]):
            return None
        spans.append((off[0], off[1]))
    return raw, sorted(spans)


def _damaged(files: list[Path]) -> str:
    """'' or a sentence naming the first file that is cut short (its header describes more bytes than it has) or
    has no readable header."""
    for f in files:
        size = f.stat().st_size
        with f.open("rb") as fh:
            parsed = safetensors_header(fh, size)
        if parsed is None:
            return f"{f} has no readable safetensors header ({size} bytes): re-copy or re-download it"
        end = 8 + len(parsed[0]) + max((hi for _, hi in parsed[1]), default=0)
        if size < end:
            return f"{f} is cut short ({size} bytes of the {end} its header describes): re-copy or re-download it"
    return ""


def checkpoint_problem(model_dir: Path) -> str:
    """'' or a one-line error with its fix for a checkpoint directory whose files are not a whole checkpoint: a
    corrupt index, a listed shard missing, a weight file cut short or without a readable header, or a
    ``*.safetensors`` file the index does not list."""
    try:
        files = safetensors_files(model_dir)
    except PagedWeightError as exc:
        return str(exc)
    listed = _listed(model_dir)
    extra = [] if listed is None else sorted(f.name for f in model_dir.glob("*.safetensors") if f.name not in listed)
    return _damaged(files) or (f"{model_dir}: {', '.join(extra)} not listed in {INDEX}: move it out of the "
                               "checkpoint directory" if extra else "")
