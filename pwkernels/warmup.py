"""Compile the decode-step kernels before serving, in parallel worker processes, so serving never stalls on
a first-use compile.

Triton compiles a kernel specialization on its first launch, in the launching process, one at a time (10-20 s
each for sm_90). A decode step needs, per expert shape, config and padded token count, a gate_up and a down MoE
kernel (``kernels_at``), and per 16-bit linear one GEMV per padded token count (``gemv_key``). Here worker
processes run each needed call once on random weights of that shape, so the kernels land in Triton's on-disk
cache (``TRITON_CACHE_DIR``), from which the serving process loads them. Given the engine's ``max_step_tokens``
it also covers steps that mix decodes with a prompt's last chunk (any token count). CUDA only.

A job that compiled is recorded beside Triton's cache (``warm_record``), keyed by the kernels' sources and configs,
Triton's and torch's versions and the GPU: a later process skips it without starting a worker, so a start-up with a
warm cache spawns no compile processes at all. Clearing Triton's cache clears the records with it.
"""

from __future__ import annotations

import functools
import hashlib
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import triton

from pwkernels.dense_gemv import gemv, max_tokens
from pwkernels.dense_gemv import pick_config as gemv_config
from pwkernels.moe.activation import check_activation
from pwkernels.moe.decode import launches
from pwkernels.moe.dispatch import ap_moe, launch_config, shape_buckets
from pwkernels.moe.experts import random_experts
from pwkernels.moe.launch import DecodeConfig, LaunchConfig

J = TypeVar("J")

_done: set[tuple[int, int, int, str, str, int, int]] = set()  # MoE jobs warmed in this process (disk cache outlives it)
_done_gemv: set[tuple[int, int, bool, str, int]] = set()  # GEMV jobs warmed in this process


@dataclass(frozen=True)
class MoEShape:
    """One layer's expert shapes: ``hidden`` H, ``inter`` I of a routed expert, ``topk`` experts per token,
    ``shared_inter`` the shared expert's intermediate size (0: none), ``dtype`` of activations and LUTs (a torch
    dtype name), ``activation`` of the experts' gate (``silu`` or ``gelu_tanh``: each compiles its own kernels).
    Raises ``ValueError`` for a size below 1 (``shared_inter`` below 0) or an unknown activation."""

    hidden: int
    inter: int
    topk: int
    shared_inter: int = 0
    dtype: str = "bfloat16"
    activation: str = "silu"
    num_experts: int = 0

    def __post_init__(self) -> None:
        if min(self.hidden, self.inter, self.topk) < 1 or min(self.shared_inter, self.num_experts) < 0:
            raise ValueError(f"expert shapes must be positive (shared_inter, num_experts >= 0), got {self}")
        check_activation(self.activation)


def triton_int_class(v: int) -> int:
    """How Triton (3.x) specializes an int kernel argument of value ``v``: 1 for v == 1 (made a constant), 16 for a
    multiple of 16 (a divisibility hint), else 0. Each class is its own compiled kernel."""
    return 1 if v == 1 else 16 if v % 16 == 0 else 0


def kernels_at(num_tokens: int, cfg: LaunchConfig, topk: int = 1) -> set[tuple[Any, int, int]]:
    """The kernel specializations a MoE call of ``num_tokens`` tokens (top-``topk`` routing) with config ``cfg``
    launches, as (config, constexpr token count, int class) keys: the decode path's token rules are its own
    (``pwkernels.moe.decode.launches``; the other paths take no token constexpr, 0), the int class
    (``triton_int_class``) that of the runtime count the kernels receive (T for the decode path, T * topk pairs
    for the others and for the decode path's pair sort with SLOTS)."""
    if isinstance(cfg, DecodeConfig):
        keys: set[tuple[Any, int, int]] = {(cfg, t_pad, triton_int_class(t)) for t_pad, t in launches(num_tokens, cfg)}
        if cfg.SLOTS:  # the pair sort (``pwkernels.moe.pair_sort``) takes the T * topk pairs
            keys.add(("pair_sort", 0, triton_int_class(num_tokens * topk)))
        return keys
    return {(cfg, 0, triton_int_class(num_tokens * topk))}


