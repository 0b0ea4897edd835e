"""``pwkernels.moe.dispatch`` against the reference on every path (interpreter on CPU, native on GPU), and the
shipped launch configs.

Fresh random inputs each run; ragged sizes (H, I not multiples of the tiles), experts with no token, all tokens on
one expert, a token picking one expert twice, every q in 1..8, a random mix of q in one launch, several top-k,
bf16 and fp16; scratch buffers are poisoned first so unwritten rows are caught; bits / LUT tables changed in place
between calls are honoured; every bucket of ``pwkernels/configs/ap_moe.json`` parses to a path's typed config.
"""

from __future__ import annotations

import pytest
import torch
from _moe_cases import BF, DECODE, DEV, FP, PATHS, check, make

import pwkernels.moe.decode as dec
import pwkernels.moe.dispatch as am
import pwkernels.moe.mid as mid
import pwkernels.moe.mid_words as mid_words
import pwkernels.moe.prefill as pre
from pwkernels.moe.dispatch import CONFIGS, ap_moe, ap_moe_block, ap_moe_shared, launch_config, pick_config
from pwkernels.moe.experts import APExperts
from pwkernels.moe.launch import DecodeConfig, DecodeTile, MidConfig, PrefillConfig, parse_config, to_json
from pwkernels.moe.ref import ap_moe_ref

ROUTING_CASES = [(1, 1, FP), (3, 2, BF), (3, 2, FP), (8, 4, BF), (33, 2, FP), (257, 2, BF)]


@pytest.mark.parametrize(("t", "k", "dtype"), ROUTING_CASES)
def test_random_routing_ragged_shapes(t: int, k: int, dtype: torch.dtype) -> None:
    e = 6
    bits = torch.randint(2, 9, (2 * e,)).tolist()  # a random mix of q in one launch
    check(t, k, e, hidden=96 + 8, inter=40, bits=bits, dtype=dtype, seed=t * 10 + k)


@pytest.mark.parametrize("q", [1, 2, 3, 4, 5, 6, 7, 8])
def test_every_bitwidth(q: int) -> None:
    t = 1 if q % 2 else 5  # the default decode buckets: token slots (1) and sorted slots (5); mixed q elsewhere
    check(t, 2, 3, hidden=64, inter=48, bits=[q] * 6, dtype=torch.bfloat16, seed=q)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("t", "k"), [(1, 3), (6, 2)])
def test_each_path_mixed_q_ragged(path: str, t: int, k: int) -> None:
    e = 5  # with t * k < e some experts are idle
    bits = torch.randint(1, 9, (2 * e,)).tolist()
    check(t, k, e, hidden=104, inter=40, bits=bits, dtype=torch.bfloat16, seed=31 + t, config=PATHS[path])


@pytest.mark.parametrize("t", [4, 17])
def test_all_tokens_on_one_expert_and_idle_experts(t: int) -> None:
    ids = torch.full((t, 1), 2)
    check(t, 1, 4, hidden=72, inter=40, bits=[3, 5, 8, 2, 4, 6, 7, 3], dtype=torch.float16, seed=7, ids=ids)


@pytest.mark.parametrize("path", ["decode", "decode_sorted", "mid", "mid_words"])
def test_token_picking_one_expert_twice(path: str) -> None:
    ids = torch.tensor([[1, 1, 0], [2, 1, 2], [0, 3, 1]])
    check(3, 3, 4, hidden=64, inter=40, bits=[4, 2, 8, 3, 5, 6, 7, 2], dtype=torch.bfloat16, seed=8, ids=ids,
          config=PATHS[path])


def test_top8_of_many_experts() -> None:
    check(4, 8, 10, hidden=64, inter=32, bits=torch.randint(2, 9, (20,)).tolist(), dtype=torch.bfloat16, seed=11)


def test_shared_expert_path() -> None:
    ex = make(1, 64, 48, [4, 6], torch.bfloat16, 3)
    x = torch.randn(5, 64).to(torch.bfloat16).to(DEV)
    gate = torch.randn(5, 1).to(DEV)
    got = ap_moe_shared(x, ex, gate).float()
    ids = torch.zeros(5, 1, dtype=torch.int64, device=DEV)
    ref = ap_moe_ref(x, ids, torch.sigmoid(gate), ex).float()
    assert (got - ref).abs().max() <= 4 * 2**-7 * ref.abs().max()


