"""How many kernels Triton's on-disk cache holds: a count that grows during a timed run means a kernel
specialization was compiled inside it (JIT time in the timing; the warm-up did not cover that specialization)."""

from __future__ import annotations

import os
from pathlib import Path


def triton_cache_entries() -> int:
    """Entries (one directory per compiled kernel) in $TRITON_CACHE_DIR, else ~/.triton/cache; 0 if it is absent."""
    d = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return sum(1 for _ in d.iterdir()) if d.is_dir() else 0
