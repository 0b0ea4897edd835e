"""One writer per artifact directory: every pwcal stage that writes ``OUT`` holds ``OUT.lock`` for the whole stage.

Why: ``pwcal quantize`` builds ``OUT.partial/`` and renames it into place (``pwcal.quant.quantize``); the later
stages write tables into ``OUT`` and record them in its manifest. Two writers at once would delete each other's
work or leave tables of different runs recorded as complete. With the lock the second writer stops at once with a
one-line error naming the holder, and the first one's files are untouched. Not a SPEC method: it serves the
guide's rule that bad input loses nothing.

How: an exclusive, non-blocking ``flock`` on ``OUT.lock`` (Linux/POSIX; released by the kernel if the process
dies, so a killed run leaves no stale lock, only an empty file that the next run reuses). The file names the
holder's process id; it is removed on a normal exit.

Readers (``pwrun``) do not lock: ``check_no_writer`` refuses an artifact while a stage is writing it, and what
they read after that is checked against the manifest they read (content checksums, the quantize run id in every
layer file and table), so a stage that starts meanwhile is caught, never served silently.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pwformat.errors import PagedWeightError

_held: set[Path] = set()  # lock files this process holds (its own stage may read the artifact it writes)


def lock_path(out: Path) -> Path:
    """``OUT.lock``: beside ``out``, not inside it (``out`` is renamed into place as a whole)."""
    return out.with_name(out.name + ".lock")


def _try_flock(fd: int, kind: int, tries: int = 5) -> bool:
    """Take ``flock(kind)`` without blocking, retrying a few times 20 ms apart (a reader's ``check_no_writer``
    holds a shared lock for an instant); False if another process keeps it."""
    for i in range(tries):
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if i + 1 < tries:
                time.sleep(0.02)
    return False


def _regular(fd: int, path: Path) -> int:
    """``fd`` if it is a regular file; else closes it and raises ``PagedWeightError`` (a FIFO or a device there
    would block or refuse the lock)."""
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    raise PagedWeightError(f"{path} is not a regular file: remove it (pwcal creates its lock file there while a "
                           "stage writes)")


def _open_locked(path: Path, out: Path) -> int:
    """A descriptor of ``path`` holding its exclusive lock. A holder that finishes between our open and our flock
    removes the file we opened: then the lock we got is on a stale file, and we open the new one (a few tries).
    Raises ``PagedWeightError`` if another process holds the lock or the file cannot be opened."""
    for _ in range(5):
        try:
            fd = _regular(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644), path)
        except OSError as exc:
            fix = f"remove {path}" if exc.errno == errno.EISDIR else "give --out where you can write"
            raise PagedWeightError(f"cannot create the lock file {path}: {exc.strerror}; {fix}") from exc
        if not _try_flock(fd, fcntl.LOCK_EX):
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise PagedWeightError(f"another run (process {holder}) is writing {out}: wait for it to finish, or write "
                                   "to another --out/--artifacts directory") from None
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
    path = lock_path(Path(os.path.abspath(out)))
    fd = _open_locked(path, out)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        _held.add(path)
        try:
            yield
        finally:
            _held.discard(path)
            path.unlink(missing_ok=True)  # while still locked: a run that opened it before retries on a fresh one
    finally:
        os.close(fd)


def check_no_writer(out: Path) -> None:
    """Raise ``PagedWeightError`` naming the holder if another process holds ``out``'s writer lock (a pwcal stage
    is writing it). Takes no lock and creates no file."""
    path = lock_path(Path(os.path.abspath(out)))
    if path in _held:
        return
    try:
        fd = _regular(os.open(path, os.O_RDONLY | os.O_NONBLOCK), path)
    except OSError:
        return  # no lock file: nobody writes
    try:
        if not _try_flock(fd, fcntl.LOCK_SH, tries=1):
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise PagedWeightError(f"a pwcal stage (process {holder}) is writing {out}: wait for it to finish, then "
                                   "run this again")
    finally:
        os.close(fd)