@pytest.mark.parametrize("t", [1, 3, 17])
def test_routed_and_shared_block(t: int) -> None:
    """``ap_moe_block``: routed + gated shared expert (its own I) against the two references summed; at T = 1 and
    3 both take the decode path and are combined in one launch (partials summed in fp32), at T = 17 (the mid path)
    the two outputs are added."""
    h, i_r, i_s = 72, 40, 104
    ex = make(4, h, i_r, torch.randint(2, 9, (8,)).tolist(), torch.bfloat16, 60 + t)
    sh = make(1, h, i_s, [6, 3], torch.bfloat16, 61 + t)
    g = torch.Generator().manual_seed(62 + t)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(DEV)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(t)]).to(DEV)
    w = torch.rand(t, 2, generator=g).to(DEV)
    sw = torch.rand(t, 1, generator=g).to(DEV)
    assert (pick_config(t, h, i_r)["path"] == "decode") == (t < 16)
    got = ap_moe_block(x, ids, w, ex, sh, sw).float()
    zero = torch.zeros(t, 1, dtype=torch.int64, device=DEV)
    ref = ap_moe_ref(x, ids, w, ex).float() + ap_moe_ref(x, zero, sw, sh).float()
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max() <= 4 * 2**-7 * ref.abs().max()
    # the shared expert matters: leaving it out is caught
    assert (ap_moe(x, ids, w, ex).float() - ref).abs().max() > 4 * 2**-7 * ref.abs().max()
    with pytest.raises(ValueError, match="shared_w"):
        ap_moe_block(x, ids, w, ex, sh, sw[:, 0])
    with pytest.raises(ValueError, match="must match the routed experts"):
        ap_moe_block(x, ids, w, ex, make(1, h + 8, i_s, [4, 4], torch.bfloat16, 1), sw)
    with pytest.raises(ValueError, match="int32 or int64"):
        ap_moe_block(x, ids.float(), w, ex, sh, sw)


@pytest.mark.parametrize(("path", "t"), [("mid", 9), ("mid_words", 9), ("decode_sorted", 9), ("prefill", 9)])
def test_poisoned_scratch_rows_are_all_written(path: str, t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # NaN-filled buffers: any (token, slot) row (or split-K partial) the kernels fail to write shows up as NaN in y

    real_empty = torch.empty

    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        out = real_empty(*args, **kwargs)  # type: ignore[call-overload]
        return out.fill_(float("nan")) if out.is_floating_point() else out

    for mod in (dec, mid, mid_words, pre):
        monkeypatch.setattr(mod.torch, "empty", poisoned)
    ex = make(5, 64, 32, [8, 3] * 5, torch.bfloat16, 5)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(t, 64, generator=g).to(torch.bfloat16).to(DEV)
    ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(t)]).to(DEV)
    w = torch.rand(t, 2, generator=g).to(DEV)
    got = ap_moe(x, ids, w, ex, config=PATHS[path], check=False).float()
    ref = ap_moe_ref(x, ids, w, ex).float()
    assert torch.isfinite(got).all() and (got - ref).abs().max() <= 4 * 2**-7 * ref.abs().max()


def test_tables_changed_in_place_between_calls() -> None:
    # a runtime lowers q by rewriting bits / lut_offset in place: nothing derived from them may be cached
    e, hidden, inter = 3, 64, 40
    hi = make(e, hidden, inter, [8] * 2 * e, torch.bfloat16, 12)  # all 8 planes of every block placed
    lo = make(e, hidden, inter, [3] * 2 * e, torch.bfloat16, 12)  # same codes, 3-bit LUTs
    ex = APExperts(pool=hi.pool, plane_offset=hi.plane_offset.clone(), lut_pool=torch.cat([hi.lut_pool, lo.lut_pool]),
                   lut_offset=hi.lut_offset.clone(), bits=hi.bits.clone(), hidden=hidden, inter=inter)
    g = torch.Generator().manual_seed(13)
    x = torch.randn(2, hidden, generator=g).to(torch.bfloat16).to(DEV)
    ids = torch.tensor([[0, 2], [2, 1]], device=DEV)
    w = torch.rand(2, 2, generator=g).to(DEV)
    for step in range(2):
        if step == 1:
            ex.bits.fill_(3)
            ex.lut_offset.copy_(lo.lut_offset + hi.lut_pool.numel())
        got = ap_moe(x, ids, w, ex, config=PATHS["decode"], check=False).float()
        ref = ap_moe_ref(x, ids, w, ex).float()
        assert (got - ref).abs().max() <= 4 * 2**-7 * ref.abs().max()


