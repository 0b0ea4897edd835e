"""Bundled real text and local text files, for perplexity and calibration (offline).

What it does: names the bundled datasets (``wikitext2``, ``wikitext2-val``, ``c4`` for
evaluation, ``c4-calib`` for calibration; see ``artifacts/data/SOURCES.md``) and reads text from
them or from a local ``.txt``, ``.json``/``.jsonl``/``.json.gz`` (``text`` field per row) or
``.parquet`` (``text`` column) file. It never reaches a hub: online datasets are the
calibration stage's business.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from pwformat.errors import PagedWeightError
from pwformat.jsonl import jsonl_rows, not_utf8


def artifacts_dir() -> Path:
    """The project's ``artifacts/`` folder (override with ``PAGEDWEIGHT_ARTIFACTS``)."""
    env = os.environ.get("PAGEDWEIGHT_ARTIFACTS")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "artifacts"


def missing_bundle_hint(path: Path) -> str:
    """'' unless ``path`` lies in the bundled artifacts folder and that folder does not exist (a non-editable
    ``pip install`` ships the code only): then a sentence saying how to point at a clone's ``artifacts/``."""
    root = artifacts_dir()
    try:
        inside = path.resolve().is_relative_to(root.resolve())
    except OSError:
        inside = False
    if root.is_dir() or not inside:
        return ""
    return (f" (the bundled model and data are not installed with the package: {root} does not exist; set "
            "PAGEDWEIGHT_ARTIFACTS to the artifacts/ folder of a clone of the repository, or pass your own paths)")


def default_model_dir() -> Path:
    """The bundled tiny Qwen2-MoE trained by the project."""
    return artifacts_dir() / "models" / "tiny-qwen2moe-wiki"


BUNDLED = {
    "wikitext2": "data/wikitext-2-raw-v1/test.json",
    "wikitext2-val": "data/wikitext-2-raw-v1/validation.json",
    "c4": "data/c4/c4_sample.json",
    "c4-calib": "data/c4/c4-sample.00000-of-00001.json.gz",
    "qmsum": "data/qmsum/test.jsonl",  # meeting transcripts, thousands of tokens each: long-context prompts
}


def resolve_dataset(name_or_path: str) -> Path:
    """Path of a bundled dataset name or an existing local file."""
    if name_or_path in BUNDLED:
        p = artifacts_dir() / BUNDLED[name_or_path]
        hint = missing_bundle_hint(p)
        if hint:
            raise PagedWeightError(f"bundled dataset '{name_or_path}' is missing{hint}")
        return p
    p = Path(name_or_path)
    if not p.is_file():
        raise PagedWeightError(f"dataset '{name_or_path}' is neither a bundled name ({', '.join(BUNDLED)}) "
                               "nor an existing file")
    return p


def read_jsonl_field(path: Path, field: str, nonempty: bool = False) -> list[str]:
    """The string ``field`` of every non-empty line of a JSON Lines file (``.gz`` ok).

    Raises ``PagedWeightError`` naming the file and line of the first bad row: not JSON, no string
    ``field``, ``field`` blank (with ``nonempty``), or not UTF-8.
    """
    return jsonl_field(path, jsonl_rows(path), field, nonempty)


def jsonl_field(path: Path, rows: Iterable[tuple[int, Any]], field: str, nonempty: bool = False) -> list[str]:
    """``read_jsonl_field`` over ``path``'s already parsed ``rows`` ((line number, value), ``jsonl_rows``)."""
    out = []
    for lineno, row in rows:
        if not isinstance(row, dict) or not isinstance(row.get(field), str):
            raise PagedWeightError(f"{path}:{lineno} needs a string field '{field}'")
        if nonempty and not row[field].strip():
            raise PagedWeightError(f"{path}:{lineno} has an empty '{field}': give it some text or delete the line")
        out.append(row[field])
    return out


def read_documents(name_or_path: str) -> list[str]:
    """The documents of a dataset, in file order (a ``.txt`` file is one document)."""
    p = resolve_dataset(name_or_path)
    name = p.name.lower()
    try:
        if name.endswith(".txt"):
            return [p.read_text(encoding="utf-8")]
        if name.endswith(".parquet"):
            table = pq.read_table(p)
            if "text" not in table.column_names:
                raise PagedWeightError(f"{p} has no 'text' column (columns: {', '.join(table.column_names)})")
            return [str(t) for t in table.column("text").to_pylist()]
        if name.endswith((".json", ".jsonl", ".json.gz", ".jsonl.gz")):
            rows = list(jsonl_rows(p))
            if rows and isinstance(rows[0][1], dict) and "meeting_transcripts" in rows[0][1]:
                return [_meeting(p, lineno, row) for lineno, row in rows]
            return jsonl_field(p, rows, "text")
    except UnicodeDecodeError as exc:  # a ValueError too: before the generic case
        raise not_utf8(p) from exc
    except (OSError, EOFError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise PagedWeightError(f"cannot read {p}: {(str(exc).splitlines() or [''])[0]}") from exc
    raise PagedWeightError(f"unsupported file type {p.name}: use .txt, .json, .jsonl, .json.gz or .parquet")


def _meeting(path: Path, lineno: int, row: Any) -> str:
    """A QMSum meeting (its ``meeting_transcripts`` turns) as one document: "speaker: content" turns joined by a
    space."""
    try:
        return " ".join(f"{t['speaker']}: {t['content']}" for t in row["meeting_transcripts"])
    except (KeyError, TypeError) as exc:
        raise PagedWeightError(f"{path}:{lineno} is not a QMSum meeting (a 'meeting_transcripts' list of "
                               "'speaker' / 'content' turns)") from exc


def read_text(name_or_path: str) -> str:
    """All documents joined by a blank line (the GPTQ perplexity convention for WikiText-2)."""
    return "\n\n".join(read_documents(name_or_path))


def document_prompts(name_or_path: str, count: int, max_chars: int, min_chars: int = 200) -> list[str]:
    """The beginnings of the first ``count`` documents of at least ``min_chars`` characters, each cut at
    a word boundary to at most ``max_chars`` characters (a workload of real prompts).

    Raises ``PagedWeightError`` if the dataset has fewer such documents.
    """
    docs = [d.strip() for d in read_documents(name_or_path) if len(d.strip()) >= min_chars]
    if len(docs) < count:
        raise PagedWeightError(f"{name_or_path} has {len(docs)} document{'' if len(docs) == 1 else 's'} of >= "
                               f"{min_chars} characters, "
                               f"{count} asked: lower --count or give a dataset with more such documents")
    out = []
    for d in docs[:count]:
        cut = d[:max_chars]
        if len(d) > max_chars and " " in cut:
            cut = cut[: cut.rindex(" ")]
        out.append(cut)
    return out
