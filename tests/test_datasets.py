"""Bundled datasets and prompts files: the QMSum meetings as documents (long prompts), and a prompts file read once
for its prompts, arrival times and unread fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import pwrun.prompt_file as prompt_file
from pwformat.errors import PagedWeightError
from pwrun.data import artifacts_dir, document_prompts, read_documents
from pwrun.prompt_file import PromptFile


def test_qmsum_meetings_are_documents_of_speaker_turns() -> None:
    raw = [json.loads(line) for line in (artifacts_dir() / "data" / "qmsum" / "test.jsonl").read_text().splitlines()
           if line.strip()]
    docs = read_documents("qmsum")
    assert len(docs) == len(raw) > 0
    first = raw[0]["meeting_transcripts"]
    assert docs[0].startswith(f"{first[0]['speaker']}: {first[0]['content']} {first[1]['speaker']}: ")
    long = document_prompts("qmsum", 3, 12000)
    assert len(long) == 3 and all(8000 < len(p) <= 12000 for p in long)


def test_a_file_that_is_not_a_meeting_is_named(tmp_path: Path) -> None:
    f = tmp_path / "m.jsonl"
    f.write_text(json.dumps({"meeting_transcripts": [{"speaker": "A", "content": "hi"}]}) + "\n"
                 + json.dumps({"meeting_transcripts": [{"content": "no speaker"}]}) + "\n")
    with pytest.raises(PagedWeightError, match=f"{f}:2 is not a QMSum meeting"):
        read_documents(str(f))


def test_a_prompts_file_is_parsed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "arrival_s": 0.5}\n\n{"prompt": "b", "arrival_s": 2, "max_tokens": 9}\n')
    calls = []
    real = prompt_file.jsonl_rows
    monkeypatch.setattr(prompt_file, "jsonl_rows", lambda p: calls.append(p) or real(p))
    got = PromptFile.read(f)
    assert calls == [f]
    assert got.prompts == ["a", "b"] and got.times == [0.5, 2.0]
    assert got.unread is not None and got.unread.startswith(f"{f}:3: field(s) max_tokens are not read")
    f.write_text('{"prompt": "a", "arrival_s": 0.5}\n{"prompt": "b"}\n')
    with pytest.raises(PagedWeightError, match=f"{f}:2 has no 'arrival_s'"):
        PromptFile.read(f)


def test_a_lone_surrogate_escape_is_named_by_file_and_line(tmp_path: Path) -> None:
    """JSON may escape a lone surrogate (\\ud800): valid JSON, but no text a tokenizer or a UTF-8 writer takes."""
    f = tmp_path / "s.jsonl"
    f.write_text('{"prompt": "fine \\u00e9 \\ud83d\\ude00"}\n{"prompt": "bad \\ud800 x"}\n')
    with pytest.raises(PagedWeightError, match=f"{f}:2 has text that is not valid Unicode"):
        PromptFile.read(f)
    f.write_text('{"text": "fine \\u00e9 \\ud83d\\ude00"}\n')
    assert read_documents(str(f)) == ["fine \u00e9 \U0001f600"]  # escaped pairs and characters are text