@pytest.mark.skipif(DEV != "cuda", reason="host syncs only exist with a GPU")
@pytest.mark.parametrize("path", ["decode", "decode_sorted", "prefill"])
def test_no_host_sync_with_check_false(path: str) -> None:
    ex = make(4, 64, 32, [4, 6, 2, 8, 3, 5, 7, 4], torch.bfloat16, 14)
    x = torch.randn(3, 64, device=DEV).to(torch.bfloat16)
    ids = torch.tensor([[0, 3], [3, 1], [1, 0]], device=DEV)
    w = torch.rand(3, 2, device=DEV)
    ap_moe(x, ids, w, ex, config=PATHS[path], check=False)  # compile outside the guarded region
    torch.cuda.set_sync_debug_mode("error")
    try:
        ap_moe(x, ids, w, ex, config=PATHS[path], check=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize(("bad", "msg"), [("dtype", "float16 or bfloat16"), ("ids", "expert ids"),
                                          ("shape", "must be \\[T, 64\\]"), ("bits", "bits must be")])
def test_launcher_validates(bad: str, msg: str) -> None:
    ex = make(2, 64, 32, [4, 4, 4, 4], torch.bfloat16, 1)
    x = torch.randn(3, 64).to(torch.bfloat16).to(DEV)
    ids = torch.zeros(3, 1, dtype=torch.int64, device=DEV)
    w = torch.ones(3, 1, device=DEV)
    if bad == "dtype":
        x = x.float()
    elif bad == "ids":
        ids = ids + 5
    elif bad == "shape":
        x = torch.randn(3, 65).to(torch.bfloat16).to(DEV)
    elif bad == "bits":
        ex = type(ex)(**{**ex.__dict__, "bits": torch.tensor([4, 9, 4, 4], dtype=torch.int32, device=DEV)})
    with pytest.raises(ValueError, match=msg):
        ap_moe(x, ids, w, ex)


@pytest.mark.parametrize("cfg", [{}, {"path": "gemv"}, {"path": "fused", "BLOCK_M": 16}])
def test_unknown_path_is_refused(cfg: dict) -> None:
    ex = make(2, 64, 32, [4, 4, 4, 4], torch.bfloat16, 1)
    x = torch.randn(3, 64).to(torch.bfloat16).to(DEV)
    with pytest.raises(ValueError, match="config path must be one of"):
        ap_moe(x, torch.zeros(3, 1, dtype=torch.int64, device=DEV), torch.ones(3, 1, device=DEV), ex, config=cfg)




def test_routed_and_shared_block_on_chunked_word_first_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ap_moe_block`` at 10 tokens on the decode path for routed and shared experts: both chunked (8 + 2), the shared
    expert reusing the routed experts' word-major activations, partials combined once."""

    monkeypatch.setattr(am, "launch_config", lambda *a, **kw: parse_config(DECODE))
    h, i_r, i_s, t = 72, 40, 104, 10
    ex = make(4, h, i_r, torch.randint(2, 9, (8,)).tolist(), torch.bfloat16, 80)
    sh = make(1, h, i_s, [6, 3], torch.bfloat16, 81)
    g = torch.Generator().manual_seed(82)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(DEV)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(t)]).to(DEV)
    w, sw = torch.rand(t, 2, generator=g).to(DEV), torch.rand(t, 1, generator=g).to(DEV)
    got = am.ap_moe_block(x, ids, w, ex, sh, sw).float()
    zero = torch.zeros(t, 1, dtype=torch.int64, device=DEV)
    ref = ap_moe_ref(x, ids, w, ex).float() + ap_moe_ref(x, zero, sw, sh).float()
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max() <= 4 * 2**-7 * ref.abs().max()



def test_pick_config_buckets_by_tokens() -> None:
    """``pwkernels.config_buckets.pick_bucket`` behind ``pick_config``: the largest bound <= T wins, the first bucket
    below every bound, untuned shapes take the default buckets, and an empty config is a bucket like any other."""
    table = {"default": [{"min_tokens": 1, "config": {"path": "decode"}}],
             "by_shape": {"8x4": [{"min_tokens": 2, "config": {"path": "prefill"}}, {"min_tokens": 5, "config": {}},
                                  {"min_tokens": 16, "config": {"path": "mid"}}]}}
    assert pick_config(1, 8, 4, table) == {"path": "prefill"}
    assert pick_config(7, 8, 4, table) == {}
    assert pick_config(16, 8, 4, table) == {"path": "mid"}
    assert pick_config(99, 16, 4, table) == {"path": "decode"}


@pytest.mark.parametrize("shape", [*CONFIGS["by_shape"], "default"])
def test_every_shipped_bucket_resolves_to_a_path(shape: str) -> None:
    """Every bucket of ``pwkernels/configs/ap_moe.json`` parses to the typed config of an existing path (its JSON form
    round-trips), buckets ascend, and every token count of the shape resolves (past the last bucket too)."""
    rows = CONFIGS["default"] if shape == "default" else CONFIGS["by_shape"][shape]
    bounds = [r["min_tokens"] for r in rows]
    assert bounds[0] == 1 and bounds == sorted(set(bounds))
    for r in rows:
        cfg = parse_config(r["config"])
        assert isinstance(cfg, DecodeConfig | MidConfig | PrefillConfig)
        assert parse_config(to_json(cfg)) == cfg
    h, i = (None, None) if shape == "default" else map(int, shape.split("x"))
    for t in range(1, bounds[-1] + 20):
        assert launch_config(t, h, i) == parse_config(pick_config(t, h, i))


