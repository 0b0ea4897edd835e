"""Compile the decode GEMV of a model's 16-bit linears before serving, in worker processes (issue 8: no stall).

Not a SPEC equation: it serves the non-expert part of SPEC section 9's decode step, as ``kernels.warmup`` does the
MoE kernels.

Why: ``kernels.dense_gemv.linear`` sends up to ``max_tokens(N, K)`` tokens of each linear to a Triton kernel that
compiles one specialization per padded token count (``T_PAD``: 1, 2, 4, 8, 16) and Triton int class of the count
(``kernels.warmup.triton_int_class``), on first use, inside serving. Since the sixteenth session Qwen's router
takes it up to 16 tokens (``bench/results/dense_gemv_router_s16_h200.md``), so a batch of 16 meets up to six of
them; that session's batch-16 serving run compiled ``_gemv_kernel`` inside its timing (``serve_s16b_h200.md``).

What it does: ``linear_token_counts`` picks the fewest token counts that launch every specialization a linear
meets in 1..max_batch; a worker process runs ``gemv`` once per (linear, count) with the linear's own tile
(``pick_config(N, K)``) on a stand-in weight of ``stand_in_rows(N)`` rows (same int class as N, so the same kernel,
without allocating e.g. a 151936-row LM head) and K columns, so the kernels land in Triton's on-disk cache.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
import triton

from kernels.dense_gemv import gemv, max_tokens, pick_config
from kernels.warmup import check_workers, compile_in_workers, covering_counts, triton_int_class

_done: set[tuple[int, int, bool, str, int]] = set()  # warmed in this process (the on-disk cache outlives it)


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
    """The specialization of ``kernels.dense_gemv._gemv_kernel`` that ``t`` tokens launch on a given weight:
    (T_PAD = the next power of 2 >= t, Triton int class of t)."""
    return triton.next_power_of_2(t), triton_int_class(t)  # T_PAD as ``kernels.dense_gemv.gemv`` computes it


def linear_token_counts(shape: LinearShape, max_batch: int) -> list[int]:
    """The fewest token counts in 1..min(``max_batch``, ``max_tokens(N, K)``) whose GEMV calls launch every
    specialization (``gemv_key``) any count of that range launches: the smallest count stands for its key."""
    return covering_counts(min(max_batch, max_tokens(shape.n, shape.k)), lambda t: {gemv_key(t)})


def stand_in_rows(n: int) -> int:
    """Rows of a weight that compiles the same kernel as ``n`` rows (same ``triton_int_class``; the row count is a
    runtime argument, the tile comes from ``pick_config(n, K)``): 1, 16 or 17, never more than needed."""
    return {1: 1, 16: 16}.get(triton_int_class(n), 17 if n > 17 else n)


def _warm(job: tuple[int, int, bool, str, int]) -> str:
    """Worker: one GEMV call of ``t`` tokens on a stand-in of weight [n, k]; "" or the error."""
    n, k, bias, dt, t = job
    start = time.perf_counter()
    try:
        dtype = getattr(torch, dt)
        rows = stand_in_rows(n)
        w = torch.randn(rows, k, device="cuda", dtype=dtype)
        b = torch.randn(rows, device="cuda", dtype=dtype) if bias else None
        gemv(torch.randn(t, k, device="cuda", dtype=dtype), w, b, pick_config(n, k))
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
    processes at a time (default ``kernels.warmup.default_workers()``; 0: nothing). Needs CUDA; skips linears
    whose dtype is not bf16 / fp16 (``linear`` sends those to ``F.linear``) and jobs already done in this process.
    Returns one message per failed job (its kernel then compiles on first use). Raises ``ValueError`` for a
    negative or non-integer ``workers``."""
    check_workers(workers)
    limit = max_batch if max_step_tokens is None else max(max_batch, max_step_tokens)
    jobs = [(s.n, s.k, s.bias, s.dtype, t) for s in dict.fromkeys(shapes) if s.dtype in ("bfloat16", "float16")
            for t in linear_token_counts(s, limit)]
    return compile_in_workers(_warm, jobs, _done, workers, "the decode GEMVs")
