"""A do-nothing Triton kernel for tests/test_bench_fake_experts.py (Triton JIT functions must live in a file)."""

import triton
import triton.language as tl


@triton.jit
def probe_kernel(x_ptr, y_ptr, n, m, pair, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    pass
