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


def _arg_name(path: Any, names: list[str]) -> str:
    """An argument path of Triton's (``(3,)``, or ``(4, 1)`` inside a tuple argument) by parameter name: ``n``,
    ``pair[1]``; the path itself where it does not index ``names``."""
    if isinstance(path, tuple) and path and isinstance(path[0], int) and 0 <= path[0] < len(names):
        return names[path[0]] + "".join(f"[{i}]" for i in path[1:])
    return str(path)


def _attr(a: Any) -> str:
    """One specialization attribute (``["tt.divisibility", 16]`` -> ``div16``; others ``name=value``)."""
    k, v = (a[0], a[1]) if isinstance(a, (list, tuple)) and len(a) == 2 else (a, "")
    return f"div{v}" if k == "tt.divisibility" else f"{k}={v}"


def _describe(repr_: str, fn: Any, compile_: dict[str, Any]) -> str:
    """One specialization from what Triton's ``jit_cache_hook`` gets: ``name[options](arg: type [attributes], ...)``
    (e.g. ``x_ptr: *bf16 [div16]``: the pointer is 16-byte aligned; an int arg equal to 1 is a constexpr) and the
    constexpr values by parameter name. Triton's own ``repr`` lists no argument types (its launch key is a string),
    so they come from ``compile["signature"]`` and ``compile["configs"][0]``; without those, ``repr`` as it is."""
    sig = compile_.get("signature")
    head = repr_.split("(", 1)[0]
    names = list(sig) if isinstance(sig, dict) else list(getattr(getattr(fn, "jit_function", None), "arg_names", None)
                                                         or [])
    attrs = (compile_.get("configs") or [{}])[0] or {}
    args = []
    for i, (arg, ty) in enumerate(sig.items() if isinstance(sig, dict) else []):
        if ty == "constexpr":
            continue  # listed with its value below
        marks = [f"{_arg_name(p, names)} {_attr(x)}" if len(p) > 1 else _attr(x)
                 for p, xs in sorted(attrs.items()) if isinstance(p, tuple) and p and p[0] == i for x in xs]
        ty_s = f"({', '.join(map(str, ty))})" if isinstance(ty, tuple) else str(ty)
        args.append(f"{arg}: {ty_s}" + (f" [{', '.join(marks)}]" if marks else ""))
    consts = {_arg_name(k, names): v for k, v in (compile_.get("constants") or {}).items()}
    body = f"{head}({', '.join(args)})" if isinstance(sig, dict) else repr_
    return f"{body} constexprs={consts}"


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
        runtime = None
    if runtime is None:
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
