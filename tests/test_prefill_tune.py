"""bench/prefill_tune.write_buckets: a won T owns its token range of the configs (256 -> 256..1023, 2048 -> 1024
and up), the config in force at the range's end resumes there, other buckets and shapes are untouched."""

from __future__ import annotations

import pytest

from bench.prefill_tune import write_buckets
from kernels.config_buckets import pick_bucket

G1, FU, DQ = {"path": "gemv1", "tag": "g"}, {"path": "fused", "BLOCK_M": 16}, {"path": "dequant"}
W256, W2048 = {"path": "fused", "BLOCK_M": 64}, {"path": "fused", "BLOCK_M": 128}
BASE = {"default": [{"min_tokens": 1, "config": G1}],
        "by_shape": {"8x4": [{"min_tokens": 1, "config": G1}, {"min_tokens": 33, "config": FU},
                             {"min_tokens": 256, "config": DQ}],
                     "2x2": [{"min_tokens": 1, "config": G1}]}}


def picks(cfgs: dict, key: str) -> dict[int, dict]:
    rows = cfgs["by_shape"][key]
    assert [r["min_tokens"] for r in rows] == sorted({r["min_tokens"] for r in rows})  # ascending, unique
    return {t: pick_bucket(rows, t, "min_tokens") for t in (1, 32, 33, 255, 256, 1023, 1024, 5000)}


@pytest.mark.parametrize(("won", "expect"), [
    ({256: W256}, {255: FU, 256: W256, 1023: W256, 1024: DQ, 5000: DQ}),
    ({2048: W2048}, {255: FU, 256: DQ, 1023: DQ, 1024: W2048, 5000: W2048}),
    ({256: W256, 2048: W2048}, {255: FU, 256: W256, 1023: W256, 1024: W2048, 5000: W2048}),
    ({2048: W2048, 256: W256}, {255: FU, 256: W256, 1023: W256, 1024: W2048, 5000: W2048}),
    ({256: DQ, 2048: DQ}, {255: FU, 256: DQ, 1024: DQ}),
])
def test_won_ranges(won: dict, expect: dict) -> None:
    out = write_buckets(BASE, "8x4", won)
    got = picks(out, "8x4")
    assert got[1] == G1 and got[32] == G1 and got[33] == FU
    assert {t: got[t] for t in expect} == expect
    assert out["by_shape"]["2x2"] == BASE["by_shape"]["2x2"] and BASE["by_shape"]["8x4"][2]["config"] == DQ
    if won == {256: DQ, 2048: DQ}:  # nothing changed: equal neighbours merge back to the original buckets
        assert out["by_shape"]["8x4"] == BASE["by_shape"]["8x4"]


def test_new_shape_starts_from_defaults_and_bad_t() -> None:
    out = write_buckets(BASE, "16x16", {2048: W2048})
    assert picks(out, "16x16")[1023] == G1 and picks(out, "16x16")[1024] == W2048
    with pytest.raises(KeyError):
        write_buckets(BASE, "8x4", {512: W256})
