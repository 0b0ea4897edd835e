"""SASS instructions per weight of the gemv1 decode kernels, compiled for sm_90 on a machine without a GPU.

What it does: compiles ``kernels.ap_moe_gemv1``'s gate_up or down kernel for ``GPUTarget("cuda", 90, 32)``
with the ptxas that Triton's package carries, dumps the SASS with the bundled cuobjdump and prints, for every
loop (backward branch), its instruction count by opcode and per weight (loop body / weights a thread handles
per K step). Also counts ``convert_layout`` in the TTGIR (one inside the loop means a shared-memory round trip
per tile). Runs nothing on a device. Use the GPU machine's Triton (3.6 in 2026-11): layouts and so the counts
depend on it, e.g. ``pip install triton==3.6.0 --target /tmp/t36`` then ``PYTHONPATH=/tmp/t36:$PWD``.

Usage: python bench/sass_count.py [--kernel gate_up|down] [--t-pad 1] [--block-n 8] [--bkw 32] [--warps 4]
[--raw-shfl] [--slots S]
The loops are the kernel's code paths in source order: q <= 4, q = 5, q >= 6 (then any divergent fallback).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

sys.path.insert(0, ".")


def compile_sm90(kernel: Any, args: dict[str, Any], num_warps: int) -> tuple[str, str, str]:
    """(SASS text, TTGIR text, "N registers, M spilled") of ``kernel`` for sm_90; ``args``: pointer/int types as
    strings, constexprs as values."""
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
        sass = subprocess.run([f"{bin_dir}/cuobjdump", "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
        res = subprocess.run([f"{bin_dir}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", res)
    return sass, ck.asm["ttgir"], f"{m.group(1)} registers, {m.group(2)} B local (spills)" if m else res.strip()


def loops(sass: str) -> list[collections.Counter]:
    """Opcode counts of every loop body (from a backward branch's target to the branch) in ``sass``."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for line in sass.splitlines()
           if (m := re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line))]
    out = []
    for a, text in ins:
        m = re.search(r"BRA\s+`?\(?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < a:
            body = [x for b, x in ins if int(m.group(1), 16) <= b <= a]
            out.append(collections.Counter((x.split()[1] if x.startswith("@") else x.split()[0]).split(".")[0]
                                           for x in body))
    return out


def main() -> None:
    from kernels import ap_moe_gemv1 as g

    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=("gate_up", "down"), default="gate_up")
    ap.add_argument("--t-pad", type=int, default=1, help="tokens padded to a power of 2 (1..8)")
    ap.add_argument("--block-n", type=int, default=8, help="gate/up row pairs (gate_up) or rows (down)")
    ap.add_argument("--bkw", type=int, default=32, help="plane words per K step (BLOCK_K / 32)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--raw-shfl", action="store_true", help="inline shfl.sync shuffles (RAW_SHFL; 16/32 words)")
    ap.add_argument("--slots", type=int, default=0, help="S > 0: the sorted-slots mode with S pairs per program "
                    "(T_PAD = S; --t-pad is ignored)")
    a = ap.parse_args()
    t_pad, ids = (a.slots, "*i64") if a.slots else (a.t_pad, "*i32")  # sorted ids keep topk_ids dtype (int64)
    common = {"ids_ptr": ids, "order_ptr": "*i32", "seg_ptr": "*i32", "pool_ptr": "*i32", "plane_off_ptr": "*i64",
              "lut_ptr": "*bf16", "lut_off_ptr": "*i64", "bits_ptr": "*i32", "T": "i32", "H": "i32", "I": "i32",
              "TOPK": 4, "T_PAD": t_pad, "K_PAD": 4, "SORTED": int(a.slots > 0), "BLOCK_N": a.block_n, "BKW": a.bkw,
              "LE": 32 if a.bkw >= 32 else 16, "RAW": int(a.raw_shfl and a.bkw in (16, 32))}
    if a.kernel == "gate_up":  # Qwen1.5-MoE: H 2048 (64 words), I 1408 (44 words, padded to 64)
        args = {"x_ptr": "*bf16", "inter_ptr": "*bf16", **common, "KWX": 64, "KWO": 64, "PAD_O": 256}
        kernel, rows = g._gemv1_gate_up_kernel, 2 * a.block_n
    else:
        args = {"inter_ptr": "*bf16", "out_ptr": "*fp32", "w_ptr": "*fp32", **common, "KWX": 64}
        kernel, rows = g._gemv1_down_kernel, a.block_n
    sass, ttgir, regs = compile_sm90(kernel, args, a.warps)
    per_thread = rows * a.bkw * 32 / (32 * a.warps)
    mode = " sorted" if a.slots else ""
    print(f"{a.kernel}: T_PAD {t_pad}{mode}, {rows} rows x {a.bkw} words, {a.warps} warps; {regs}; "
          f"convert_layout in TTGIR: {ttgir.count('convert_layout')}")
    for i, ops in enumerate(loops(sass)):
        n = sum(ops.values())
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(8))
        print(f"loop {i}: {n} instructions, {n / per_thread:.2f} per weight ({top})")


if __name__ == "__main__":
    main()
