"""Bundled datasets and prompts files: the QMSum meetings as documents (long prompts), a prompts file read once
for its prompts, arrival times and unread fields, and prompts refused before they are tokenized."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import pwrun.prompt_file as prompt_file
from pwformat.errors import PagedWeightError
from pwrun.data import artifacts_dir, default_model_dir, document_prompts, read_documents
from pwrun.generate import encode_prompts
from pwrun.model.loader import load_tokenizer, token_chars
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


def test_a_byte_order_mark_at_the_start_is_skipped(tmp_path: Path) -> None:
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n{"prompt": "\xef\xbb\xbf b"}\n')  # a BOM mid-text is text
    assert PromptFile.read(f).prompts == ["a", "\ufeff b"]


def test_a_lone_surrogate_escape_is_named_by_file_and_line(tmp_path: Path) -> None:
    """JSON may escape a lone surrogate (\\ud800): valid JSON, but no text a tokenizer or a UTF-8 writer takes."""
    f = tmp_path / "s.jsonl"
    f.write_text('{"prompt": "fine \\u00e9 \\ud83d\\ude00"}\n{"prompt": "bad \\ud800 x"}\n')
    with pytest.raises(PagedWeightError, match=f"{f}:2 has text that is not valid Unicode"):
        PromptFile.read(f)
    f.write_text('{"text": "fine \\u00e9 \\ud83d\\ude00"}\n')
    assert read_documents(str(f)) == ["fine \u00e9 \U0001f600"]  # escaped pairs and characters are text


def test_a_key_given_twice_in_one_object_is_named(tmp_path: Path) -> None:
    """JSON parsers keep the last of two values silently: a prompts line with two prompts is refused instead."""
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a", "meta": {"k": 1, "j": 2}}\n{"prompt": "hi", "prompt": "x"}\n')
    with pytest.raises(PagedWeightError, match=f"{f}:2 gives the key 'prompt' twice in one object: keep one"):
        PromptFile.read(f)


def test_a_prompt_longer_than_any_context_is_refused_before_tokenizing() -> None:
    """A prompt of more characters than the context's tokens can hold is refused without the tokenizer (which
    takes seconds and gigabytes on a 100 MB line); one that fits is tokenized as before."""
    tok = load_tokenizer(default_model_dir())

    class Spy:
        def __init__(self) -> None:
            self.texts: list[int] = []

        def __len__(self) -> int:
            return len(tok)

        def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
            return tok.convert_ids_to_tokens(ids)

        def __call__(self, text: str, **kw: Any) -> Any:
            self.texts.append(len(text))
            return tok(text, **kw)

    spy = Spy()
    most = 2048 * token_chars(spy)
    with pytest.raises(PagedWeightError, match=f"prompt 2 of 2 .* has {most + 1} characters, more than any 2048 "
                                               "tokens make"):
        encode_prompts(spy, ["fine", "word " * (most // 5) + "a" * (most % 5 + 1)], 2048, 4, 10**6)
    assert spy.texts == [4]  # the first prompt only
    assert len(encode_prompts(spy, ["The river"], 2048, 4, 10**6)[0]) > 0
