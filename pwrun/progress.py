"""Progress of long work on a terminal and in logs.

What it does: ``progress`` gives a rich ``Progress`` (live bars) when the console is a terminal, and otherwise a
``LineProgress`` with the same calls (``add_task``, ``update``, ``advance``) that prints one plain line per task
every ``every`` seconds and when the task completes, with the time left at the task's mean rate so far, so a log
or a pipe shows that long work (calibration windows, a bucket search, serving) is moving and when it will end. It
does no work of its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import Progress, ProgressColumn, TaskID

LINE_SECONDS = 5.0  # seconds between two lines of one task when the output is not a terminal


@dataclass
class _Task:
    description: str
    total: float | None
    started: float
    completed: float = 0.0
    fields: dict[str, Any] = field(default_factory=dict)
    printed: float | None = None  # time of the last line (None: none yet, so the first update prints one)
    shown: float = 0.0  # ``completed`` in the last line
    done: bool = False


class LineProgress:
    """``rich.progress.Progress``'s task calls, printed as ``description: completed/total (elapsed s, ETA s)`` lines
    (no ETA before a unit has completed and time has passed, without a total, at completion, and for a task added
    with ``eta=False``: one whose pace is not its own, e.g. requests arriving over time); fractional amounts to one
    decimal."""

    def __init__(self, console: Console, every: float = LINE_SECONDS) -> None:
        self.console, self.every = console, every
        self.tasks: list[_Task] = []

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            for i, t in enumerate(self.tasks):
                if not t.done and t.completed != t.shown:
                    self._line(TaskID(i))

    def start(self) -> None:
        """Nothing to start (rich's ``Progress.start``)."""

    def stop(self) -> None:
        self.__exit__(None, None, None)

    def add_task(self, description: str, total: float | None = 100.0, **fields: Any) -> TaskID:
        self.tasks.append(_Task(description, total, started=time.monotonic(), fields=dict(fields)))
        return TaskID(len(self.tasks) - 1)

    def advance(self, task: TaskID, advance: float = 1.0) -> None:
        self.update(task, advance=advance)

    def update(self, task: TaskID, completed: float | None = None, advance: float | None = None,
               total: float | None = None, description: str | None = None, **fields: Any) -> None:
        t = self.tasks[task]
        if total is not None:
            t.total = total
        if description is not None:
            t.description = description
        if completed is not None:
            t.completed = completed
        if advance is not None:
            t.completed += advance
        t.fields.update(fields)
        finished = t.total is not None and t.completed >= t.total
        if finished and not t.done:
            t.done = True
            self._line(task)
        elif not finished and (t.printed is None or time.monotonic() - t.printed >= self.every):
            self._line(task)

    def _line(self, task: TaskID) -> None:
        t = self.tasks[task]
        t.printed, t.shown = time.monotonic(), t.completed
        total = "" if t.total is None else f"/{_num(t.total)}"
        elapsed = t.printed - t.started
        eta = ""
        if (t.total is not None and 0 < t.completed < t.total and elapsed > 0  # the mean rate since add_task
                and t.fields.get("eta", True) is not False):
            eta = f", ETA {elapsed * (t.total - t.completed) / t.completed:.0f} s"
        extra = " ".join(str(v) for k, v in t.fields.items() if v not in ("", None) and k != "eta")
        self.console.print(f"{t.description}: {_num(t.completed)}{total} ({elapsed:.0f} s{eta})"
                           + (f" {extra}" if extra else ""), highlight=False, markup=False)


def _num(x: float) -> str:
    """A count as a whole number, a fractional amount (e.g. MiB) to one decimal."""
    return f"{x:.0f}" if float(x).is_integer() else f"{x:.1f}"


def progress(console: Console, *columns: str | ProgressColumn, transient: bool = False,
             every: float = LINE_SECONDS) -> Progress | LineProgress:
    """Live bars on a terminal; plain lines every ``every`` seconds otherwise (logs, pipes, CI)."""
    if console.is_terminal:
        return Progress(*columns, console=console, transient=transient)
    return LineProgress(console, every)
