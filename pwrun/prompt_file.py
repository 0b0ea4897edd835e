"""The prompts file of ``pwrun generate --prompts``: its prompts (one JSON object with a ``prompt`` per line) and
when each request arrives (each line's ``arrival_s``, or Poisson arrivals at ``--request-rate``). The file is read
and parsed once (``PromptFile.read``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pwformat.errors import PagedWeightError
from pwformat.jsonl import jsonl_rows
from pwrun.core.arrivals import ArrivalSchedule, trace_arrivals
from pwrun.data import jsonl_field

READ_FIELDS = ("prompt", "arrival_s")  # what a prompts file's line may set


@dataclass(frozen=True)
class PromptFile:
    """A prompts file's prompts, its lines' arrival times (None if no line has one) and a one-line warning naming
    the fields its lines set that ``generate`` does not read (None if there are none)."""

    path: Path
    prompts: list[str]
    times: list[float] | None
    unread: str | None

    @classmethod
    def read(cls, path: Path) -> PromptFile:
        """Raises ``PagedWeightError`` naming file:line of an empty or bad prompt or arrival time."""
        if not path.is_file():
            raise PagedWeightError(f"prompts file {path} does not exist")
        rows = list(jsonl_rows(path))
        prompts = jsonl_field(path, rows, "prompt", nonempty=True)
        if not prompts:
            raise PagedWeightError(f"{path} holds no prompts (one JSON object with a 'prompt' field per line)")
        return cls(path, prompts, trace_arrivals(path, rows), _unread_fields(path, rows))


def _unread_fields(path: Path, rows: list[tuple[int, object]]) -> str | None:
    """The warning for the fields of ``rows`` that ``generate`` does not read (e.g. a ``max_tokens`` meant per
    request), with the first line that has them; None if there are none."""
    extra: dict[str, int] = {}
    for lineno, row in rows:
        if isinstance(row, dict):
            for key in row.keys() - set(READ_FIELDS):
                extra.setdefault(key, lineno)
    if not extra:
        return None
    first = min(extra.values())
    return (f"{path}:{first}: field(s) {', '.join(sorted(extra))} are not read (a line sets only "
            f"{' and '.join(READ_FIELDS)}; every request's length is --max-new-tokens)")


MAX_ARRIVAL_S = 7 * 86400  # a later arrival is a unit mistake (ms, epoch seconds), not a workload


def prompt_arrivals(prompts: PromptFile | None, count: int, rate: float, seed: int) -> ArrivalSchedule:
    """Request i's arrival: the ``arrival_s`` of line i of the prompts file if it has them, else Poisson at
    ``rate`` requests/s from ``seed`` (inf: all at t=0). Raises ``PagedWeightError`` on a bad rate or time, or on
    both a finite rate and a file with times."""
    if math.isnan(rate) or rate <= 0:
        raise PagedWeightError(f"--request-rate {rate} is not allowed: give requests/s > 0, or inf (all at t=0)")
    if seed < 0:
        raise PagedWeightError(f"--arrival-seed {seed} is not allowed: give an integer >= 0")
    times = None if prompts is None else prompts.times
    if prompts is None or times is None:
        schedule = ArrivalSchedule.poisson(count, rate, seed)
        last = max(schedule.times, default=0.0)
        if last > MAX_ARRIVAL_S:
            raise PagedWeightError(f"--request-rate {rate:g} puts the last of {count} requests {last:.3g} s after "
                                   f"the start (more than {MAX_ARRIVAL_S // 86400} days): give a higher rate")
        return schedule
    if not math.isinf(rate):
        raise PagedWeightError(f"{prompts.path} gives each request an 'arrival_s': drop --request-rate {rate:g}, or "
                               "the arrival times from the file")
    if max(times, default=0.0) > MAX_ARRIVAL_S:
        raise PagedWeightError(f"{prompts.path} has an 'arrival_s' of {max(times):.3g} s, more than "
                               f"{MAX_ARRIVAL_S // 86400} days after the start: give seconds from the start of the run")
    return ArrivalSchedule.from_times(times)