def decode_token_counts(max_batch: int, hidden: int | None = None, inter: int | None = None,
                        configs: dict[str, Any] | None = None, topk: int = 1) -> list[int]:
    """The fewest token counts in 1..``max_batch`` whose decode MoE calls launch every kernel specialization that
    any count in that range launches (``kernels_at``), for experts of hidden size ``hidden`` and intermediate size
    ``inter`` routing ``topk`` experts per token under ``configs`` (default: ``pwkernels/configs/ap_moe.json``; its
    buckets decide the path per count): the smallest count that needs a specialization stands for it."""
    return covering_counts(max_batch, lambda t: kernels_at(t, launch_config(t, hidden, inter, configs), topk))


def step_token_limit(max_batch: int, max_step_tokens: int | None, hidden: int | None = None,
                     inter: int | None = None, configs: dict[str, Any] | None = None) -> int:
    """The largest token count whose MoE kernels the warm-up compiles for experts ``hidden`` x ``inter``:
    ``max_batch`` if ``max_step_tokens`` is None (decode steps only), else every count a step of at most
    ``max_step_tokens`` tokens can hand the MoE (chunked prefill mixes a prompt's last piece with the running
    decodes: any count), scanned up to the last
    bucket's first count + 15 (that bucket's path at both Triton int classes of its pair count; more tokens launch
    nothing new) and never below ``max_batch``."""
    if max_step_tokens is None:
        return max_batch
    last = max((b["min_tokens"] for b in shape_buckets(hidden, inter, configs)), default=1)
    return max(max_batch, min(max_step_tokens, last + 15))


def covering_counts(max_t: int, keys_of: Callable[[int], set[Any]]) -> list[int]:
    """The fewest token counts in 1..``max_t`` whose kernel keys (``keys_of(t)``: the specializations a call of t
    tokens launches) cover every count's: each count that brings a key not seen below it, in order."""
    seen: set[Any] = set()
    out = []
    for t in range(1, max_t + 1):
        new = keys_of(t) - seen
        if new:
            out.append(t)
            seen |= new
    return out


def _warm(job: tuple[int, int, int, str, str, int, int]) -> str:
    """Worker: one decode MoE call of ``t`` tokens on ``num`` random experts (H, I, top-k; the shared expert is top-1
    of one expert) with their gate activation, as ``ap_moe_block`` makes it; "" or the error."""
    hidden, inter, topk, dt, act, num, t = job
    start = time.perf_counter()
    try:
        dtype = getattr(torch, dt)
        experts = random_experts(hidden, inter, num, dtype=dtype)
        x = torch.randn(t, hidden, device="cuda", dtype=dtype)
        ids = torch.arange(t * topk, device="cuda").view(t, topk) % topk
        ap_moe(x, ids, torch.rand(t, topk, device="cuda"), experts, check=False, activation=act)
        torch.cuda.synchronize()
        print(f"  decode MoE kernels for experts {hidden}x{inter} top-{topk} {dt} {act}, {t} tokens: "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        return ""
    except Exception as err:
        return f"experts {hidden}x{inter} top-{topk} {dt} {act}, {t} tokens: {type(err).__name__}: {str(err)[:200]}"


def default_workers() -> int:
    """Worker processes: the CPU cores, at most 8 (each holds a CUDA context of a few hundred MiB)."""
    return max(1, min(8, os.cpu_count() or 1))


def run_in_workers(fn: Callable[[J], str], jobs: Sequence[J], workers: int) -> list[str]:
    """``fn(job)`` for every job in ``workers`` spawned processes (``fn`` importable at module level; it returns "" or
    an error message). Returns the messages of the jobs that failed, in order; a worker crash (e.g. in Triton's
    compiler) ends the pool with one message instead of raising."""
    errors: list[str] = []
    try:
        with ProcessPoolExecutor(max(1, min(workers, len(jobs))), mp_context=mp.get_context("spawn")) as pool:
            errors += [msg for msg in pool.map(fn, jobs) if msg]
    except BrokenProcessPool as err:
        errors.append(f"worker pool stopped: {err}")
    return errors


def check_workers(workers: int | None) -> None:
    """Raises ``ValueError`` unless ``workers`` is None or an integer >= 0 (not a bool)."""
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 0):
        raise ValueError(f"workers must be an integer >= 0 (or None: one per core, up to 8), got {workers!r}")


def triton_cache_dir() -> Path:
    """Triton's on-disk kernel cache: ``triton.knobs.cache.dir`` where this Triton has it, else
    ``$TRITON_CACHE_DIR``, else ``$TRITON_HOME/.triton/cache`` (``$TRITON_HOME`` defaulting to the home folder)."""
    knobs = getattr(triton, "knobs", None)
    known = getattr(getattr(knobs, "cache", None), "dir", None)
    if known:
        return Path(known)
    env = os.environ.get("TRITON_CACHE_DIR")
    return Path(env) if env else Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton" / "cache"


