"""AP MoE kernels vs their PyTorch reference (Triton interpreter on CPU, native on GPU).

Fresh random inputs each run; ragged sizes (H, I not multiples of the tiles), experts with no
token, all tokens on one expert, a token picking one expert twice, every q in 1..8, a random mix
of q in one launch, several top-k, bf16 and fp16, on each path (decode in token-slot and sorted-slot
modes, mid-size tl.dot tiles, dequantize + GEMM); scratch buffers are poisoned first so unwritten rows
are caught; bits / LUT tables changed in place between calls are honoured.
"""

from __future__ import annotations

import pytest
import torch

from kernels.moe.codec import dequantize
from kernels.moe.dispatch import ap_moe, ap_moe_block, ap_moe_shared, pick_config
from kernels.moe.experts import APExperts, build_experts
from kernels.moe.prefill import dequant_blocks
from kernels.moe.ref import ap_moe_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make(num_experts: int, hidden: int, inter: int, bits: list[int], dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes, luts = [], []
    for i in range(2 * num_experts):
        n, k = (2 * inter, hidden) if i % 2 == 0 else (hidden, inter)
        codes.append(torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g))
        luts.append({b: (torch.randn(n, 2**b, generator=g) * k**-0.5) for b in range(1, 9)})
    return build_experts(codes, luts, bits, hidden, inter, dtype, DEV, shuffle_seed=seed)


