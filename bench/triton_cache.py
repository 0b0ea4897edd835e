"""How many kernels Triton's on-disk cache holds: a count that grows during a timed run means a kernel
specialization was compiled inside it (JIT time in the timing; the warm-up did not cover that specialization)."""

from __future__ import annotations

import os
from pathlib import Path


def _cache_dir() -> Path:
    """$TRITON_CACHE_DIR, else $TRITON_HOME (or the home folder)/.triton/cache, as Triton picks it."""
    return Path(os.environ.get("TRITON_CACHE_DIR")
                or Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton" / "cache")


def triton_cache_dirs() -> set[str]:
    """Names of the kernel directories in Triton's cache (one per compiled specialization); empty if the cache is
    absent or not a directory."""
    d = _cache_dir()
    return {e.name for e in d.iterdir() if e.is_dir()} if d.is_dir() else set()


def triton_cache_entries() -> int:
    """How many kernel directories Triton's cache holds (``triton_cache_dirs``); 0 if it is absent."""
    return len(triton_cache_dirs())


def kernel_names(dirs: set[str]) -> list[str]:
    """Kernel names of the given cache directories (the stem of each ``*.json`` metadata file Triton writes
    beside the binary, e.g. ``_gemv1_down_kernel``), sorted, with repeats: which specializations were compiled."""
    d = _cache_dir()
    return sorted(f.stem for n in dirs for f in (d / n).glob("*.json") if not f.name.startswith("__grp__"))
