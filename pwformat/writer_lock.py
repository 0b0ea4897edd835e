"""One writer per artifact directory: a run that builds ``OUT`` holds ``OUT.lock`` while it writes.

Why: ``pwcal quantize`` builds ``OUT.partial/`` and renames it into place (``pwcal.quant.quantize``). A second run
on the same ``OUT`` would delete the first one's ``OUT.partial/`` as a stale leftover, and the first one's cleanup
would then delete the second one's: both lose their work. With the lock the second run stops at once with a
one-line error, and the first one's files are untouched. Not a SPEC method: it serves the guide's rule that bad
input loses nothing.

How: an exclusive, non-blocking ``flock`` on ``OUT.lock`` (Linux/POSIX; released by the kernel if the process
dies, so a killed run leaves no stale lock, only an empty file that the next run reuses). The file names the
holder's process id; it is removed on a normal exit.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pwformat.errors import PagedWeightError


def lock_path(out: Path) -> Path:
    """``OUT.lock``: beside ``out``, not inside it (``out`` is renamed into place as a whole)."""
    return out.with_name(out.name + ".lock")


def _open_locked(path: Path, out: Path) -> int:
    """A descriptor of ``path`` holding its exclusive lock. A holder that finishes between our open and our flock
    removes the file we opened: then the lock we got is on a stale file, and we open the new one (a few tries).
    Raises ``PagedWeightError`` if another process holds the lock or the file cannot be opened."""
    for _ in range(5):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            fix = f"remove {path}" if exc.errno == errno.EISDIR else "give --out where you can write"
            raise PagedWeightError(f"cannot create the lock file {path}: {exc.strerror}; {fix}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise PagedWeightError(f"another run (process {holder}) is writing {out}: wait for it to finish, or give "
                                   f"another --out") from None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise PagedWeightError(f"other runs keep taking the lock of {out}: wait for them to finish, or give another --out")


@contextmanager
def writer_lock(out: Path) -> Iterator[None]:
    """Hold the exclusive writer lock of ``out`` for the ``with`` block. Raises ``PagedWeightError`` (one line, what
    to do) if another process holds it, or if the lock file cannot be created."""
    path = lock_path(out)
    fd = _open_locked(path, out)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        try:
            yield
        finally:
            path.unlink(missing_ok=True)  # while still locked: a run that opened it before retries on a fresh one
    finally:
        os.close(fd)
