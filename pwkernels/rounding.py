"""Round fp32 to a kernel's output dtype the same way on the GPU and in Triton's interpreter.

What it does: ``round_to(x, ty)`` rounds fp32 values to ``ty`` to nearest, ties to even, as
PyTorch's ``.to(bfloat16)`` / ``.to(float16)`` do. On the GPU ``x.to(tl.bfloat16)`` already does; the
CPU interpreter truncates instead, so for bf16 the rounding is done here in integer ops (the result
is then exactly representable and the final cast exact). That keeps CI's interpreter tests able to
demand bit equality with the PyTorch reference. It does not handle NaN payloads (never produced here).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, ty: tl.constexpr):
    """fp32 tensor x rounded to nearest-even in dtype ``ty`` (bf16, fp16 or fp32)."""
    if ty == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True).to(ty)
    else:
        return x.to(ty)
