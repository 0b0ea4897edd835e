"""Atomic file writes: readers see the old file or the new one, never half of one.

``atomic_path`` hands out ``path.tmp`` and renames it over ``path`` when the ``with`` block ends normally;
``write_atomic`` writes bytes through it, fsynced. It imports no torch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """The ``path.tmp`` to write: renamed to ``path`` when the block ends normally, removed when it raises anything
    (``OSError`` such as a full disk, Ctrl-C, or SIGTERM, which ``pwrun.cli_common.user_errors`` turns into an
    exception), so readers never see a partial file and nothing half-written is left. Re-raises."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via ``atomic_path`` (fsynced). Raises ``OSError`` (disk full, no permission)."""
    with atomic_path(path) as tmp, tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
