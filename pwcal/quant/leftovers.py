"""What a killed ``pwcal quantize`` leaves beside its output, finished or undone by the next run.

``quantize`` builds ``OUT.partial/``, renames an existing ``OUT`` to ``OUT.old``, renames ``OUT.partial`` to
``OUT`` and removes ``OUT.old``; SIGKILL can stop it between any two of these steps, when no cleanup runs.
``recover_leftovers`` puts the directory back in order under the writer lock, with a one-line notice per action.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from pwformat.checksums import verify_files
from pwformat.errors import PagedWeightError
from pwformat.manifest import read_manifest


def _complete_artifact(path: Path) -> bool:
    """True if ``path`` holds a whole artifact: a valid manifest with checksums and files that match them."""
    try:
        m = read_manifest(path)
        if not m.complete("quantize") or m.checksums is None:
            return False
        verify_files(path, m.checksums, m.checked_files(), m.model.path)
        return True
    except PagedWeightError:
        return False


def recover_leftovers(out: Path, notice: Callable[[str], None]) -> None:
    """Finish or undo what a killed run left beside ``out`` (call with its writer lock held): ``OUT.partial`` and
    ``OUT.old`` exist only while a run writes, so any found now is a dead run's. Between the final two renames (no
    ``OUT``, a complete ``OUT.partial``): the new artifact is moved into place; with an incomplete one, the previous
    artifact (``OUT.old``) comes back. Every other leftover is removed. ``notice(line)`` says what was done."""
    partial, old = out.with_name(out.name + ".partial"), out.with_name(out.name + ".old")
    if not out.exists() and partial.is_dir() and _complete_artifact(partial):
        partial.replace(out)
        notice(f"{out}: finished a previous run that was stopped between its final renames (its complete "
               f"{partial.name} is now {out.name})")
    elif not out.exists() and old.is_dir():
        old.replace(out)
        notice(f"{out}: restored the previous artifact from {old.name} (a run was stopped before its new one was "
               "complete)")
    for left in (partial, old):
        if left.exists():
            shutil.rmtree(left, ignore_errors=True)
            notice(f"{out}: removed {left.name}, left by a stopped run")
