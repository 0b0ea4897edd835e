"""Long-context passage retrieval in the LongBench style, built from WikiText-2 articles, scored by likelihood.

What it does: each question is a context of ``candidates`` real paragraphs, each from a different
WikiText-2 test article (the LongBench passage-retrieval layout: paragraphs of distinct Wikipedia
articles), and ``candidates`` passages: the opening ``answer_tokens`` tokens of one paragraph of the
context (the answer) and of one other paragraph of each remaining context article (same topics, not
in the context). Which passage did the context hold? Each passage c is scored by how much the
context raises its likelihood, ``log p(c | context) - log p(c | separator)`` (pointwise mutual
information: the passage's own fluency cancels, so without using the context the accuracy is chance,
1 / candidates); the prediction is the best-scoring passage and the metric top-1 accuracy. This is
the likelihood-ranking form of "which paragraph is this from" that a small model can be scored on
without free generation. Every score is one request: (question, passage) with the context
(task ``retrieval``) and without it (task ``retrieval-prior``, a short request).

Context length: the bundled tiny model was trained on 2,048-token sequences and its perplexity at positions
1,024-2,048 is no worse than at 256-512 (``tools/context_probe.py``, docs/eval/README.md), so the default contexts
(8 paragraphs of up to 238 tokens: 1.2-1.8k tokens) stay within its trained length and the KV pressure comes from
long requests, many at once. No model is run here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from pweval.workload import Request, Workload
from pwformat.errors import PagedWeightError
from pwrun.data import read_documents

TASK, PRIOR = "retrieval", "retrieval-prior"
SEPARATOR = "\n\n"


@dataclass(frozen=True)
class RetrievalSpec:
    """``questions`` items; context of at most ``context_tokens`` tokens; ``candidates`` passages per item."""

    questions: int = 24
    context_tokens: int = 1920
    candidates: int = 8
    answer_tokens: int = 24
    seed: int = 0
    dataset: str = "wikitext2"

    def __post_init__(self) -> None:
        if self.questions < 1 or self.candidates < 2 or self.answer_tokens < 1:
            raise PagedWeightError("retrieval needs >= 1 question, >= 2 candidates and >= 1 answer token")
        if self.context_tokens // self.candidates <= self.answer_tokens + 1:
            raise PagedWeightError(f"a retrieval context of {self.context_tokens} tokens cannot hold {self.candidates}"
                                   f" paragraphs of more than {self.answer_tokens} tokens: raise the context length")


@dataclass(frozen=True)
class RetrievalItem:
    """One question: ``context`` token ids (ending with the separator); ``candidates`` passages; ``answer`` index."""

    context: tuple[int, ...]
    separator: tuple[int, ...]
    candidates: tuple[tuple[int, ...], ...]
    answer: int


def articles(dataset: str, min_words: int = 40) -> list[list[str]]:
    """Paragraphs (rows of >= ``min_words`` words) of each article (``= Title =`` rows start one; WikiText layout)."""
    out: list[list[str]] = []
    for row in read_documents(dataset):
        t = row.strip()
        if t.startswith("= ") and t.endswith(" =") and not t.startswith("= ="):
            out.append([])
        elif out and t and not t.startswith("=") and len(t.split()) >= min_words:
            out[-1].append(t)
    return [a for a in out if len(a) >= 2]


def build_items(tokenizer: Any, spec: RetrievalSpec) -> list[RetrievalItem]:
    """``spec.questions`` retrieval questions (seeded); raises ``PagedWeightError`` if the text is too small."""
    arts = articles(spec.dataset)
    if len(arts) < spec.candidates:
        raise PagedWeightError(f"{spec.dataset} has {len(arts)} articles with 2+ paragraphs, fewer than "
                               f"{spec.candidates} candidates")
    rng = np.random.default_rng(spec.seed)

    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False, verbose=False).input_ids)

    sep = tuple(enc(SEPARATOR))
    per = spec.context_tokens // spec.candidates - len(sep)
    items = []
    for _ in range(spec.questions):
        chosen = rng.choice(len(arts), size=spec.candidates, replace=False).tolist()
        inside, outside = [], []
        for a in chosen:
            i, o = rng.choice(len(arts[a]), size=2, replace=False).tolist()
            inside.append(enc(" " + arts[a][i])[:per])
            outside.append(enc(" " + arts[a][o])[:spec.answer_tokens])
        answer = int(rng.integers(spec.candidates))
        passages = [tuple(inside[k][:spec.answer_tokens]) if k == answer else tuple(outside[k])
                    for k in range(spec.candidates)]
        context = [t for k in rng.permutation(spec.candidates).tolist() for t in (*inside[k], *sep)]
        items.append(RetrievalItem(tuple(context), sep, tuple(passages), answer))
    return items


def retrieval_workload(items: list[RetrievalItem]) -> Workload:
    """Per (question, passage): the request with the context, then the short one with the separator only."""
    reqs = []
    for q, it in enumerate(items):
        for c, cand in enumerate(it.candidates):
            reqs.append(Request(it.context, cand, TASK, q, c))
            reqs.append(Request(it.separator, cand, PRIOR, q, c))
    return Workload(TASK, tuple(reqs))


def scores(items: list[RetrievalItem], requests: tuple[Request, ...] | list[Request],
           logprobs: list[np.ndarray]) -> np.ndarray:
    """[questions, candidates] PMI scores (nats): sum log p(c | context) - sum log p(c | separator).

    ``logprobs[k]``: per-token log p (nats) of ``requests[k]``'s continuation; other tasks are skipped.
    Raises ``ValueError`` if a score is missing.
    """
    s = np.full((len(items), max(len(it.candidates) for it in items), 2), np.nan)
    for r, lp in zip(requests, logprobs, strict=True):
        if r.task in (TASK, PRIOR):
            s[r.item, r.candidate, int(r.task == PRIOR)] = float(np.sum(lp))
    if np.isnan(s).any():
        raise ValueError("a retrieval question lacks a scored passage")
    return s[..., 0] - s[..., 1]


def accuracy(items: list[RetrievalItem], requests: tuple[Request, ...] | list[Request],
             logprobs: list[np.ndarray]) -> float:
    """Top-1 accuracy of the PMI ranking (chance = 1 / candidates)."""
    return float(np.mean(scores(items, requests, logprobs).argmax(axis=1) == [it.answer for it in items]))