@functools.cache
def kernels_fingerprint() -> str:
    """What decides the kernels a warm-up job compiles, hashed: every source and config file of ``pwkernels``,
    Triton's and torch's versions and Triton's compile settings (``TRITON_*`` variables other than the cache's
    location)."""
    h = hashlib.sha256()
    root = Path(__file__).parent
    for f in sorted(root.rglob("*")):
        if f.suffix in (".py", ".json") and "__pycache__" not in f.parts:
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(f"triton {triton.__version__} torch {torch.__version__}".encode())
    # Triton's compile settings (fp fusion, ptxas, ...) change its kernels; where the cache lives does not
    h.update(repr(sorted((k, v) for k, v in os.environ.items() if k.startswith("TRITON_")
                         and k not in ("TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_INTERPRET"))).encode())
    return h.hexdigest()[:20]


def warm_record(fn: Callable[..., str], job: Any, device: str, root: Path | None = None) -> Path:
    """The file that says warm-up job ``job`` of worker ``fn`` (by module and qualified name) compiled on GPU
    ``device`` (its name and compute capability) under this ``kernels_fingerprint``: in ``root`` (default
    ``triton_cache_dir()``), beside the kernels it stands for."""
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
    key = hashlib.sha256(repr((name, job, device)).encode()).hexdigest()[:32]
    return (root or triton_cache_dir()) / "pagedweight-warm" / kernels_fingerprint() / key


def gpu_name() -> str:
    """The current CUDA device's name and compute capability (what Triton compiles for)."""
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} sm_{major}{minor}"


def compile_in_workers(fn: Callable[[J], str], jobs: Sequence[J], done: set[J], workers: int | None,
                       what: str) -> list[str]:
    """Run ``fn`` over the ``jobs`` not in ``done`` and without a ``warm_record`` in ``workers`` processes (None:
    ``default_workers()``; 0: nothing), on CUDA only, saying on stderr that ``what`` compiles; adds the jobs to
    ``done`` and writes their records if none failed (a failed one is tried again by the next call, its kernels
    compile on first use meanwhile). Returns the failures' messages."""
    n = default_workers() if workers is None else workers
    if n <= 0 or not torch.cuda.is_available():
        return []
    device = gpu_name()
    todo = [j for j in jobs if j not in done and not _recorded(warm_record(fn, j, device))]
    if not todo:
        return []
    print(f"compiling {what} ({len(todo)} jobs on {min(n, len(todo))} processes; a warm Triton cache makes this "
          f"quick)", file=sys.stderr, flush=True)
    errors = run_in_workers(fn, todo, n)
    if not errors:
        done.update(todo)
        mark_warm(fn, todo, device)
    return errors


def _recorded(path: Path) -> bool:
    """``path`` exists; an unreadable records folder counts as no record (the job is compiled again)."""
    try:
        return path.is_file()
    except OSError:
        return False


def mark_warm(fn: Callable[..., str], jobs: Sequence[Any], device: str, root: Path | None = None) -> None:
    """Write the ``warm_record`` of each job; a cache folder that cannot be written only costs the next start-up
    its workers."""
    for j in jobs:
        path = warm_record(fn, j, device, root)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(repr(j)[:200] + "\n")
        except OSError:
            return


def precompile_decode(shapes: list[MoEShape], max_batch: int, workers: int | None = None,
                      max_step_tokens: int | None = None) -> list[str]:
    """Compile the MoE kernels of every shape in ``shapes`` for 1..``step_token_limit(max_batch, max_step_tokens,
    ...)`` tokens (see ``decode_token_counts``; None: decode steps of up to ``max_batch`` tokens only) into Triton's
    on-disk cache, ``workers`` processes at a time (default ``default_workers()``; 0: do nothing). Needs CUDA. Jobs
    already done in this process are skipped, and shapes whose dtype is not bf16 / fp16 (the AP MoE kernels take
    only those). Returns one message per job that failed (its kernels then compile on first use). Raises
    ``ValueError`` for a negative or non-integer ``workers``."""
    check_workers(workers)
    shapes = [s for s in shapes if s.dtype in ("bfloat16", "float16")]
    sets = [(s.hidden, s.inter, s.topk, s.dtype, s.activation, max(s.num_experts, s.topk)) for s in shapes]
    sets += [(s.hidden, s.shared_inter, 1, s.dtype, s.activation, 1) for s in shapes if s.shared_inter]
    jobs = [(*e, t) for e in dict.fromkeys(sets)
            for t in decode_token_counts(step_token_limit(max_batch, max_step_tokens, e[0], e[1]), e[0], e[1],
                                         topk=e[2])]
    return compile_in_workers(_warm, jobs, _done, workers, "the decode MoE kernels")


