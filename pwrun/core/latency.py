"""Per-request serving times and their summary: TTFT, TPOT, queueing time, goodput (control plane, no torch).

What it does: ``RequestTimes`` holds one request's arrival, first scheduled, first token and finish times
(seconds from the start of the run, as the run loop records them at step boundaries: a step's start for
scheduling, its end for tokens). ``latency_stats`` reduces them to p50 / p99 (``numpy.percentile``, linear
interpolation) of the time to first token (arrival -> first token), the time per output token ((finish - first
token) / (output tokens - 1), over requests with at least two tokens) and the queueing time (arrival -> first
scheduled), plus goodput: the requests that met every SLO given (``SLO``; none: every completed request) per
second of the run (its start to the last finish).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class RequestTimes:
    """Seconds from the start of the run; None until it happens. ``tokens``: output tokens so far."""

    arrival: float
    scheduled: float | None = None
    first_token: float | None = None
    finish: float | None = None
    tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def queueing(self) -> float | None:
        return None if self.scheduled is None else self.scheduled - self.arrival

    @property
    def tpot(self) -> float | None:
        """Decode seconds per output token after the first (None with fewer than two tokens)."""
        if self.finish is None or self.first_token is None or self.tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.tokens - 1)


@dataclass(frozen=True)
class SLO:
    """Service-level objectives a request must meet to count towards goodput (milliseconds; None: not set)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name, v in (("ttft_ms", self.ttft_ms), ("tpot_ms", self.tpot_ms)):
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"SLO {name} must be a finite number of milliseconds > 0, got {v}")

    def met(self, t: RequestTimes) -> bool:
        """``t`` finished and met every objective set (a one-token request has no TPOT: that one is met)."""
        if t.finish is None or t.ttft is None:
            return False
        if self.ttft_ms is not None and 1e3 * t.ttft > self.ttft_ms:
            return False
        tpot = t.tpot
        return self.tpot_ms is None or tpot is None or 1e3 * tpot <= self.tpot_ms


@dataclass(frozen=True)
class LatencyStats:
    """TTFT and queueing p50 / p99 in seconds, TPOT p50 / p99 in milliseconds (NaN without a sample);
    ``requests_completed`` / ``requests_met_slo``; ``duration_s``: start of the run to the last finish;
    ``goodput_rps``: ``requests_met_slo`` / ``duration_s``."""

    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    queue_p50_s: float
    queue_p99_s: float
    requests_completed: int
    requests_met_slo: int
    duration_s: float
    goodput_rps: float


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else math.nan


def latency_stats(times: list[RequestTimes], slo: SLO | None = None) -> LatencyStats:
    """The summary of ``times`` (see ``LatencyStats``); ``slo`` None: goodput counts every completed request."""
    slo = slo or SLO()
    done = [t for t in times if t.finish is not None]
    ttft = [x for t in times if (x := t.ttft) is not None]
    tpot = [1e3 * x for t in done if (x := t.tpot) is not None]
    queue = [x for t in times if (x := t.queueing) is not None]
    met = sum(slo.met(t) for t in done)
    duration = max((t.finish for t in done if t.finish is not None), default=0.0)
    return LatencyStats(_pct(ttft, 50), _pct(ttft, 99), _pct(tpot, 50), _pct(tpot, 99), _pct(queue, 50),
                        _pct(queue, 99), len(done), met, duration, met / duration if duration > 0 else 0.0)
