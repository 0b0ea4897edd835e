"""How many kernels Triton's on-disk cache holds: a count that grows during a timed run means a kernel
specialization was compiled inside it (JIT time in the timing; the warm-up did not cover that specialization)."""

from __future__ import annotations

import os
from pathlib import Path


def triton_cache_entries() -> int:
    """Kernel directories in Triton's cache: $TRITON_CACHE_DIR, else $TRITON_HOME (or the home folder)/.triton/cache,
    as Triton picks it; 0 if it is absent or not a directory."""
    d = os.environ.get("TRITON_CACHE_DIR") or Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton" / "cache"
    d = Path(d)
    return sum(1 for e in d.iterdir() if e.is_dir()) if d.is_dir() else 0
