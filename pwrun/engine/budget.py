"""The device memory budget: parsing ``--gpu-memory`` and splitting it into fixed parts and the page pool.

What it does: ``parse_size`` reads sizes such as ``10GiB``, ``512MiB``, ``1.5GB`` (bytes);
``fixed_bytes`` adds what never pages: the non-expert weights (in the model's dtype: bf16 on CUDA,
fp32 on the CPU by default; ``dtype_label`` names it in messages) and an activation workspace
bound for one step (``workspace_bytes``, from the step's token budget, context and vocabulary).
The pool gets the rest (SPEC section 5: KV blocks and expert bit-planes share it). Control plane
arithmetic only.
"""

from __future__ import annotations

import os
import re

from pwformat.errors import PagedWeightError
from pwrun.model.spec import ModelSpec

_DTYPE_LABELS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype_label(dtype: object) -> str:
    """Short name of a weight dtype for messages: ``torch.float32`` or ``"float32"`` -> ``"fp32"``."""
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_LABELS.get(name, name)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes in ``text`` (e.g. ``10GiB``, ``750MB``, ``123456``); raises ``PagedWeightError`` if unreadable."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise PagedWeightError(f"cannot read the size {text!r}: write e.g. 10GiB, 512MiB or 1.5GB")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value <= 0:
        raise PagedWeightError(f"the size {text!r} must be positive: write e.g. 10GiB, 512MiB or 1.5GB")
    if m.group(2).lower() in ("", "b") and not value.is_integer():
        raise PagedWeightError(f"the size {text!r} is a fraction of a byte: give a unit, e.g. {m.group(1)}GiB")
    if value > 2**50:
        raise PagedWeightError(f"the size {text!r} is larger than any device (over 1 PiB): give the memory to use, "
                               "e.g. 40GiB")
    return int(value)


def format_size(n: float) -> str:
    """Human-readable bytes (KiB/MiB/GiB/TiB, 2 decimals; bytes below 1 KiB)."""
    if abs(n) >= 2**40:
        return f"{n / 2**40:.2f} TiB"
    if abs(n) >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if abs(n) >= 2**20:
        return f"{n / 2**20:.2f} MiB"
    return f"{n / 2**10:.2f} KiB" if abs(n) >= 2**10 else f"{int(n)} B"


def format_budget(gpu_memory: int, dtype: str, fixed: int, workspace: int, pool: int) -> str:
    """The split of a device budget for messages (bytes in): ``budget B = non-expert weights (dtype) F + workspace W
    + page pool P``, as a run's summary and ``pwrun serve``'s start-up line print it."""
    return (f"budget {format_size(gpu_memory)} = non-expert weights ({dtype_label(dtype)}) {format_size(fixed)} + "
            f"workspace {format_size(workspace)} + page pool {format_size(pool)}")


def cublas_workspace_bytes() -> int:
    """Bytes of one cuBLAS workspace as ``CUBLAS_WORKSPACE_CONFIG`` (``:KiB:count[:KiB:count]``) sets it."""
    cfg = os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    nums = [int(x) for x in re.findall(r"\d+", cfg)]
    return sum(nums[i] * nums[i + 1] for i in range(0, len(nums) - 1, 2)) * 1024


def workspace_bytes(spec: ModelSpec, max_step_tokens: int, max_batch: int, max_context: int, elt: int,
                    cuda: bool = False, ap_experts: bool = True) -> int:
    """Upper bound of one step's activations in bytes (reference attention scores, MoE buffers, logits),
    plus on CUDA the cuBLAS workspaces of the two streams that run GEMMs (compute, graph capture) and, for AP
    experts (``ap_experts``; 16-bit experts are read in place), the prefill path's dequantized experts.

    ``elt``: bytes per activation element. Generous on purpose: it is measured against the real peak
    on the GPU by the serving summary.
    """
    h = spec.hidden_size
    heads = max(ls.attention.num_heads for ls in spec.layers)
    qdim = max(ls.attention.num_heads * ls.attention.head_dim for ls in spec.layers)  # the widest layer's q
    moes = [ls.moe for ls in spec.layers if ls.moe is not None]
    k = max((m.top_k for m in moes), default=1)
    inter = max([max(m.expert_intermediate, m.shared_intermediate) for m in moes]
                + [ls.dense_intermediate for ls in spec.layers if ls.dense_intermediate], default=h)
    t = max_step_tokens
    attention = t * max_context * heads * 4 * 2 + t * max_context
    moe = t * k * (2 * inter * elt + h * 4) * 2 + t * 2 * inter * 4
    hidden = t * (8 * h + 3 * qdim) * 4
    logits = max_batch * spec.vocab_size * 8
    # CUDA prefill path of the fused MoE: every used expert of a layer dequantized to 16-bit at once; plus, always
    # reserved (whatever the configs pick), one shared expert dequantized inside the decode CUDA graphs' own memory
    # pool, for buckets that take the prefill path at decode sizes (Qwen1.5-MoE's shared expert at 9..16 tokens,
    # pwkernels/configs/ap_moe.json)
    dequant = max((m.num_experts * 3 * h * m.expert_intermediate + 3 * h * m.shared_intermediate for m in moes),
                  default=0) * elt + max((3 * h * m.shared_intermediate for m in moes), default=0) * elt
    return attention + moe + hidden + logits + (2 * cublas_workspace_bytes() + dequant * ap_experts if cuda else 0)
