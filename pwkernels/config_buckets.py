"""Launch configs bucketed by a size (tokens, sequences), as ``pwkernels/configs/*.json`` store them.

What it does: ``pick_bucket`` returns the config of the bucket whose lower bound is the largest one <= the size
(the first bucket's below all bounds), for every kernel that keeps tuned configs as such buckets
(``pwkernels.moe.dispatch`` by tokens, ``pwkernels.paged_attention`` by sequences). It does not read files or
merge defaults.
"""

from __future__ import annotations

from typing import Any


def pick_bucket(rows: list[dict[str, Any]], size: int, key: str) -> dict[str, Any] | None:
    """``rows[i]["config"]`` of the last row (rows ascending by ``key``) with ``rows[i][key] <= size``, the first
    row's if ``size`` is below every bound, None if there are no rows. An empty config is a valid answer (it means
    "the defaults"), so the choice is tracked by row, not by the config's truth value."""
    best: dict[str, Any] | None = None
    for row in rows:
        if best is None or size >= row[key]:
            best = row["config"]
    return best