def test_the_tuned_shapes_route_as_tuned() -> None:
    """Qwen1.5-MoE's routed experts (2048 x 1408): decode up to 63 tokens (sorted slots from 2), the word-first mid
    path to 1023 (BLOCK_M 16, then 32 with one launch per class of bitwidths from 256), then prefill; its shared
    expert (2048 x 5632, one expert, every token): prefill from 9 tokens (the mid path took 2.5x its time at 32);
    Mixtral (4096 x 14336): mid from 17."""
    kinds = {t: type(launch_config(t, 2048, 1408)) for t in (1, 2, 16, 32, 63, 64, 255, 256, 1023, 1024)}
    assert kinds == {1: DecodeConfig, 2: DecodeConfig, 16: DecodeConfig, 32: DecodeConfig, 63: DecodeConfig,
                     64: MidConfig, 255: MidConfig, 256: MidConfig, 1023: MidConfig, 1024: PrefillConfig}
    one, two = launch_config(1, 2048, 1408), launch_config(2, 2048, 1408)
    assert isinstance(one, DecodeConfig) and isinstance(two, DecodeConfig)
    assert one.SLOTS == 0 and two.SLOTS == 1 and one.gate_up.RAW_SHFL
    mid, wide = launch_config(64, 2048, 1408), launch_config(256, 2048, 1408)
    assert isinstance(mid, MidConfig) and isinstance(wide, MidConfig)
    assert mid.WORDS and not mid.SPLIT_Q and mid.BLOCK_M == 16 and wide.WORDS and wide.SPLIT_Q and wide.BLOCK_M == 32
    assert all(isinstance(launch_config(t, 2048, 5632), PrefillConfig) for t in (9, 17, 32, 63, 64, 2048))
    assert isinstance(launch_config(8, 2048, 5632), DecodeConfig)
    assert isinstance(launch_config(17, 4096, 14336), MidConfig)


@pytest.mark.parametrize(("raw", "msg"), [
    ({"path": "gemv", "BLOCK_N": 16}, "config path must be one of"),
    ({"BLOCK_N": 16}, "config path must be one of"),
    ({"path": "mid", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPREAD": 1}, "unknown keys \\['SPREAD'\\]"),
    ({"path": "mid", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 48}, "multiple of 32"),
    ({"path": "mid", "BLOCK_M": 0, "BLOCK_N": 32, "BLOCK_K": 64}, "BLOCK_M must be an integer >= 1"),
    ({"path": "prefill", "BLOCK_N": 16.0}, "BLOCK_N must be an integer"),
    ({"path": "decode", "gate_up": {"BLOCK_N": 8, "BLOCK_K": 1024}}, "incomplete decode config"),
    ({"path": "decode", "gate_up": {"BLOCK_N": 8, "BLOCK_K": 1024}, "down": {"BLOCK_N": 8, "BLOCK_K": 64, "X": 1}},
     "unknown keys \\['X'\\] in the decode down tile"),
    ({**DECODE, "SLOTS": 3}, "SLOTS must be"),
    ({"path": "mid", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "WORDS": 1}, "BLOCK_K 512 or 1024"),
    ({"path": "mid", "BLOCK_M": 8, "BLOCK_N": 32, "BLOCK_K": 512, "WORDS": 1}, "BLOCK_M 16 or 32"),
    ({"path": "mid", "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 512, "WORDS": 1}, "BLOCK_M 16 or 32"),
    ({"path": "mid", "BLOCK_M": 16, "BLOCK_N": 24, "BLOCK_K": 512, "WORDS": 1}, "BLOCK_N must be a power of 2"),
    ({"path": "mid", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 512, "WORDS": 1, "BLOCK_N_DOWN": 8}, "BLOCK_N_DOWN 0"),
    ({"path": "mid", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "BLOCK_N_DOWN": -1}, "BLOCK_N_DOWN must be"),
])
def test_bad_configs_are_refused(raw: dict, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        parse_config(raw)


def test_config_defaults() -> None:
    assert parse_config({"path": "prefill"}) == PrefillConfig(32, 128, 4)
    tile = DecodeTile(16, 1024, RAW_SHFL=1)  # type: ignore[arg-type]
    assert tile.RAW_SHFL is True and tile.SPLIT_K == 1 and tile.num_warps == 4
