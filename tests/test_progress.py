"""Progress when the output is not a terminal: a line per task every few seconds and at completion."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.progress import Progress

import pwrun.progress as pp


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=terminal, width=200), buf


def test_a_terminal_gets_live_bars_and_a_pipe_gets_lines() -> None:
    assert isinstance(pp.progress(_console(True)[0]), Progress)
    assert isinstance(pp.progress(_console(False)[0]), pp.LineProgress)


def test_lines_are_throttled_and_the_last_one_is_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(pp.time, "monotonic", lambda: now[0])
    console, buf = _console(False)
    with pp.progress(console, every=5.0) as bar:
        task = bar.add_task("search", total=10, rate="")
        for i in range(1, 11):
            now[0] += 1.5  # a step every 1.5 s: lines at 1.5 s (first), 7.5 s, 13.5 s and the completion at 15 s
            bar.update(task, completed=i, rate=f"{i} tok/s")
    lines = buf.getvalue().splitlines()
    # ETA: the time left at the mean rate so far (1.5 s per step)
    assert lines == ["search: 1/10 (2 s, ETA 14 s) 1 tok/s", "search: 5/10 (8 s, ETA 8 s) 5 tok/s",
                     "search: 9/10 (14 s, ETA 2 s) 9 tok/s", "search: 10/10 (15 s) 10 tok/s"]


def test_a_task_whose_pace_is_not_its_own_shows_no_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests arriving over time: the rate so far says nothing of the time left."""
    now = [0.0]
    monkeypatch.setattr(pp.time, "monotonic", lambda: now[0])
    console, buf = _console(False)
    with pp.progress(console, every=1.0) as bar:
        task = bar.add_task("serving requests", total=2, rate="", eta=False)
        now[0] = 65.0
        bar.update(task, completed=1, rate="3.0 tok/s")
    assert buf.getvalue().splitlines() == ["serving requests: 1/2 (65 s) 3.0 tok/s"]


def test_advance_and_an_unfinished_task_report_at_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(pp.time, "monotonic", lambda: now[0])
    console, buf = _console(False)
    with pp.progress(console, every=60.0) as bar:
        a, b = bar.add_task("windows", total=4), bar.add_task("no total", total=None)
        bar.advance(a, 1)  # first line of ``a``
        now[0] = 2.0
        bar.advance(a, 1)  # throttled
        bar.advance(b, 3)  # first line of ``b``
    # at exit: the unfinished task whose count moved since its last line; not the one whose last line is current
    # no ETA before time has passed or without a total
    assert buf.getvalue().splitlines() == ["windows: 1/4 (0 s)", "no total: 3 (2 s)",
                                           "windows: 2/4 (2 s, ETA 2 s)"]


def test_fractional_amounts_are_shown_to_one_decimal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A size in MiB (``pwcal verify``) reads as 4/63.1, not 4/63.0755."""
    now = [0.0]
    monkeypatch.setattr(pp.time, "monotonic", lambda: now[0])
    console, buf = _console(False)
    with pp.progress(console, every=60.0) as bar:
        t = bar.add_task("verifying, MiB", total=63.0755)
        bar.advance(t, 4.0)
        now[0] = 1.0
        bar.advance(t, 59.0755)
    assert buf.getvalue().splitlines() == ["verifying, MiB: 4/63.1 (0 s)", "verifying, MiB: 63.1/63.1 (1 s)"]
