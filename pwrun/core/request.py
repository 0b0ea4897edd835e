"""Requests in and out of the engine core: ``SamplingParams``, ``Request`` (frozen input), ``RequestOutput``.

What it does: a ``Request`` is what a caller hands the engine (token ids, sampling parameters, a token
budget, optionally the continuation to feed instead of sampling: teacher forcing); a ``RequestOutput``
is what the engine hands back after each step that sampled for the request. The scheduler keeps its
own per-request state (``pwrun.core.scheduler.RequestState``); callers never see it. Plain data, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["eos", "length", "abort"]
# Sampling temperatures allowed besides 0: below the minimum the distribution is the argmax anyway (and logits / T
# overflow), above the maximum it is uniform to within float precision.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 = greedy, else in [``MIN_TEMPERATURE``, ``MAX_TEMPERATURE``]; ``top_p`` in (0, 1] keeps
    the smallest set of tokens of that mass; request ``rid`` samples from a generator seeded ``seed + rid``
    (reproducible whatever else runs in the batch)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        t = self.temperature
        if not (math.isfinite(t) and (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)):
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                             f"got {t}")
        if not 0 < self.top_p <= 1:  # also refuses nan
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class Request:
    """Request ``rid``: ``prompt`` token ids, at most ``max_new_tokens`` new ones (``params.max_new_tokens`` if
    None), stopping at any of ``eos`` (never with ``forced``); ``forced``: continuation tokens fed instead of
    sampled ones, each scored (``RequestOutput.logprobs``), the request then runs for exactly that many;
    ``seed``: its sampling generator's seed (None: ``params.seed + rid``)."""

    rid: int
    prompt: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int | None = None
    eos: frozenset[int] = frozenset()
    forced: tuple[int, ...] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.rid} has an empty prompt")
        if self.forced is not None and not self.forced:
            raise ValueError(f"request {self.rid}: a forced continuation needs at least one token")
        if min(self.prompt) < 0 or (self.forced is not None and min(self.forced) < 0):
            raise ValueError(f"request {self.rid}: token ids must be >= 0")

    @property
    def budget(self) -> int:
        """New tokens this request may produce."""
        if self.forced is not None:
            return len(self.forced)
        return self.max_new_tokens if self.max_new_tokens is not None else self.params.max_new_tokens


@dataclass(frozen=True)
class RequestOutput:
    """Request ``rid`` after a step: every token it produced so far (``token_ids``), the log-probabilities of
    its forced tokens (nats; empty without forcing), its prompt length, ``finish`` once done, and the times it
    was preempted."""

    rid: int
    token_ids: tuple[int, ...]
    prompt_tokens: int
    finish: FinishReason | None = None
    logprobs: tuple[float, ...] = ()
    preemptions: int = 0

    @property
    def finished(self) -> bool:
        return self.finish is not None