# one small config per path (few programs, so the interpreter stays fast)
PATHS = {
    "decode": {"path": "decode", "gate_up": {"BLOCK_N": 32, "BLOCK_K": 64},
               "down": {"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": 2}},
    "decode_sorted": {"path": "decode", "gate_up": {"BLOCK_N": 16, "BLOCK_K": 128},
                      "down": {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1}, "SLOTS": 2},
    "mid": {"path": "mid", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64},
    "prefill": {"path": "prefill", "BLOCK_N": 16, "BLOCK_K": 64},
}
DECODE = {"path": "decode", "gate_up": {"BLOCK_N": 16, "BLOCK_K": 64},
          "down": {"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 2}}


def check(t: int, k: int, e: int, hidden: int, inter: int, bits: list[int], dtype: torch.dtype, seed: int,
          ids: torch.Tensor | None = None, config: dict | None = None) -> None:
    ex = make(e, hidden, inter, bits, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(t, hidden, generator=g).to(dtype).to(DEV)
    if ids is None:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g).to(DEV)
    ids = ids.to(DEV)
    got = ap_moe(x, ids, w, ex, config=config).float()
    ref = ap_moe_ref(x, ids, w, ex).float()
    assert torch.isfinite(got).all()
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item() + 1e-6
    # bf16 / fp16 rounding of the output and of the stored intermediate: a few ulps of the output scale
    tol = (2**-7 if dtype == torch.bfloat16 else 2**-10) * 4
    assert err <= tol * scale, f"max err {err:.3e} vs scale {scale:.3e}"


BF, FP = torch.bfloat16, torch.float16
ROUTING_CASES = [(1, 1, FP), (3, 2, BF), (3, 2, FP), (8, 4, BF), (33, 2, FP), (257, 2, BF)]


@pytest.mark.parametrize(("t", "k", "dtype"), ROUTING_CASES)
def test_random_routing_ragged_shapes(t: int, k: int, dtype: torch.dtype) -> None:
    e = 6
    bits = torch.randint(2, 9, (2 * e,)).tolist()  # a random mix of q in one launch
    check(t, k, e, hidden=96 + 8, inter=40, bits=bits, dtype=dtype, seed=t * 10 + k)


@pytest.mark.parametrize("q", [1, 2, 3, 4, 5, 6, 7, 8])
def test_every_bitwidth(q: int) -> None:
    t = 1 if q % 2 else 5  # both decode branches (one token / a loop over tokens); mixed-q tests cover the rest
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


@pytest.mark.parametrize("path", ["decode", "decode_sorted", "mid"])
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


@pytest.mark.parametrize(("path", "t"), [("mid", 9), ("decode_sorted", 9), ("prefill", 9)])
def test_poisoned_scratch_rows_are_all_written(path: str, t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # NaN-filled buffers: any (token, slot) row (or split-K partial) the kernels fail to write shows up as NaN in y
    import kernels.moe.decode as dec
    import kernels.moe.mid as mid
    import kernels.moe.prefill as pre

    real_empty = torch.empty

    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        out = real_empty(*args, **kwargs)  # type: ignore[call-overload]
        return out.fill_(float("nan")) if out.is_floating_point() else out

    for mod in (dec, mid, pre):
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
@pytest.mark.parametrize("path", ["decode", "decode_sorted", "mid", "prefill"])
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_dequant_path_matches_reference(dtype: torch.dtype) -> None:
    ex = make(5, 72, 40, torch.randint(2, 9, (10,)).tolist(), dtype, 21)
    g = torch.Generator().manual_seed(22)
    x = torch.randn(20, 72, generator=g).to(dtype).to(DEV)
    ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(20)]).to(DEV)
    w = torch.rand(20, 2, generator=g).to(DEV)
    cfg = {"path": "prefill", "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4}
    got = ap_moe(x, ids, w, ex, config=cfg).float()
    ref = ap_moe_ref(x, ids, w, ex).float()
    tol = (2**-7 if dtype == torch.bfloat16 else 2**-10) * 4
    assert (got - ref).abs().max() <= tol * ref.abs().max()


def test_dequant_blocks_match_reference_dequantization() -> None:
    ex = make(3, 100, 36, [2, 5, 8, 3, 4, 6], torch.bfloat16, 4)
    got = dequant_blocks(ex, torch.tensor([2, 0, 4], device=DEV), "gate_up", torch.bfloat16)
    for j, b in enumerate([2, 0, 4]):
        planes, lut, _, k = ex.block(b)
        assert torch.equal(got[j], dequantize(planes, lut, k, planes.shape[0], torch.bfloat16))


@pytest.mark.parametrize(("t", "k", "e", "hidden", "inter", "dtype"),
                         [(1, 1, 3, 104, 40, BF), (1, 4, 6, 64, 32, FP), (1, 8, 9, 72, 40, BF),
                          (2, 2, 5, 104, 40, FP), (3, 2, 3, 72, 40, BF), (4, 2, 4, 64, 48, BF), (8, 1, 3, 72, 40, FP)])
def test_word_first_path_ragged_mixed_q(t: int, k: int, e: int, hidden: int, inter: int, dtype: torch.dtype) -> None:
    """Decode path (1..8 tokens): H and I not multiples of 32 or of the tiles, a random mix of q in 2..8 in one launch,
    top-k 1..8, tokens sharing experts and experts with no token, split-K over the down rows, bf16 and fp16."""
    bits = torch.randint(2, 9, (2 * e,), generator=torch.Generator().manual_seed(k + t)).tolist()
    check(t, k, e, hidden, inter, bits, dtype, seed=40 + k + 7 * t, config=DECODE)


def test_word_first_path_every_bitwidth() -> None:
    for q in range(2, 9):
        check(1, 1, 2, hidden=64, inter=32, bits=[q] * 4, dtype=torch.bfloat16, seed=50 + q, config=DECODE)


@pytest.mark.skipif(DEV != "cuda", reason="inline PTX: CUDA only (the interpreter takes tl.gather)")
@pytest.mark.parametrize("t", [1, 3])
def test_word_first_path_raw_shuffles(t: int) -> None:
    """RAW_SHFL tiles (shuffles by inline shfl.sync that read 5 index bits, or 4 within 16-lane segments): 32-word
    and 16-word K steps, every q in 2..8 in one launch, ragged H and I, bf16 and fp16, against the reference."""
    bits = [2, 3, 4, 5, 6, 7, 8, 4, 5, 3, 2, 8, 6, 5]
    for bk_gu, bk_dn in ((1024, 1024), (512, 512), (1024, 512)):
        raw = {"path": "decode", "gate_up": {"BLOCK_N": 8, "BLOCK_K": bk_gu, "RAW_SHFL": 1},
               "down": {"BLOCK_N": 32, "BLOCK_K": bk_dn, "SPLIT_K": 2, "RAW_SHFL": 1}}
        for dtype in (torch.bfloat16, torch.float16):
            check(t, 4, 7, hidden=1064, inter=1400, bits=bits, dtype=dtype, seed=70 + t + bk_dn, config=raw)


def test_raw_shuffles_only_on_nvidia_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """RAW_SHFL is inline PTX: asked for by the tile, it is used only on NVIDIA CUDA tensors with a 16- or 32-word K
    step; CPU (interpreter), ROCm (torch.version.hip set, is_cuda also true) and other K steps keep tl.gather."""
    from types import SimpleNamespace

    from kernels.moe.decode import _raw

    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    tile = {"RAW_SHFL": 1}
    monkeypatch.setattr(torch.version, "hip", None)
    assert _raw(tile, 32, cuda) and _raw(tile, 16, cuda)  # type: ignore[arg-type]
    assert not _raw(tile, 8, cuda) and not _raw({}, 32, cuda) and not _raw(tile, 32, cpu)  # type: ignore[arg-type]
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    assert not _raw(tile, 32, cuda)  # type: ignore[arg-type]


def test_word_first_path_expert_picked_twice_all_on_one_expert_and_wide_tiles() -> None:
    """Tokens whose top-k names one expert twice (both slots weighted), all tokens on one expert, tiles wider
    than the block (masked)."""
    cfg = {"path": "decode", "gate_up": {"BLOCK_N": 8, "BLOCK_K": 256}, "down": {"BLOCK_N": 32, "BLOCK_K": 128}}
    check(1, 3, 4, hidden=72, inter=40, bits=[4, 2, 8, 3, 5, 6, 7, 2], dtype=torch.float16, seed=9,
          ids=torch.tensor([[2, 0, 2]]), config=cfg)
    check(3, 2, 4, hidden=72, inter=40, bits=[4, 2, 8, 3, 5, 6, 7, 2], dtype=torch.bfloat16, seed=10,
          ids=torch.tensor([[1, 1], [1, 3], [3, 1]]), config=cfg)


def test_word_first_path_poisoned_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode path's scratch buffers come back NaN-filled: the padded intermediate columns (I = 40 -> 64 read)
    must be zeroed by gate_up and rows of tokens without work never stored, or the output turns NaN."""
    import kernels.moe.decode as g

    real_empty = torch.empty

    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        out = real_empty(*args, **kwargs)  # type: ignore[call-overload]
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(g.torch, "empty", poisoned)
    cfg = {"path": "decode", "gate_up": {"BLOCK_N": 16, "BLOCK_K": 1024}, "down": {"BLOCK_N": 32, "BLOCK_K": 1024}}
    check(3, 2, 4, hidden=72, inter=40, bits=[4, 5, 8, 3, 6, 2, 7, 4], dtype=torch.bfloat16, seed=11,
          ids=torch.tensor([[1, 3], [1, 0], [3, 1]]), config=cfg)


def test_padded_word_major_rows() -> None:
    """word_major pads to the words asked for (zeros) and refuses too few; padded_words covers every K step."""
    from kernels.moe.layout import padded_words, word_major

    x = torch.randn(2, 70)
    got = word_major(x, 5)
    assert got.shape == (2, 32, 5) and (got[:, :, 3:] == 0).all() and got[1, 5, 2] == x[1, 69]
    with pytest.raises(ValueError, match="fewer than K"):
        word_major(x, 2)
    assert padded_words(1408, 32) == 64 and padded_words(1408, 16) == 48 and padded_words(1408, 16, 2) == 64
    assert padded_words(2048, 32) == 64 and padded_words(72, 1, 2) == 4


@pytest.mark.parametrize(("t", "k", "e"), [(9, 2, 5), (12, 1, 3), (17, 1, 3)])
def test_word_first_path_chunks_beyond_8_tokens(t: int, k: int, e: int) -> None:
    """More than 8 tokens on the decode path run as chunks of 8 and the rest (8 + 1, 8 + 4, 8 + 8 + 1): every
    token's row must come out (a chunk dropped or misplaced along T is caught), with a random mix of q and ragged
    H, I."""
    from kernels.moe.decode import chunks

    assert chunks(t) == [(a, min(a + 8, t)) for a in range(0, t, 8)] and chunks(8) == [(0, 8)]
    bits = torch.randint(2, 9, (2 * e,), generator=torch.Generator().manual_seed(t)).tolist()
    check(t, k, e, hidden=72, inter=40, bits=bits, dtype=torch.bfloat16, seed=70 + t, config=DECODE)


@pytest.mark.parametrize(("t", "k", "e", "slots"), [(3, 2, 4, 2), (9, 2, 5, 2), (17, 1, 3, 4), (5, 3, 4, 1),
                                                   (12, 1, 3, 8)])
def test_sorted_slots_word_first_path(t: int, k: int, e: int, slots: int) -> None:
    """The decode path in the sorted-slots mode (pairs sorted by expert, ``slots`` per program, any T in one launch,
    17 tokens too): experts with more pairs than slots (several groups), with fewer (idle slots), a random mix of
    q, ragged H and I; at T = 3, k = 2 of 4 experts some may get no token."""
    bits = torch.randint(2, 9, (2 * e,), generator=torch.Generator().manual_seed(t + slots)).tolist()
    check(t, k, e, hidden=72, inter=40, bits=bits, dtype=torch.bfloat16, seed=170 + t,
          config={**DECODE, "SLOTS": slots})


def test_sorted_slots_all_tokens_on_one_expert_and_bad_slots() -> None:
    """Ten tokens on one expert with 4 slots: three groups of that expert (4 + 4 + 2 pairs); fp16. SLOTS other than
    a plain int 1, 2, 4, 8 (or 0) is refused before any launch."""
    from kernels.moe.decode import decode_partials

    cfg = {**DECODE, "SLOTS": 4}
    check(10, 1, 4, hidden=72, inter=40, bits=[3, 5, 8, 2, 4, 6, 7, 3], dtype=torch.float16, seed=7,
          ids=torch.full((10, 1), 2), config=cfg)
    ex = make(2, 64, 32, [4, 4, 4, 4], torch.bfloat16, 5)
    x = torch.randn(3, 64).to(torch.bfloat16).to(DEV)
    for bad in (3, 16, -1, "2", 2.0, True, None):  # 2.0 / True compare equal to allowed ints
        with pytest.raises(ValueError, match="SLOTS must be"):
            decode_partials(x, torch.zeros(3, 1, dtype=torch.int64, device=DEV), torch.ones(3, 1, device=DEV), ex,
                           {**DECODE, "SLOTS": bad})


def test_chunked_word_first_path_rebuilds_foreign_activations() -> None:
    """Word-major activations given for reuse that are not x's (more tokens than T) are rebuilt, past 8 tokens as
    below (slicing them per chunk would have passed each chunk's shape check and computed on the wrong rows)."""
    from kernels.moe.decode import decode_partials
    from kernels.moe.layout import combine, padded_words, word_major

    t, h, i = 12, 72, 40
    ex = make(3, h, i, [4, 5, 3, 6, 8, 2], torch.bfloat16, 90)
    g = torch.Generator().manual_seed(91)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(DEV)
    ids = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(t)]).to(DEV)
    w = torch.rand(t, 2, generator=g).to(DEV)
    other = word_major(torch.randn(20, h, generator=g).to(torch.bfloat16).to(DEV),
                       padded_words(h, DECODE["gate_up"]["BLOCK_K"] // 32))
    p, xw = decode_partials(x, ids, w, ex, DECODE, other)
    ref = ap_moe_ref(x, ids, w, ex).float()
    assert (combine(p, None, x.dtype).float() - ref).abs().max() <= 4 * 2**-7 * ref.abs().max()
    assert xw.shape[0] == t


def test_routed_and_shared_block_on_chunked_word_first_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ap_moe_block`` at 10 tokens on the decode path for routed and shared experts: both chunked (8 + 2), the shared
    expert reusing the routed experts' word-major activations, partials combined once."""
    import kernels.moe.dispatch as am

    monkeypatch.setattr(am, "pick_config", lambda *a, **kw: DECODE)
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


def test_word_major_layout() -> None:
    """word_major puts column 32 w + i at [t, i, w] and zero-pads the last word."""
    from kernels.moe.layout import word_major

    x = torch.arange(2 * 70, dtype=torch.float32).view(2, 70)
    got = word_major(x)
    assert got.shape == (2, 32, 3)
    for t, col in [(0, 0), (1, 33), (0, 69), (1, 64)]:
        assert got[t, col % 32, col // 32] == x[t, col]
    assert (got[:, 6:, 2] == 0).all()
    from kernels.moe.layout import padded_words

    assert padded_words(70, 2) == 4 and padded_words(70, 1, 2) == 4
    with pytest.raises(ValueError, match=">= 1"):
        padded_words(64, 0)


@pytest.mark.parametrize("with_b", [False, True])
def test_combine_sums_partials_and_rounds_once(with_b: bool) -> None:
    """combine = a.sum((0, 2)) (+ b.sum((0, 2))) in fp32, one rounding; ragged H (not a multiple of the block)."""
    from kernels.moe.layout import combine

    g = torch.Generator().manual_seed(3)
    a = torch.randn(3, 2, 4, 1100, generator=g).to(DEV)
    b = torch.randn(2, 2, 1, 1100, generator=g).to(DEV) if with_b else None
    ref = a.sum((0, 2)) + (b.sum((0, 2)) if b is not None else 0)
    got = combine(a, b, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 1100)
    # one rounding to nearest: the bf16 of the fp32 sum, but where summation order moves the sum across a tie
    close = (got.float() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-5  # half an ulp
    assert close.all() and (got == ref.to(torch.bfloat16)).float().mean() > 0.99
    with pytest.raises(ValueError, match="agree"):
        combine(a, torch.zeros(1, 3, 1, 1100, device=DEV), torch.bfloat16)
    # non-contiguous partials (a transposed view) give the same sums; no columns: an empty result
    at = a.transpose(1, 2).contiguous().transpose(1, 2)
    assert not at.is_contiguous() and torch.equal(combine(at, b, torch.bfloat16), got)
    assert combine(a[..., :0], None, torch.bfloat16).shape == (2, 0)
    with pytest.raises(ValueError, match="fp32 partials"):
        combine(a[0], None, torch.bfloat16)


def test_word_first_path_more_splits_than_k_steps() -> None:
    """The decode path's down with split-K 8 over fewer K steps (I = 104: one 32-word step; I = 300: 5 two-word steps):
    the splits past the last step add nothing and must still write their (zero) partials."""
    cfg = {"path": "decode", "gate_up": {"BLOCK_N": 8, "BLOCK_K": 1024},
           "down": {"BLOCK_N": 16, "BLOCK_K": 1024, "SPLIT_K": 8}}
    check(1, 2, 4, hidden=72, inter=104, bits=[8, 3, 6, 4, 5, 8, 2, 7], dtype=torch.bfloat16, seed=5, config=cfg)
    cfg["down"]["BLOCK_K"] = 64
    check(1, 2, 4, hidden=72, inter=300, bits=[8, 3, 6, 4, 5, 8, 2, 7], dtype=torch.bfloat16, seed=6, config=cfg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shared_expert_prefill_path(dtype: torch.dtype) -> None:
    """The prefill (dequant) path of one expert at k = 1 (a shared expert: no sorting, two plain GEMMs) against the
    reference, with a gate weight per token, and against the grouped path of the same expert among others."""
    ex = make(1, 72, 104, [5, 3], dtype, 31)
    g = torch.Generator().manual_seed(32)
    x = torch.randn(40, 72, generator=g).to(dtype).to(DEV)
    gate = torch.rand(40, 1, generator=g).to(DEV)
    ids = torch.zeros(40, 1, dtype=torch.int64, device=DEV)
    cfg = {"path": "prefill", "BLOCK_N": 16, "BLOCK_K": 64}
    got = ap_moe(x, ids, gate, ex, config=cfg).float()
    ref = ap_moe_ref(x, ids, gate, ex).float()
    tol = (2**-7 if dtype == torch.bfloat16 else 2**-10) * 4
    assert (got - ref).abs().max() <= tol * ref.abs().max()
    assert got[gate[:, 0] > 0.5].abs().sum() > 0  # rows are written, scaled by their own gate
    wide = make(2, 72, 104, [5, 3, 4, 4], dtype, 31)  # same seed: expert 0 as above, and a second expert
    for b in (0, 1):
        assert all(torch.equal(u, v) for u, v in zip(wide.block(b)[:2], ex.block(b)[:2], strict=True))
    grouped = ap_moe(x, ids, gate, wide, config=cfg).float()  # the grouped path: the same sums (GEMM order aside)
    assert (got - grouped).abs().max() <= 2 * torch.finfo(dtype).eps * grouped.abs().max()


def test_pick_config_buckets_by_tokens() -> None:
    """``kernels.config_buckets.pick_bucket`` behind ``pick_config``: the largest bound <= T wins, the first bucket
    below every bound, untuned shapes take the default buckets, and an empty config is a bucket like any other."""
    table = {"default": [{"min_tokens": 1, "config": {"path": "decode"}}],
             "by_shape": {"8x4": [{"min_tokens": 2, "config": {"path": "prefill"}}, {"min_tokens": 5, "config": {}},
                                  {"min_tokens": 16, "config": {"path": "mid"}}]}}
    assert pick_config(1, 8, 4, table) == {"path": "prefill"}
    assert pick_config(7, 8, 4, table) == {}
    assert pick_config(16, 8, 4, table) == {"path": "mid"}
    assert pick_config(99, 16, 4, table) == {"path": "decode"}
