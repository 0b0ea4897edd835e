"""Compile the decode-step MoE kernels before serving, in parallel worker processes (issue 8: no stall at run time).

Not a SPEC equation: it serves SPEC section 7's kernels to the runtime of sections 5-6 without a first-use stall.

Why: Triton compiles a kernel specialization on its first launch, in the launching process, one at a time. A
decode step needs a gate_up and a down kernel per expert shape, config and padded token count (``kernels_at``),
10-20 s each for sm_90 (``bench/results/gemv_probe/compile_time_cpu.md``; before the codes of a word became a
loop at 2..8 tokens, 1.5 min at 4 tokens and ~10 min at 8, almost all in Triton's ``TritonGPUCoalesce`` pass). An engine
serving 4 requests from a cold cache produced nothing in 590 s on the H200 (ninth session, unrolled kernels);
with this warm-up (6 workers) the same kernels compiled in 175.5 s before serving started. Here one worker process
per (expert set, token count) runs the decode-step MoE call on random experts of that shape, so the kernels land
in Triton's on-disk cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``), from which the serving process then
loads them. The routed and the shared experts compile in separate workers (their kernels differ in shape constants).

What it does not do: anything on the CPU (the runtime's CPU path uses no Triton kernel). Given the engine's
``max_step_tokens`` it also compiles what steps mixing decodes with a prompt's last chunk launch (any token count:
``step_token_limit``; before the seventeenth session only 1..max_batch, and such steps compiled inside serving).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from kernels.ap_moe import APExperts, ap_moe, build_experts, pick_config, shape_buckets
from kernels.ap_moe_gemv import token_pad
from kernels.ap_moe_gemv1 import launches

J = TypeVar("J")

_done: set[tuple[int, int, int, str, int]] = set()  # warmed in this process (the on-disk cache outlives it)


@dataclass(frozen=True)
class MoEShape:
    """One layer's expert shapes: ``hidden`` H, ``inter`` I of a routed expert, ``topk`` experts per token,
    ``shared_inter`` the shared expert's intermediate size (0: none), ``dtype`` of activations and LUTs (a torch
    dtype name). Raises ``ValueError`` for a size below 1 (``shared_inter`` below 0)."""

    hidden: int
    inter: int
    topk: int
    shared_inter: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if min(self.hidden, self.inter, self.topk) < 1 or self.shared_inter < 0:
            raise ValueError(f"expert shapes must be positive (shared_inter >= 0), got {self}")


def triton_int_class(v: int) -> int:
    """How Triton (3.x) specializes an int kernel argument of value ``v``: 1 for v == 1 (made a constant), 16 for a
    multiple of 16 (a divisibility hint), else 0. Each class is its own compiled kernel."""
    return 1 if v == 1 else 16 if v % 16 == 0 else 0


def kernels_at(num_tokens: int, cfg: dict[str, Any], topk: int = 1) -> set[tuple[str, int, int]]:
    """The kernel specializations a decode MoE call of ``num_tokens`` tokens (top-``topk`` routing) with config
    ``cfg`` (one bucket of ``kernels/configs/ap_moe.json``) launches, as (config, constexpr token count, int class)
    keys: the token rules are the kernels' own (``kernels.ap_moe_gemv1.launches``, ``kernels.ap_moe_gemv.token_pad``;
    the other paths take no token constexpr, 0), the int class (``triton_int_class``) that of the runtime count the
    kernels receive (T for gemv1 and gemv, T * topk pairs for the others and for gemv1's pair sort with SLOTS).
    Raises ``ValueError`` for a bad SLOTS."""
    key = json.dumps(cfg, sort_keys=True)
    if cfg.get("path") == "gemv1":
        keys = {(key, t_pad, triton_int_class(t)) for t_pad, t in launches(num_tokens, cfg)}
        if cfg.get("SLOTS"):  # the pair sort (``kernels.pair_sort``) takes the T * topk pairs
            keys.add(("pair_sort", 0, triton_int_class(num_tokens * topk)))
        return keys
    if cfg.get("path") == "gemv":
        return {(key, token_pad(num_tokens), triton_int_class(num_tokens))}
    return {(key, 0, triton_int_class(num_tokens * topk))}


def decode_token_counts(max_batch: int, hidden: int | None = None, inter: int | None = None,
                        configs: dict[str, Any] | None = None, topk: int = 1) -> list[int]:
    """The fewest token counts in 1..``max_batch`` whose decode MoE calls launch every kernel specialization that
    any count in that range launches (``kernels_at``), for experts of hidden size ``hidden`` and intermediate size
    ``inter`` routing ``topk`` experts per token under ``configs`` (default: ``kernels/configs/ap_moe.json``; its
    buckets decide the path per count): the smallest count that needs a specialization stands for it."""
    return covering_counts(max_batch, lambda t: kernels_at(t, pick_config(t, hidden, inter, configs), topk))


def step_token_limit(max_batch: int, max_step_tokens: int | None, hidden: int | None = None,
                     inter: int | None = None, configs: dict[str, Any] | None = None) -> int:
    """The largest token count whose MoE kernels the warm-up compiles for experts ``hidden`` x ``inter``:
    ``max_batch`` if ``max_step_tokens`` is None (decode steps only), else every count a step of at most
    ``max_step_tokens`` tokens can hand the MoE (chunked prefill mixes a prompt's last piece with the running
    decodes: any count, seventeenth session, ``bench/results/serve_mixtral_s17b_h200.md``), scanned up to the last
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


def random_experts(hidden: int, inter: int, n: int, q: int = 4, dtype: torch.dtype = torch.bfloat16,
                   device: str = "cuda") -> APExperts:
    """n experts of shape H = ``hidden``, I = ``inter`` (gate_up [2I, H], down [H, I]), every block at q bits: random
    int32 planes [8, N, ceil(K / 32)] and LUTs [N, 2^q] (x 0.01) laid out by ``build_experts``. For compiling and
    timing kernels only (the values mean nothing; the bitwidth is a run-time value of the kernels, so one compile
    serves every q)."""
    codes, luts = [], []
    for i in range(2 * n):
        rows, k = (2 * inter, hidden) if i % 2 == 0 else (hidden, inter)
        codes.append(torch.randint(-2**31, 2**31 - 1, (8, rows, -(-k // 32)), dtype=torch.int32, device=device))
        luts.append({q: torch.randn(rows, 2**q, device=device) * 0.01})
    return build_experts(codes, luts, [q] * (2 * n), hidden, inter, dtype, device)


def _warm(job: tuple[int, int, int, str, int]) -> str:
    """Worker: one decode MoE call of ``t`` tokens on random experts (H, I, top-k; the shared expert is top-1 of
    one expert), as ``ap_moe_block`` makes it; "" or the error."""
    hidden, inter, topk, dt, t = job
    start = time.perf_counter()
    try:
        dtype = getattr(torch, dt)
        experts = random_experts(hidden, inter, topk, dtype=dtype)
        x = torch.randn(t, hidden, device="cuda", dtype=dtype)
        ids = torch.arange(t * topk, device="cuda").view(t, topk) % topk
        ap_moe(x, ids, torch.rand(t, topk, device="cuda"), experts, check=False)
        torch.cuda.synchronize()
        print(f"  decode MoE kernels for experts {hidden}x{inter} top-{topk} {dt}, {t} tokens: "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        return ""
    except Exception as err:
        return f"experts {hidden}x{inter} top-{topk} {dt}, {t} tokens: {type(err).__name__}: {str(err)[:200]}"


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


def compile_in_workers(fn: Callable[[J], str], jobs: Sequence[J], done: set[J], workers: int | None,
                       what: str) -> list[str]:
    """Run ``fn`` over the ``jobs`` not in ``done`` in ``workers`` processes (None: ``default_workers()``; 0:
    nothing), on CUDA only, saying on stderr that ``what`` compiles; adds the jobs to ``done`` if none failed (a
    failed one is tried again by the next call, its kernels compile on first use meanwhile). Returns the failures'
    messages."""
    todo = [j for j in jobs if j not in done]
    n = default_workers() if workers is None else workers
    if not todo or n <= 0 or not torch.cuda.is_available():
        return []
    print(f"compiling {what} ({len(todo)} jobs on {min(n, len(todo))} processes; a warm Triton cache makes this "
          f"quick)", file=sys.stderr, flush=True)
    errors = run_in_workers(fn, todo, n)
    if not errors:
        done.update(todo)
    return errors


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
    sets = [(s.hidden, s.inter, s.topk, s.dtype) for s in shapes]
    sets += [(s.hidden, s.shared_inter, 1, s.dtype) for s in shapes if s.shared_inter]
    jobs = [(*e, t) for e in dict.fromkeys(sets)
            for t in decode_token_counts(step_token_limit(max_batch, max_step_tokens, e[0], e[1]), e[0], e[1],
                                         topk=e[2])]
    return compile_in_workers(_warm, jobs, _done, workers, "the decode MoE kernels")
