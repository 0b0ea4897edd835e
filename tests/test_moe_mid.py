"""The ``mid`` AP MoE path at the prefill tile sizes ``bench/prefill_tune.py`` times (BLOCK_M 64, 128), against
the reference (``check`` of tests/_moe_cases.py, bf16 / fp16 tolerances), in Triton's
interpreter on the CPU and natively on the GPU."""

from __future__ import annotations

import pytest
import torch
from _moe_cases import check


@pytest.mark.parametrize("block_m", [64, 128])
def test_mid_path_at_prefill_tile_sizes(block_m: int) -> None:
    """``mid`` with the BLOCK_M that ``bench/prefill_tune.py`` times (64, 128): ragged H and I, a random mix of q
    2..8, experts with more and fewer tokens than one tile, one expert with none, bf16 and fp16."""
    cfg = {"path": "mid", "BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": 64}
    g = torch.Generator().manual_seed(block_m)
    for dtype in (torch.bfloat16, torch.float16):
        t, k, e = 150, 2, 5
        ids = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(t)])  # expert e - 1: no tokens
        ids[:100, 0] = 0  # expert 0: more than one tile of 64
        ids[:100, 1] = torch.where(ids[:100, 1] == 0, 1, ids[:100, 1])
        bits = torch.randint(2, 9, (2 * e,), generator=g).tolist()
        check(t, k, e, hidden=104, inter=40, bits=bits, dtype=dtype, seed=block_m + 7, ids=ids, config=cfg)
