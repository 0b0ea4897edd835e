"""Evaluation workloads: requests of real text, each a prompt and a continuation scored teacher-forced.

What it does: ``Request`` is one request (prompt token ids, continuation token ids, the task it
belongs to, and for retrieval its question and candidate); ``Workload`` is the ordered list the
runtime serves concurrently. ``text_workload`` samples non-overlapping windows of
``prompt_tokens + continuation_tokens`` tokens at seeded random offsets of bundled text (WikiText-2
test, the C4 evaluation sample: the perplexity convention of ``pwrun ppl``, documents joined by a
blank line) and interleaves the datasets so every batch mixes them. It does not run a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from pwformat.errors import PagedWeightError
from pwrun.data import read_text


@dataclass(frozen=True)
class Request:
    """``prompt`` and ``continuation``: token ids; ``task``: e.g. ``wikitext2``, ``c4``, ``retrieval``, ``qmsum``.

    ``item``/``candidate``: a retrieval question and which of its candidates this request scores (else -1).
    """

    prompt: tuple[int, ...]
    continuation: tuple[int, ...]
    task: str
    item: int = -1
    candidate: int = -1

    @property
    def tokens(self) -> int:
        return len(self.prompt) + len(self.continuation)


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order; ``name`` says what it is built from (recorded in the results)."""

    name: str
    requests: tuple[Request, ...]

    def __post_init__(self) -> None:
        if not self.requests or any(not r.prompt or not r.continuation for r in self.requests):
            raise PagedWeightError(f"workload {self.name}: every request needs a non-empty prompt and continuation")

    @property
    def prompts(self) -> list[list[int]]:
        return [list(r.prompt) for r in self.requests]

    @property
    def forced(self) -> list[list[int]]:
        return [list(r.continuation) for r in self.requests]

    @property
    def tasks(self) -> list[str]:
        """Task names in first-appearance order."""
        return list(dict.fromkeys(r.task for r in self.requests))

    @property
    def longest(self) -> int:
        return max(r.tokens for r in self.requests)

    def __add__(self, other: Workload) -> Workload:
        return Workload(f"{self.name}+{other.name}", self.requests + other.requests)


@lru_cache(maxsize=8)
def token_stream(tokenizer: Any, dataset: str) -> tuple[int, ...]:
    """Token ids of a dataset's text (documents joined by a blank line, no special tokens); cached per tokenizer."""
    return tuple(tokenizer(read_text(dataset), add_special_tokens=False, verbose=False).input_ids)


def windows(ids: Sequence[int], count: int, prompt_tokens: int, continuation_tokens: int, rng: np.random.Generator,
            task: str) -> list[Request]:
    """``count`` non-overlapping windows of ``ids`` at random slots (sorted by position for reproducibility).

    Raises ``PagedWeightError`` if the text holds fewer than ``count`` windows.
    """
    span = prompt_tokens + continuation_tokens
    slots = len(ids) // span
    if count > slots:
        raise PagedWeightError(f"{task} has {len(ids)} tokens: room for {slots} windows of {span} tokens, "
                               f"{count} asked: lower the request count or the lengths")
    out = []
    for s in sorted(rng.choice(slots, size=count, replace=False).tolist()):
        a = s * span
        out.append(Request(tuple(ids[a:a + prompt_tokens]), tuple(ids[a + prompt_tokens:a + span]), task))
    return out


def interleave(groups: list[list[Request]]) -> list[Request]:
    """Round-robin over the groups (a batch then mixes tasks as a server's queue would)."""
    out: list[Request] = []
    for i in range(max((len(g) for g in groups), default=0)):
        out += [g[i] for g in groups if i < len(g)]
    return out


def text_workload(tokenizer: Any, datasets: tuple[str, ...], per_dataset: int, prompt_tokens: int,
                  continuation_tokens: int, seed: int, max_context: int) -> Workload:
    """``per_dataset`` windows of each dataset, interleaved; raises ``PagedWeightError`` on bad sizes."""
    if per_dataset < 1 or prompt_tokens < 1 or continuation_tokens < 1:
        raise PagedWeightError("requests, prompt tokens and continuation tokens must be >= 1")
    if prompt_tokens + continuation_tokens > max_context:
        raise PagedWeightError(f"prompt + continuation = {prompt_tokens + continuation_tokens} tokens exceeds the "
                               f"model's context of {max_context}")
    rng = np.random.default_rng(seed)
    groups = [windows(token_stream(tokenizer, d), per_dataset, prompt_tokens, continuation_tokens, rng, d)
              for d in datasets]
    return Workload("text", tuple(interleave(groups)))
