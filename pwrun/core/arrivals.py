"""When each request of a workload arrives: ``ArrivalSchedule`` (control plane, no torch).

What it does: gives request i its arrival time, seconds from the start of the run (after the engine is built and
warmed up). Three sources: every request at t=0 (``at_once``: a rate of ``inf``, the default, and what every run
did before arrival times existed); a Poisson process at ``rate`` requests/s from a seed (``poisson``: the first
request at t=0, then exponential gaps of mean 1/rate); or explicit timestamps (``from_times``, e.g. the optional
``arrival_s`` field of each line of a prompts or trace JSONL file, read by ``read_trace_arrivals``). It does not
admit anything: the run loop (``LLMEngine.run_until_done``) queues each request in the engine at its time, where
a request that does not fit yet waits; nothing is dropped or truncated.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pwformat.errors import PagedWeightError
from pwformat.jsonl import jsonl_rows

ARRIVAL_FIELD = "arrival_s"  # the optional per-line field of a prompts / trace JSONL file (seconds from the start)


@dataclass(frozen=True)
class ArrivalSchedule:
    """``times[i]``: request i's arrival, seconds from the start of the run (finite, >= 0; any order);
    ``rate``: the offered rate in requests/s (``inf``: every request at t=0). Raises ``ValueError`` on a bad
    time or rate."""

    times: tuple[float, ...]
    rate: float

    def __post_init__(self) -> None:
        for i, t in enumerate(self.times):
            if not (isinstance(t, float | int) and math.isfinite(t) and t >= 0):
                raise ValueError(f"arrival time of request {i} must be a finite number >= 0 (seconds), got {t!r}")
        if not (self.rate > 0):  # also refuses nan
            raise ValueError(f"the request rate must be > 0 requests/s (inf: all at once), got {self.rate}")

    @classmethod
    def at_once(cls, n: int) -> ArrivalSchedule:
        """Every one of ``n`` requests at t=0."""
        return cls((0.0,) * n, math.inf)

    @classmethod
    def poisson(cls, n: int, rate: float, seed: int = 0) -> ArrivalSchedule:
        """``n`` arrivals of a Poisson process at ``rate`` requests/s: the first at t=0, then gaps drawn from an
        exponential distribution of mean 1/``rate`` s by ``numpy.random.default_rng(seed)`` (the same seed, the
        same times). ``rate`` ``inf``: ``at_once``."""
        if math.isinf(rate) and rate > 0:
            return cls.at_once(n)
        if not (rate > 0 and math.isfinite(rate)):
            raise ValueError(f"the request rate must be > 0 requests/s (inf: all at once), got {rate}")
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, max(n - 1, 0))
        return cls((0.0, *np.cumsum(gaps).tolist()) if n else (), float(rate))

    @classmethod
    def from_times(cls, times: list[float]) -> ArrivalSchedule:
        """Explicit arrival ``times`` (seconds from the start); the offered rate is (n - 1) / the span between
        the first and the last arrival (``inf`` if they coincide)."""
        ts = tuple(float(t) for t in times)
        span = max(ts) - min(ts) if ts else 0.0
        return cls(ts, (len(ts) - 1) / span if span > 0 else math.inf)

    @property
    def all_at_once(self) -> bool:
        return all(t == 0 for t in self.times)

    def order(self) -> list[int]:
        """Request indices in arrival order (ties: by index, so requests at the same time queue in file order)."""
        return sorted(range(len(self.times)), key=lambda i: (self.times[i], i))


def read_trace_arrivals(path: Path) -> list[float] | None:
    """The ``arrival_s`` of every non-empty line of the JSONL file ``path`` (the lines ``read_jsonl_field``
    reads, in order), or None if no line has one. Raises ``PagedWeightError`` naming ``path:line`` when a value is
    not a finite number >= 0, or when some lines have one and others do not (give every line one, or none)."""
    return trace_arrivals(path, jsonl_rows(path))


def trace_arrivals(path: Path, rows: Iterable[tuple[int, Any]]) -> list[float] | None:
    """``read_trace_arrivals`` over ``path``'s already parsed ``rows`` ((line number, value), ``jsonl_rows``)."""
    out: list[float | None] = []
    first_with: int | None = None
    first_without: int | None = None
    for lineno, row in rows:
        if not isinstance(row, dict) or ARRIVAL_FIELD not in row:
            first_without = first_without or lineno
            out.append(None)
            continue
        v = row[ARRIVAL_FIELD]
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise PagedWeightError(f"{path}:{lineno} has '{ARRIVAL_FIELD}': {json.dumps(v)}; give a finite number "
                                   "of seconds >= 0 from the start of the run")
        first_with = first_with or lineno
        out.append(float(v))
    if first_with is None:
        return None
    if first_without is not None:
        raise PagedWeightError(f"{path}:{first_without} has no '{ARRIVAL_FIELD}' but line {first_with} has one: give "
                               "every line an arrival time or none")
    return [float(t) for t in out if t is not None]
