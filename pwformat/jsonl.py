"""Reading JSON Lines files (prompts, traces, datasets; ``.gz`` ok) with errors that name the file and line.

What it does: ``jsonl_rows`` yields the parsed value of every non-empty line with its line number, and turns a line
that is not JSON (or names a key twice in one object), a file that cannot be read and text that is not UTF-8 into
one ``PagedWeightError`` each (``not_utf8`` finds the line of the first bad byte and gives the re-encoding
command). Callers check the fields.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pwformat.errors import PagedWeightError


def _gz(path: Path) -> bool:
    return path.name.lower().endswith(".gz")


def not_utf8(path: Path) -> PagedWeightError:
    """The error for a file that is not UTF-8 text: names the file, the line of the first bad byte, and the fix."""
    where = ""
    try:
        data = gzip.open(path).read() if _gz(path) else path.read_bytes()
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        where = f":{line} (byte 0x{data[exc.start:exc.start + 1].hex()})"
    except (OSError, EOFError):
        pass
    out = path.with_name(f"{path.name.split('.')[0]}.utf8{''.join(path.suffixes)}")
    cmd = (f"zcat {path} | iconv -f latin1 -t utf-8 | gzip > {out}" if _gz(path)
           else f"iconv -f latin1 -t utf-8 {path} > {out}")
    return PagedWeightError(f"{path}{where} is not UTF-8 text: re-encode it as UTF-8, e.g. `{cmd}`")


def _unicode(value: Any) -> bool:
    """Whether every string in a parsed JSON value is valid Unicode (JSON's \\uXXXX escapes may encode a lone
    surrogate, which no tokenizer or UTF-8 writer takes)."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _DuplicateKey(ValueError):
    """A JSON object that names one key twice (``json`` would keep the last value silently)."""


def _one_value_per_key(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return out


def jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) of every non-empty line of ``path``; raises ``PagedWeightError`` naming
    ``path:line`` for a line that is not JSON, or the file for one that cannot be read or is not UTF-8."""
    opener = gzip.open if _gz(path) else open
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:  # a leading byte-order mark (Windows editors) is skipped
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line, object_pairs_hook=_one_value_per_key)
                except json.JSONDecodeError as exc:
                    raise PagedWeightError(f"{path}:{lineno} is not valid JSON ({exc.msg})") from exc
                except _DuplicateKey as exc:
                    raise PagedWeightError(f"{path}:{lineno} gives the key {exc.args[0]!r} twice in one object: keep "
                                           "one") from None
                if "\\u" in line and not _unicode(row):
                    raise PagedWeightError(f"{path}:{lineno} has text that is not valid Unicode (an escape of a lone "
                                           "surrogate, e.g. \\ud800, that no character pairs): fix or delete that "
                                           "line")
                yield lineno, row
    except UnicodeDecodeError as exc:  # decoding runs ahead of the lines read: not_utf8 finds the line
        raise not_utf8(path) from exc
    except (OSError, EOFError) as exc:
        raise PagedWeightError(f"cannot read {path}: {exc}") from exc
