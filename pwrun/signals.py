"""SIGTERM for the command lines: one line and exit code 143 instead of a silent kill, and cleanup that runs.

``exit_quietly_on_sigterm`` is the first thing the console scripts do (``pweval.main``, ``pwcal.main``), before
they import torch; ``raise_terminated`` is the handler ``pwrun.cli_common.user_errors`` installs while a command
works, turning SIGTERM into ``Terminated`` so that ``finally`` blocks (e.g. quantize removing ``OUT.partial``) run.
It imports only the standard library, so the entry points stay fast.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM as an exception (raised by ``raise_terminated``): the default action ends the process at once, so
    a stage's cleanup (e.g. quantize removing its ``OUT.partial``) never ran."""


_terminated = threading.Event()  # set once SIGTERM was turned into ``Terminated``


def raise_terminated(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the cleanup it starts
    _terminated.set()
    raise Terminated()


def reset_terminated() -> None:
    """Forget an earlier SIGTERM (a new command starts; in-process callers such as tests run several)."""
    _terminated.clear()


def terminated() -> bool:
    """Whether ``raise_terminated`` ran in this process: native code (e.g. safetensors reading a tensor) can turn
    the ``Terminated`` raised inside it into another exception, which is then the stop all the same."""
    return _terminated.is_set()


def _exit_terminated(signum: int, frame: object) -> None:
    """Before any work: one line, then exit 143 at once. ``os._exit``, not ``sys.exit``: a SystemExit raised by a
    signal handler inside an import can be wrapped (Python 3.11 wraps one raised in a class's ``__set_name__``
    into a RuntimeError, which printed a traceback and exit 1); nothing is open for writing yet."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.stderr.write("terminated (SIGTERM)\n")
    sys.stderr.flush()
    os._exit(143)


def exit_quietly_on_sigterm() -> None:
    """The command lines' entry: SIGTERM outside ``user_errors`` (while a command imports torch, before any work
    or output) exits with one line and code 143 instead of the default silent kill; ``user_errors`` replaces
    it while a command works."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_terminated)


def _exit_interrupted(signum: int, frame: object) -> None:
    """Ctrl-C while a command line imports torch (before any work): one line, exit 130 (see ``_exit_terminated``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stderr.write("interrupted (Ctrl-C) while starting: nothing was run or written\n")
    sys.stderr.flush()
    os._exit(130)


def quiet_interrupt_while_starting() -> Callable[[], None]:
    """Ctrl-C during the command line's imports exits with one line and code 130 instead of a traceback from
    inside an import; returns the function that restores the previous SIGINT handler (call it once the CLI is
    imported, so that commands see ``KeyboardInterrupt`` as before). A SIGINT that the shell set to be ignored
    (a background job) stays ignored."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return lambda: None
    signal.signal(signal.SIGINT, _exit_interrupted)

    def restore() -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)

    return restore


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends, then act as they would have (their handlers run then): for
    short steps that must finish once begun, e.g. a stage writing its tables and recording them in the manifest.
    Outside the main thread (where handlers cannot be set) the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    sigs = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in sigs}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if pending:
            signal.raise_signal(pending[0])
