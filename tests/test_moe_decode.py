"""The decode path (``pwkernels.moe.decode``, word-first GEMV kernels) and its layout helpers against the reference:
ragged H and I, a random mix of q in one launch, top-k 1..8, token slots and sorted slots, chunks past 8 tokens,
split-K over more programs than K steps, poisoned scratch buffers (interpreter on CPU, native on GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _moe_cases import BF, DECODE, DEV, FP, check, make

import pwkernels.moe.decode as g
from pwkernels.moe.decode import chunks, decode_partials
from pwkernels.moe.dispatch import ap_moe
from pwkernels.moe.launch import DecodeTile, parse_config
from pwkernels.moe.layout import combine, padded_words, word_major
from pwkernels.moe.ref import ap_moe_ref


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

    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    tile, plain = DecodeTile(8, 1024, RAW_SHFL=True), DecodeTile(8, 1024)
    monkeypatch.setattr(torch.version, "hip", None)
    assert g._raw(tile.RAW_SHFL, 32, cuda) and g._raw(tile.RAW_SHFL, 16, cuda)  # type: ignore[arg-type]
    assert not g._raw(tile.RAW_SHFL, 8, cuda) and not g._raw(plain.RAW_SHFL, 32, cuda)  # type: ignore[arg-type]
    assert not g._raw(tile.RAW_SHFL, 32, cpu)  # type: ignore[arg-type]
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    assert not g._raw(tile.RAW_SHFL, 32, cuda)  # type: ignore[arg-type]


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

    cfg = {**DECODE, "SLOTS": 4}
    check(10, 1, 4, hidden=72, inter=40, bits=[3, 5, 8, 2, 4, 6, 7, 3], dtype=torch.float16, seed=7,
          ids=torch.full((10, 1), 2), config=cfg)
    ex = make(2, 64, 32, [4, 4, 4, 4], torch.bfloat16, 5)
    x = torch.randn(3, 64).to(torch.bfloat16).to(DEV)
    for bad in (3, 16, -1, "2", 2.0, True, None):  # 2.0 / True compare equal to allowed ints
        with pytest.raises(ValueError, match="SLOTS must be"):
            ap_moe(x, torch.zeros(3, 1, dtype=torch.int64, device=DEV), torch.ones(3, 1, device=DEV), ex,
                   {**DECODE, "SLOTS": bad})


def test_chunked_word_first_path_rebuilds_foreign_activations() -> None:
    """Word-major activations given for reuse that are not x's (more tokens than T) are rebuilt, past 8 tokens as
    below (slicing them per chunk would have passed each chunk's shape check and computed on the wrong rows)."""

    t, h, i = 12, 72, 40
    ex = make(3, h, i, [4, 5, 3, 6, 8, 2], torch.bfloat16, 90)
    g = torch.Generator().manual_seed(91)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(DEV)
    ids = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(t)]).to(DEV)
    w = torch.rand(t, 2, generator=g).to(DEV)
    other = word_major(torch.randn(20, h, generator=g).to(torch.bfloat16).to(DEV),
                       padded_words(h, DECODE["gate_up"]["BLOCK_K"] // 32))
    p, xw = decode_partials(x, ids, w, ex, parse_config(DECODE), other)
    ref = ap_moe_ref(x, ids, w, ex).float()
    assert (combine(p, None, x.dtype).float() - ref).abs().max() <= 4 * 2**-7 * ref.abs().max()
    assert xw.shape[0] == t



def test_word_major_layout() -> None:
    """word_major puts column 32 w + i at [t, i, w] and zero-pads the last word."""

    x = torch.arange(2 * 70, dtype=torch.float32).view(2, 70)
    got = word_major(x)
    assert got.shape == (2, 32, 3)
    for t, col in [(0, 0), (1, 33), (0, 69), (1, 64)]:
        assert got[t, col % 32, col // 32] == x[t, col]
    assert (got[:, 6:, 2] == 0).all()

    assert padded_words(70, 2) == 4 and padded_words(70, 1, 2) == 4
    with pytest.raises(ValueError, match=">= 1"):
        padded_words(64, 0)


@pytest.mark.parametrize("with_b", [False, True])
def test_combine_sums_partials_and_rounds_once(with_b: bool) -> None:
    """combine = a.sum((0, 2)) (+ b.sum((0, 2))) in fp32, one rounding; ragged H (not a multiple of the block)."""

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
