"""Shared cases of the AP MoE kernel tests: random experts laid out with gaps in shuffled order, a compare against
``pwkernels.moe.ref.ap_moe_ref`` at bf16 / fp16 tolerances, and one small config per path (few programs, so
Triton's interpreter stays fast)."""

from __future__ import annotations

import torch

from pwkernels.moe.dispatch import ap_moe
from pwkernels.moe.experts import APExperts, build_experts
from pwkernels.moe.ref import ap_moe_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF, FP = torch.bfloat16, torch.float16


def make(num_experts: int, hidden: int, inter: int, bits: list[int], dtype: torch.dtype, seed: int) -> APExperts:
    """Random experts (8-bit parent codes, LUTs at every q) at the committed ``bits``, planes shuffled with gaps."""
    g = torch.Generator().manual_seed(seed)
    codes, luts = [], []
    for i in range(2 * num_experts):
        n, k = (2 * inter, hidden) if i % 2 == 0 else (hidden, inter)
        codes.append(torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g))
        luts.append({b: (torch.randn(n, 2**b, generator=g) * k**-0.5) for b in range(1, 9)})
    return build_experts(codes, luts, bits, hidden, inter, dtype, DEV, shuffle_seed=seed)


PATHS = {
    "decode": {"path": "decode", "gate_up": {"BLOCK_N": 32, "BLOCK_K": 64},
               "down": {"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 2}},
    "decode_sorted": {"path": "decode", "gate_up": {"BLOCK_N": 16, "BLOCK_K": 128},
                      "down": {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1}, "SLOTS": 2},
    "mid": {"path": "mid", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64},
    "mid_words": {"path": "mid", "BLOCK_M": 16, "BLOCK_N": 8, "BLOCK_K": 512, "WORDS": 1, "BLOCK_N_DOWN": 16},
    "mid_words_split": {"path": "mid", "BLOCK_M": 16, "BLOCK_N": 8, "BLOCK_K": 512, "WORDS": 1, "SPLIT_Q": 1},
    "prefill": {"path": "prefill", "BLOCK_N": 16, "BLOCK_K": 64},
}
DECODE = {"path": "decode", "gate_up": {"BLOCK_N": 16, "BLOCK_K": 64},
          "down": {"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 2}}



def check(t: int, k: int, e: int, hidden: int, inter: int, bits: list[int], dtype: torch.dtype, seed: int,
          ids: torch.Tensor | None = None, config: dict | None = None, activation: str = "silu") -> None:
    ex = make(e, hidden, inter, bits, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(t, hidden, generator=g).to(dtype).to(DEV)
    if ids is None:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g).to(DEV)
    ids = ids.to(DEV)
    got = ap_moe(x, ids, w, ex, config=config, activation=activation).float()
    ref = ap_moe_ref(x, ids, w, ex, activation).float()
    assert torch.isfinite(got).all()
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item() + 1e-6
    # bf16 / fp16 rounding of the output and of the stored intermediate: a few ulps of the output scale
    tol = (2**-7 if dtype == torch.bfloat16 else 2**-10) * 4
    assert err <= tol * scale, f"max err {err:.3e} vs scale {scale:.3e}"

