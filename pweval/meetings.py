"""QMSum meeting transcripts as long-context perplexity requests (the LongBench QMSum source, scored by likelihood).

What it does: reads the bundled QMSum test meetings (``artifacts/data/qmsum/test.jsonl``; 35 meetings,
``meeting_transcripts`` of ``{speaker, content}`` turns; see ``artifacts/data/SOURCES.md``), renders
each as ``Speaker: words`` lines, and cuts ``per_meeting`` windows of ``prompt_tokens +
continuation_tokens`` tokens at seeded random offsets of each meeting; the continuation is scored
teacher-forced (task ``qmsum``). It does not summarise: the tiny model cannot follow instructions,
so the long transcripts serve as real long-context text whose perplexity is measured.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pweval.workload import Request, Workload, windows
from pwformat.errors import PagedWeightError
from pwrun.data import artifacts_dir

TASK = "qmsum"


def qmsum_path() -> Path:
    return artifacts_dir() / "data" / "qmsum" / "test.jsonl"


def meeting_texts(path: Path | None = None) -> list[str]:
    """One text per meeting: its turns as ``Speaker: content`` lines. Raises ``PagedWeightError`` if unreadable."""
    p = path or qmsum_path()
    out = []
    lineno = 0
    try:
        with open(p, encoding="utf-8") as f:
            for line in f:
                lineno += 1
                if line.strip():
                    turns = json.loads(line)["meeting_transcripts"]
                    out.append("\n".join(f"{t['speaker']}: {t['content']}" for t in turns))
    except (OSError, UnicodeDecodeError) as exc:
        raise PagedWeightError(f"cannot read the QMSum meetings {p}: {exc}") from exc
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise PagedWeightError(f"{p}:{lineno} is not a QMSum meeting record ({exc})") from exc
    return out


def qmsum_workload(tokenizer: Any, meetings: int, per_meeting: int, prompt_tokens: int, continuation_tokens: int,
                   seed: int) -> Workload:
    """``per_meeting`` windows from each of the first ``meetings`` meetings, in meeting order."""
    texts = meeting_texts()
    if not 1 <= meetings <= len(texts) or per_meeting < 1:
        raise PagedWeightError(f"QMSum has {len(texts)} test meetings: ask for 1..{len(texts)} meetings and >= 1 "
                               "window each")
    rng = np.random.default_rng(seed)
    reqs: list[Request] = []
    for text in texts[:meetings]:
        ids = list(tokenizer(text, add_special_tokens=False, verbose=False).input_ids)
        reqs += windows(ids, per_meeting, prompt_tokens, continuation_tokens, rng, TASK)
    return Workload(TASK, tuple(reqs))