@dataclass(frozen=True)
class LinearShape:
    """A 16-bit linear of the decode step: weight [``n``, ``k``], a bias or not, ``dtype`` a torch dtype name.
    Raises ``ValueError`` for a size that is not an integer >= 1."""

    n: int
    k: int
    bias: bool
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (self.n, self.k)):
            raise ValueError(f"a linear needs positive integer sizes, got {self}")


def gemv_key(t: int) -> tuple[int, int]:
    """The specialization of ``pwkernels.dense_gemv._gemv_kernel`` that ``t`` tokens launch on a given weight:
    (T_PAD = the next power of 2 >= t, Triton int class of t)."""
    return triton.next_power_of_2(t), triton_int_class(t)  # T_PAD as ``pwkernels.dense_gemv.gemv`` computes it


def linear_token_counts(shape: LinearShape, max_batch: int) -> list[int]:
    """The fewest token counts in 1..min(``max_batch``, ``max_tokens(N, K)``) whose GEMV calls launch every
    specialization (``gemv_key``) any count of that range launches: the smallest count stands for its key."""
    return covering_counts(min(max_batch, max_tokens(shape.n, shape.k)), lambda t: {gemv_key(t)})


def stand_in_rows(n: int) -> int:
    """Rows of a weight that compiles the same kernel as ``n`` rows (same ``triton_int_class``; the row count is a
    runtime argument, the tile comes from ``pwkernels.dense_gemv.pick_config(n, K)``): 1, 16 or 17, never more than
    needed."""
    return {1: 1, 16: 16}.get(triton_int_class(n), 17 if n > 17 else n)


def _warm_gemv(job: tuple[int, int, bool, str, int]) -> str:
    """Worker: one GEMV call of ``t`` tokens on a stand-in of weight [n, k]; "" or the error."""
    n, k, bias, dt, t = job
    start = time.perf_counter()
    try:
        dtype = getattr(torch, dt)
        rows = stand_in_rows(n)
        w = torch.randn(rows, k, device="cuda", dtype=dtype)
        b = torch.randn(rows, device="cuda", dtype=dtype) if bias else None
        gemv(torch.randn(t, k, device="cuda", dtype=dtype), w, b, gemv_config(n, k))
        torch.cuda.synchronize()
        print(f"  decode GEMV {n}x{k}{' + bias' if bias else ''} {dt}, {t} tokens: {time.perf_counter() - start:.1f} s",
              file=sys.stderr, flush=True)
        return ""
    except Exception as err:
        return f"GEMV {n}x{k} {dt}, {t} tokens: {type(err).__name__}: {str(err)[:200]}"


def precompile_gemv(shapes: list[LinearShape], max_batch: int, workers: int | None = None,
                    max_step_tokens: int | None = None) -> list[str]:
    """Compile the decode GEMV of every linear in ``shapes`` for 1..``max_batch`` tokens, or, given the engine's
    ``max_step_tokens``, for every count a step can hand it (a prompt's last chunk beside the running decodes: up to
    ``max(max_batch, max_step_tokens)``) (``linear_token_counts``), into Triton's on-disk cache, ``workers``
    processes at a time (default ``default_workers()``; 0: nothing). Needs CUDA; skips linears
    whose dtype is not bf16 / fp16 (``linear`` sends those to ``F.linear``) and jobs already done in this process.
    Returns one message per failed job (its kernel then compiles on first use). Raises ``ValueError`` for a
    negative or non-integer ``workers``."""
    check_workers(workers)
    limit = max_batch if max_step_tokens is None else max(max_batch, max_step_tokens)
    jobs = [(s.n, s.k, s.bias, s.dtype, t) for s in dict.fromkeys(shapes) if s.dtype in ("bfloat16", "float16")
            for t in linear_token_counts(s, limit)]
    return compile_in_workers(_warm_gemv, jobs, _done_gemv, workers, "the decode GEMVs")
