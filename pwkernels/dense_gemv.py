"""Decode GEMV for 16-bit weights (Triton), with its PyTorch reference twin: y = x W^T (+ b) for 1..16 tokens.

What it computes: for x [T, K] and a 16-bit weight W [N, K] (optional bias b [N]), ``y [T, N]`` in x's
dtype, accumulated in fp32 with the bias added before the one rounding (what ``torch.nn.functional.linear``
does). It is for the non-expert linears of a decode step (fused q/k/v, o_proj, router, LM head), whose
weights are read once per step: at a few tokens cuBLAS picks split-K GEMMs whose second pass and short grids
leave bandwidth unused. Here each program reads BLOCK_N whole rows in K steps of BLOCK_K columns (contiguous,
16-byte loads) and reduces them against every token's activations; no split-K, so no second pass and no
atomics: the grid is N / BLOCK_N programs, which BLOCK_N keeps in the hundreds. ``max_tokens`` says up to
how many tokens it beats cuBLAS per weight shape (measured: the small router weights up to 4-16 tokens, the
big weights only at one).
What it does not do: more than ``MAX_TOKENS`` tokens (use ``F.linear``), transposed weights, or fp32.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pwkernels.rounding import round_to

MAX_TOKENS = 16  # the kernel keeps one accumulator row per token, up to this many
# tiles {BLOCK_N, BLOCK_K, num_warps}: "default", "small_n" (N < SMALL_N rows: routers) and "by_shape" ("NxK"),
# tuned on the H200; "max_tokens" / "max_tokens_small_n" / "max_tokens_by_shape": T up to which ``linear`` takes
# the Triton kernel (above it cuBLAS wins)
CONFIGS: dict[str, Any] = json.loads((Path(__file__).parent / "configs" / "dense_gemv.json").read_text())
SMALL_N = 256


def pick_config(n: int, k: int) -> dict[str, int]:
    """Tile for an [N, K] weight from ``configs/dense_gemv.json`` (read-only, shared)."""
    by = CONFIGS["by_shape"].get(f"{n}x{k}")
    if by is not None:
        return by
    return CONFIGS["small_n" if n < SMALL_N else "default"]


@functools.cache  # called per linear per step on the host; the configs are read-only
def max_tokens(n: int, k: int) -> int:
    """The most tokens for which ``linear`` takes the Triton kernel on an [N, K] weight (``configs/dense_gemv.json``:
    "max_tokens_by_shape" 'NxK' where measured, else routers, N < SMALL_N rows, up to ``max_tokens_small_n``
    and the rest up to ``max_tokens``)."""
    by = CONFIGS.get("max_tokens_by_shape", {}).get(f"{n}x{k}")
    return int(by if by is not None else CONFIGS["max_tokens_small_n" if n < SMALL_N else "max_tokens"])


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference twin: ``F.linear`` (x [T, K], weight [N, K], bias [N] or None -> [T, N], x's dtype)."""
    return F.linear(x, weight, bias)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [T, K] activations, rows stride_xm apart, columns contiguous
    w_ptr,  # [N, K] weight, rows stride_wn apart, columns contiguous
    b_ptr,  # [N] bias (unused when not HAS_BIAS)
    y_ptr,  # [T, N] out, contiguous, x's dtype
    T,  # tokens
    N,  # output features (weight rows)
    K,  # input features
    stride_xm,  # elements between rows of x
    stride_wn,  # elements between rows of W
    HAS_BIAS: tl.constexpr,  # add b
    T_PAD: tl.constexpr,  # next power of 2 >= T
    BLOCK_N: tl.constexpr,  # rows per program
    BLOCK_K: tl.constexpr,  # columns per K step
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    rows = tl.minimum(n, N - 1).to(tl.int64)  # clamped: loads stay in bounds, the store is masked
    tok = tl.arange(0, T_PAD)
    acc = tl.zeros((T_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        w = tl.load(w_ptr + rows[:, None] * stride_wn + k[None, :], mask=kmask[None, :], other=0.0)
        wf = w.to(tl.float32)
        for t in tl.static_range(T_PAD):
            xt = tl.load(x_ptr + tl.minimum(t, T - 1) * stride_xm + k, mask=kmask, other=0.0).to(tl.float32)
            s = tl.sum(wf * xt[None, :], axis=1)
            acc = tl.where((tok == t)[:, None], acc + s[None, :], acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows).to(tl.float32)[None, :]
    tl.store(y_ptr + tok[:, None] * N + n[None, :], round_to(acc, y_ptr.dtype.element_ty),  # nearest-even, interp. too
             mask=(tok < T)[:, None] & nmask[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: dict[str, Any] | None = None) -> torch.Tensor:
    """``gemv_ref`` by the Triton kernel: x [T, K] (T <= MAX_TOKENS), weight [N, K], bias [N] or None, all one 16-bit
    dtype on one CUDA device (or Triton's interpreter), columns contiguous. Returns a new [T, N] tensor.

    ``config``: ``{BLOCK_N, BLOCK_K, num_warps}`` (default: ``pick_config``). Raises ``ValueError`` on
    more than ``MAX_TOKENS`` tokens, mismatched shapes, dtypes or devices, non-contiguous columns, a CPU
    tensor outside Triton's interpreter, or a config whose BLOCK_N / BLOCK_K are not powers of 2.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [T, K] and weight [N, K] with the same K; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    t, k = x.shape
    n = weight.shape[0]
    if t > MAX_TOKENS:
        raise ValueError(f"gemv takes at most {MAX_TOKENS} tokens, got {t} (use F.linear)")
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one 16-bit dtype; got {x.dtype}, {weight.dtype}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}] tensor of x's dtype")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must have contiguous columns")
    if weight.device != x.device or (bias is not None and bias.device != x.device):
        raise ValueError("x, weight and bias must be on one device")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("gemv runs on a CUDA device (or in Triton's interpreter: TRITON_INTERPRET=1); "
                         "use pwkernels.dense_gemv.linear, which falls back to F.linear")
    cfg = config or pick_config(n, k)
    if not all(isinstance(cfg.get(key), int) and cfg[key] > 0 and cfg[key] & (cfg[key] - 1) == 0
               for key in ("BLOCK_N", "BLOCK_K")):
        raise ValueError(f"config needs BLOCK_N and BLOCK_K as powers of 2, got {cfg}")
    if t == 0 or n == 0 or k == 0:  # nothing to read: F.linear's result (zeros, plus the bias)
        return F.linear(x, weight, bias)
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    bn = cfg["BLOCK_N"]
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else weight, y, t, n, k, x.stride(0), weight.stride(0),
        HAS_BIAS=bias is not None, T_PAD=triton.next_power_of_2(t), BLOCK_N=bn,
        BLOCK_K=min(cfg["BLOCK_K"], triton.next_power_of_2(k)), num_warps=cfg.get("num_warps", 4))
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for the runtime's decode steps: y [T, N] = x [T, K] W [N, K]^T (+ b [N]), the Triton GEMV for up
    to ``max_tokens(N, K)`` tokens of a 16-bit x on CUDA with contiguous columns, else ``F.linear`` itself
    (whose shape and dtype errors it raises). Not a SPEC equation: the non-expert part of the decode step
    (SPEC section 9's serving numbers)."""
    if (x.is_cuda and x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and 0 < x.shape[0] <= max_tokens(*weight.shape) and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1 and weight.stride(1) == 1
            and (bias is None or (bias.shape == weight.shape[:1] and bias.dtype == x.dtype and bias.is_contiguous()
                                  and bias.device == x.device))):
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)
