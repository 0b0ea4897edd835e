"""Instructions per loop body of a Triton kernel compiled for sm_90 on a machine without a GPU.

What it does: compiles one ``@triton.jit`` kernel for ``GPUTarget("cuda", 90, 32)`` with the ptxas
that Triton's package carries, dumps its SASS with the bundled cuobjdump and prints, for every loop
(backward branch), the instruction count by opcode. Divide by the weights a thread handles per
iteration to get instructions per weight (how issue #4's kernels were compared without device time).
It does not run anything; the local Triton may differ from the device's (3.9 here vs 3.6 there).

Usage: ``from tools.sass_loops import loops; loops(kernel, {"x_ptr": "*bf16", ..., "BLOCK": 16}, 4)``
(constexprs are the non-string values).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from typing import Any


def loops(kernel: Any, args: dict[str, Any], num_warps: int = 4) -> list[tuple[int, collections.Counter]]:
    """[(instructions, Counter by opcode)] per loop body of ``kernel``'s sm_90 SASS (also printed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {k: (v if isinstance(v, str) else "constexpr") for k, v in args.items()}
    consts = {k: v for k, v in args.items() if not isinstance(v, str)}
    ck = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        sass = subprocess.run([f"{bin_dir}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    ins = [(int(m.group(1), 16), m.group(2).strip()) for line in sass.splitlines()
           if (m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line))]
    out = []
    for a, text in ins:
        m = re.search(r"BRA\s+`?\(?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a:
            body = [x for b, x in ins if int(m.group(1), 16) <= b <= a]
            ops = collections.Counter((x.split()[1] if x.startswith("@") else x.split()[0]).split(".")[0] for x in body)
            out.append((len(body), ops))
            print(f"loop of {len(body)} instructions:", ", ".join(f"{k} {v}" for k, v in ops.most_common(10)))
    return out
