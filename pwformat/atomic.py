"""Atomic file writes: readers see the old file or the new one, never half of one.

``atomic_path`` hands out ``path.tmp`` and renames it over ``path`` when the ``with`` block ends normally;
``write_atomic`` writes bytes through it, fsynced. ``default_mode`` gives a file the permissions of one made by
``open`` (a writer that creates 0600 files, such as safetensors', would hide an artifact from other users).
``fault_point`` marks a write point for the fault-injection
tests (a no-op unless ``PAGEDWEIGHT_FAULT_AT`` is set). It imports no torch.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FAULT_ENV = "PAGEDWEIGHT_FAULT_AT"
fault_points = 0  # write points passed in this process while FAULT_ENV is set


def fault_point() -> None:
    """A write point: with ``PAGEDWEIGHT_FAULT_AT=N`` in the environment, the N-th call in this process kills it
    with SIGKILL (no cleanup runs, as after a power cut or the OOM killer), so that tests can stop a stage between
    any two of its writes. Does nothing when the variable is unset."""
    global fault_points
    at = os.environ.get(FAULT_ENV)
    if at:
        fault_points += 1
        if fault_points == int(at):
            os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """The ``path.tmp`` to write: renamed to ``path`` when the block ends normally, removed when it raises anything
    (``OSError`` such as a full disk, Ctrl-C, or SIGTERM, which ``pwrun.cli_common.user_errors`` turns into an
    exception), so readers never see a partial file and nothing half-written is left. Re-raises.

    A symbolic link is followed (its target is replaced, the link stays); a path that exists but is not a regular
    file (``/dev/null``, a FIFO) is yielded itself and written in place: renaming over it would replace the device.
    """
    if path.is_symlink():
        path = path.resolve()
    if path.exists() and not path.is_file():
        yield path
        return
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        fault_point()
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def default_mode(path: Path) -> None:
    """Set ``path``'s permissions to what ``open`` would have created: 0666 less the process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    path.chmod(0o666 & ~mask)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via ``atomic_path`` (fsynced). Raises ``OSError`` (disk full, no permission)."""
    with atomic_path(path) as tmp, tmp.open("wb") as f:
        f.write(data)
        f.flush()
        if tmp.is_file():  # a device written in place (``atomic_path``) cannot be fsynced
            os.fsync(f.fileno())
