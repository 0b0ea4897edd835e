"""How many kernels Triton's on-disk cache holds: a count that grows during a timed run means a kernel
specialization was compiled inside it (JIT time in the timing; the warm-up did not cover that specialization).
``first_uses`` and ``missed_specializations`` say which specialization it was."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


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


def _describe(repr_: str, fn: Any, compile_: dict[str, Any]) -> str:
    """One specialization as Triton's hook gives it: ``name[options](arg: type or specialization, ...)`` and the
    constexpr values by parameter name (Triton keys them by argument index paths)."""
    names = getattr(getattr(fn, "jit_function", None), "arg_names", None) or []
    consts = {}
    for k, v in (compile_.get("constants") or {}).items():
        i = k[0] if isinstance(k, tuple) and k else k
        consts[names[i] if isinstance(i, int) and i < len(names) else str(k)] = v
    return f"{repr_} constexprs={consts}"


@contextmanager
def first_uses() -> Iterator[list[str]]:
    """Record, while the block runs, every kernel specialization this process launches for the first time (from its
    on-disk cache or compiled), described by ``_describe``: with ``kernel_names`` of the cache directories that
    appeared in the block, says which specialization the warm-up missed (seventeenth session: one ``_gemv_kernel``
    and one pair of ``_gemv1_*`` kernels, names only). Uses ``triton.knobs.runtime.jit_cache_hook`` (chained to a
    hook already set); records nothing where this Triton has no such knob or runs interpreted."""
    seen: list[str] = []
    try:
        import triton
        runtime = triton.knobs.runtime
        prev: Callable[..., Any] | None = runtime.jit_cache_hook
    except (ImportError, AttributeError):
        yield seen
        return

    def hook(**kw: Any) -> bool:  # Triton passes key, repr, fn, compile, ...: taken as they come (versions differ)
        try:
            seen.append(_describe(kw["repr"], kw.get("fn"), kw.get("compile") or {}))
        except Exception as err:  # a diagnostic must never stop a launch
            seen.append(f"{kw.get('repr', '?')} (not described: {err!r})")
        # True would tell Triton to skip the compile: only a chained hook may say so
        return bool(prev(**kw)) if prev else False

    runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        runtime.jit_cache_hook = prev


def missed_specializations(uses: list[str], compiled: list[str]) -> list[str]:
    """The ``first_uses`` descriptions of kernels named in ``compiled`` (``kernel_names`` of the cache directories
    a run added): what a run compiled, with its arguments' specializations and constexprs. Names are all a cache
    directory tells, so a specialization of the same kernel first loaded from the on-disk cache in that block is
    listed too (few: the serving bench's 3-token run before each timed run has launched the rest)."""
    names = set(compiled)
    return [u for u in uses if u.split("[", 1)[0].rsplit(".", 1)[-1] in names]
