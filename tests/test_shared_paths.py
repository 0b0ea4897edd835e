"""bench/shared_paths: every candidate path for the shared expert (one expert, every token) computes the reference's
result in Triton's interpreter (``check``: ragged H and I, a mix of q), the sum row picks the least total and
compares it with the committed config (candidate 0), and its winner lands in the right bucket of a configs JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_ap_moe_kernel import check  # sibling test module (pytest puts tests/ on sys.path)

from bench.gemv_compare import write_configs
from bench.shared_paths import DEQUANT, FAMILY, FUSED, candidates, sum_row
from kernels.ap_moe import pick_config

COMMITTED = {"path": "gemv1", "gate_up": {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4},
             "down": {"BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 4, "SPLIT_K": 4}}


def test_candidates_start_with_the_committed_config_and_do_not_repeat() -> None:
    cands = candidates(COMMITTED)
    assert cands[0] == COMMITTED
    assert len({json.dumps(c, sort_keys=True) for c in cands}) == len(cands)
    assert {c["path"] for c in cands} == {"gemv1", "dequant", "fused"}
    assert candidates(DEQUANT[0])[0] == DEQUANT[0] and len(candidates(DEQUANT[0])) == len(cands) - 1


@pytest.mark.parametrize("t", [8, 16])
@pytest.mark.parametrize("i", range(len(candidates(COMMITTED))))
def test_every_candidate_matches_the_reference(t: int, i: int) -> None:
    cfg = candidates(COMMITTED)[i]
    if cfg["path"] == "fused" and cfg["BLOCK_N"] > 16 and t == 8:
        pytest.skip("fused tiles differ only in BLOCK_N / BLOCK_K: the 16-token case covers them")
    ids = torch.zeros(t, 1, dtype=torch.int64)  # one expert, every token (the shared expert)
    check(t, 1, 1, hidden=104, inter=72, bits=[4 + (i % 3), 3 + (t % 5)], dtype=torch.bfloat16, seed=t + i,
          ids=ids, config=cfg)


def test_sum_row_compares_the_least_total_with_the_committed_config() -> None:
    cands = [COMMITTED, DEQUANT[0], FUSED[0]]
    row = sum_row(16, cands, [[100.0, 120.0], [40.0, 45.0], [float("inf"), 10.0]])
    assert row["new_cfg"] == DEQUANT[0] and row["base_us"] == 220.0 and row["new_us"] == 85.0
    assert row["speedup"] == round(220 / 85, 2) and row["q"] == "sum" and row["shape"] == FAMILY
    same = sum_row(16, cands, [[10.0], [40.0], [50.0]])  # the committed config wins: speed-up 1, nothing to write
    assert same["new_cfg"] == COMMITTED and same["speedup"] == 1.0
    nan = sum_row(16, cands, [[float("nan")], [40.0], [50.0]])  # a NaN time never wins
    assert nan["new_cfg"] == DEQUANT[0]
    none = sum_row(16, cands, [[float("inf")]] * 3)  # nothing ran: the committed config stays, speed-up 1
    assert none["new_cfg"] == COMMITTED and none["speedup"] == 1.0


def test_winner_takes_its_bucket_only(tmp_path: Path) -> None:
    hidden, inter = 2048, 5632
    path = tmp_path / "ap_moe.json"
    old = {"default": [{"min_tokens": 1, "config": {"path": "gemv"}}],
           "by_shape": {f"{hidden}x{inter}": [{"min_tokens": 1, "config": COMMITTED},
                                              {"min_tokens": 9, "config": {"path": "gemv1", "SLOTS": 4}},
                                              {"min_tokens": 17, "config": FUSED[1]},
                                              {"min_tokens": 64, "config": DEQUANT[1]}]}}
    path.write_text(json.dumps(old))
    cands = [{"path": "gemv1", "SLOTS": 4}, DEQUANT[0]]
    write_configs(str(path), [sum_row(16, cands, [[100.0], [40.0]]), sum_row(32, [FUSED[1], DEQUANT[0]],
                                                                              [[10.0], [40.0]])])
    new = json.loads(path.read_text())
    picks = {t: pick_config(t, hidden, inter, new) for t in (1, 8, 9, 16, 17, 32, 33, 63, 64)}
    assert picks[1] == picks[8] == COMMITTED
    assert picks[9] == picks[16] == DEQUANT[0]  # won at 16 tokens: 9..16
    assert picks[17] == picks[32] == picks[33] == picks[63] == FUSED[1]  # lost at 32: unchanged
    assert picks[64] == DEQUANT[1]
