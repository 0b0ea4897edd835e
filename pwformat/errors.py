"""User-facing errors of PagedWeight.

What it does: one exception type whose message is a single line saying what is wrong and
what to do. The CLIs catch it and print ``error: <message>`` with exit code 2, so a user
never sees a traceback from deep inside torch for bad input. It does not wrap bugs: an
unexpected exception still surfaces as a traceback.
"""

from __future__ import annotations


class PagedWeightError(Exception):
    """Bad input or an unsupported model, explained in one line with the fix."""


class BudgetTooSmall(PagedWeightError):
    """A ``--gpu-memory`` below what the experts' floors and the longest request need; ``minimum`` in bytes."""

    def __init__(self, message: str, minimum: int) -> None:
        super().__init__(message)
        self.minimum = minimum
