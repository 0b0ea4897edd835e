"""Paged decode attention kernel vs its PyTorch reference, and the reference vs dense SDPA.

Triton interpreter on CPU (small shapes), native on the GPU (the CUDA test at serving sizes).
Each case first draws dense per-sequence K/V, then scatters them into shuffled physical blocks
of a NaN-filled cache (padding table entries are junk), so a read of any slot a sequence does not
own, or of a padding entry, shows up as NaN or a crash. The reference is itself checked against
``F.scaled_dot_product_attention`` on the dense K/V, which never goes through a block table.
Ragged lengths (1, block_size - 1, block_size, 3 * block_size + 5, random), block sizes 8/16/32,
GQA groups 1/2/4, D 64/128, bf16 and fp16, K and V in one tensor at layer offsets, context
splits, a NaN-poisoned ``out``, a strided q.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import pwkernels.paged_attention as pa
from pwkernels.paged_attention import paged_decode_attention, paged_decode_attention_ref, pick_num_splits

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16, FP16 = torch.bfloat16, torch.float16


@dataclass
class Case:
    q: torch.Tensor  # [S, Hq, D]
    k_cache: torch.Tensor  # [U, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    context_lens: torch.Tensor  # int32 [S]
    k_offset: int
    v_offset: int
    dense_k: list[torch.Tensor]  # per sequence [ctx, Hkv, D]
    dense_v: list[torch.Tensor]

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int, int]:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.scale,
                self.k_offset, self.v_offset)


def make_case(ctx_lens: list[int], hq: int, hkv: int, d: int, block_size: int, dtype: torch.dtype, seed: int,
              num_layers: int = 0, layer: int = 0, device: str = DEV) -> Case:
    """Random case; ``num_layers > 0``: one shared K/V tensor, 2 * num_layers units per block (runtime layout)."""
    g = torch.Generator().manual_seed(seed)
    nbs = [-(-c // block_size) for c in ctx_lens]
    total = sum(nbs) + 3  # 3 spare blocks that no sequence owns
    per_block = 2 * num_layers if num_layers else 1
    k_off, v_off = (2 * layer, 2 * layer + 1) if num_layers else (0, 0)
    shape = (total * per_block, block_size, hkv, d)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = k_cache if num_layers else torch.full(shape, float("nan"), dtype=dtype)
    junk = torch.randint(-(10**6), 10**6, (len(ctx_lens), max(nbs) + 1), generator=g, dtype=torch.int32)
    block_tables = junk.clone()  # entries past a sequence's blocks stay junk
    phys = torch.randperm(total, generator=g)  # shuffled, non-contiguous blocks
    dense_k, dense_v, used = [], [], 0
    for s, (ctx, nb) in enumerate(zip(ctx_lens, nbs, strict=True)):
        kd = torch.randn(ctx, hkv, d, generator=g).to(dtype)
        vd = torch.randn(ctx, hkv, d, generator=g).to(dtype)
        dense_k.append(kd)
        dense_v.append(vd)
        for j in range(nb):
            base = int(phys[used + j]) * per_block
            block_tables[s, j] = base
            rows = slice(j * block_size, min((j + 1) * block_size, ctx))
            k_cache[base + k_off, : rows.stop - rows.start] = kd[rows]
            v_cache[base + v_off, : rows.stop - rows.start] = vd[rows]
        used += nb
    q = (2 * torch.randn(len(ctx_lens), hq, d, generator=g)).to(dtype)  # x2: sharper softmax rows too
    kc = k_cache.to(device)  # one device copy: K and V must stay the same tensor when shared
    return Case(q.to(device), kc, kc if num_layers else v_cache.to(device),
                block_tables.to(device), torch.tensor(ctx_lens, dtype=torch.int32, device=device), k_off, v_off,
                [t.to(device) for t in dense_k], [t.to(device) for t in dense_v])


def dense_attention(c: Case) -> torch.Tensor:
    """Independent check of the reference: fp32 SDPA on the dense K/V (GQA by enable_gqa)."""
    outs = []
    for s, (kd, vd) in enumerate(zip(c.dense_k, c.dense_v, strict=True)):
        o = F.scaled_dot_product_attention(c.q[s, :, None].float(), kd.transpose(0, 1).float(),
                                           vd.transpose(0, 1).float(), scale=c.scale, enable_gqa=True)
        outs.append(o[:, 0])
    return torch.stack(outs)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, ulps: int = 4) -> None:
    assert torch.isfinite(got).all(), "non-finite output: a masked or foreign slot was read"
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    tol = ulps * (2**-7 if dtype == BF16 else 2**-10) * scale  # a few output-dtype ulps of the output scale
    assert err <= tol, f"max err {err:.3e} > tol {tol:.3e}"


def check(c: Case, num_splits: int | None = None, config: dict | None = None) -> torch.Tensor:
    got = paged_decode_attention(*c.args(), num_splits=num_splits, config=config)
    ref = paged_decode_attention_ref(*c.args())
    assert got.shape == c.q.shape and got.dtype == c.q.dtype
    assert_close(got, ref, c.q.dtype)
    assert_close(ref, dense_attention(c), c.q.dtype)
    return got


def ragged(block_size: int, seed: int) -> list[int]:
    r = int(torch.randint(2, 4 * block_size, (1,), generator=torch.Generator().manual_seed(seed)))
    return [1, block_size - 1, block_size, 3 * block_size + 5, r]


@pytest.mark.parametrize(("block_size", "hq", "hkv", "d", "dtype"), [
    (16, 4, 2, 64, BF16),  # the tiny model: GQA group 2, head_dim 64
    (16, 4, 2, 64, FP16),
    (8, 4, 4, 64, FP16),  # group 1, tokens of one tile span 8 blocks
    (32, 8, 2, 64, BF16),  # group 4
    (16, 2, 2, 128, BF16),
    (8, 8, 2, 128, FP16),
])
@pytest.mark.parametrize("dot", [1, 0])
def test_ragged_contexts_match_reference(block_size: int, hq: int, hkv: int, d: int, dtype: torch.dtype,
                                         dot: int) -> None:
    """Both products: tensor cores (group padded to 16 rows) and fp32 broadcast (no padding; the MHA choice)."""
    cfg = {**pa.CONFIGS["default"], "DOT": dot}
    check(make_case(ragged(block_size, hq + d), hq, hkv, d, block_size, dtype, seed=block_size * hq + d), config=cfg)


@pytest.mark.parametrize("layer", [0, 2])
def test_shared_kv_tensor_with_layer_offsets(layer: int) -> None:
    # runtime layout: one tensor, K of layer l at unit base + 2l, V at base + 2l + 1; other layers are NaN
    c = make_case([1, 16, 37, 5], 4, 2, 64, 16, BF16, seed=layer, num_layers=3, layer=layer)
    assert c.k_cache is c.v_cache and (c.k_offset, c.v_offset) == (2 * layer, 2 * layer + 1)
    check(c)


@pytest.mark.parametrize(("num_splits", "block_n", "dot"), [(2, 64, 1), (3, 16, 1), (7, 16, 1), (3, 16, 0)])
def test_context_splits_and_merge(num_splits: int, block_n: int, dot: int) -> None:
    # small BLOCK_N so splits land inside cache blocks' runs and many splits are empty for short contexts
    cfg = {**pa.CONFIGS["default"], "BLOCK_N": block_n, "DOT": dot}
    c = make_case([1, 90, 8, 33], 4, 2, 64, 8, FP16, seed=num_splits)
    split = check(c, num_splits=num_splits, config=cfg)
    one = paged_decode_attention(*c.args(), num_splits=1, config=cfg)
    assert_close(split, one, FP16)


def test_poisoned_out_is_fully_written_and_returned() -> None:
    c = make_case([3, 20, 16], 8, 2, 64, 16, BF16, seed=5)
    out = torch.full_like(c.q, float("nan"))
    got = paged_decode_attention(*c.args(), out=out)
    assert got is out
    assert_close(out, paged_decode_attention_ref(*c.args()), BF16)
    out2 = torch.full_like(c.q, float("nan"))
    paged_decode_attention(*c.args(), out=out2, num_splits=2)
    assert_close(out2, out, BF16)


def test_strided_q_from_fused_qkv() -> None:
    c = make_case([9, 17], 4, 2, 64, 16, BF16, seed=6)
    qkv = torch.randn(2, 4 + 2 * 2, 64, device=DEV).to(BF16)
    qkv[:, :4] = c.q
    c.q = qkv[:, :4]  # stride(0) = 8 * 64, not 4 * 64
    assert not c.q.is_contiguous()
    check(c)


def test_empty_batch() -> None:
    c = make_case([4], 4, 2, 64, 16, BF16, seed=7)
    got = paged_decode_attention(c.q[:0], c.k_cache, c.v_cache, c.block_tables[:0], c.context_lens[:0], 0.125)
    assert got.shape == (0, 4, 64)


def test_pick_num_splits() -> None:
    cfg = {"min_split_tokens": 256, "max_splits": 32, "programs_per_sm": 2}
    assert pick_num_splits(64, 8, 4096, 132, cfg) == 1  # S * Hkv fills the GPU
    assert pick_num_splits(1, 2, 100, 132, cfg) == 1  # too short to split
    assert pick_num_splits(1, 2, 4096, 132, cfg) == 16  # capped by min_split_tokens
    assert pick_num_splits(4, 16, 2048, 132, cfg) == 5  # ~2 * SMs programs
    assert pick_num_splits(1, 1, 1 << 20, 132, cfg) == 32  # max_splits
    assert pick_num_splits(1, 16, 2048, 132, {**cfg, "min_split_tokens": 64, "programs_per_sm": 4}) == 32


def test_pick_config_buckets_by_batch() -> None:
    table = {"default": {"BLOCK_N": 64, "num_warps": 4, "DOT": 1},
             "by_shape": {"16x16x128": [{"min_seqs": 1, "config": {"DOT": 0}},
                                        {"min_seqs": 4, "config": {"DOT": 0, "BLOCK_N": 32}}]}}
    assert pa.pick_config(1, 16, 16, 128, table) == {"BLOCK_N": 64, "num_warps": 4, "DOT": 0}
    assert pa.pick_config(3, 16, 16, 128, table)["BLOCK_N"] == 64
    assert pa.pick_config(9, 16, 16, 128, table) == {"BLOCK_N": 32, "num_warps": 4, "DOT": 0}
    assert pa.pick_config(9, 32, 8, 128, table) == table["default"]  # untuned shape
    assert set(pa.pick_config(1, 4, 2, 64)) >= {"BLOCK_N", "num_warps", "DOT", "min_split_tokens", "max_splits",
                                                "programs_per_sm"}


BAD = [
    ("q_dtype", "float16 or bfloat16"), ("kv_dtype", "must equal q's dtype"), ("heads", "multiple of kv heads"),
    ("bt_dtype", "block_tables must be int32"), ("ctx_dtype", "context_lens must be int32"),
    ("out", "out must be"), ("block_size", "power of two"), ("head_dim", "head dim"),
    ("cache_layout", "contiguous"), ("offset", "k_offset"), ("rows", "block_tables must be"),
]


@pytest.mark.parametrize(("bad", "msg"), BAD)
def test_launcher_validates(bad: str, msg: str) -> None:
    c = make_case([5, 9], 4, 2, 64, 16, BF16, seed=8)
    q, k, v, bt, ctx, scale, ko, vo = c.args()
    out = None
    if bad == "q_dtype":
        q = q.float()
    elif bad == "kv_dtype":
        v = v.half()
    elif bad == "heads":
        q = q[:, :3]
    elif bad == "bt_dtype":
        bt = bt.long()
    elif bad == "ctx_dtype":
        ctx = ctx.long()
    elif bad == "out":
        out = torch.empty(2, 4, 32, dtype=BF16, device=DEV)
    elif bad == "block_size":
        k = v = torch.zeros(4, 12, 2, 64, dtype=BF16, device=DEV)
    elif bad == "head_dim":
        q, k, v = q[..., :48], k[..., :48].contiguous(), v[..., :48].contiguous()
    elif bad == "cache_layout":
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
        v = v.transpose(1, 2).contiguous().transpose(1, 2)
    elif bad == "offset":
        ko = k.shape[0]
    elif bad == "rows":
        bt = bt[:1]
    with pytest.raises(ValueError, match=msg):
        paged_decode_attention(q, k, v, bt, ctx, scale, ko, vo, out)


def test_reference_rejects_bad_lengths() -> None:
    c = make_case([5, 9], 4, 2, 64, 16, BF16, seed=9)
    c.context_lens[1] = 2 * 16 + 1  # more than max_blocks * block_size
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention_ref(*c.args())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("hq", "hkv", "dtype", "num_layers"), [(16, 16, BF16, 0), (32, 8, FP16, 0), (4, 2, BF16, 2)])
@pytest.mark.parametrize("num_splits", [None, 1, 8])
@pytest.mark.parametrize("dot", [None, 0, 1])
def test_cuda_serving_shapes(hq: int, hkv: int, dtype: torch.dtype, num_layers: int, num_splits: int | None,
                             dot: int | None) -> None:
    c = make_case([2048, 1, 1000, 2047], hq, hkv, 128 if hq > 4 else 64, 16, dtype, seed=hq + hkv,
                  num_layers=num_layers, layer=1 if num_layers else 0, device="cuda")
    cfg = None if dot is None else {**pa.pick_config(4, hq, hkv, c.q.shape[-1]), "DOT": dot}
    got = check(c, num_splits, cfg)
    torch.cuda.synchronize()
    assert got.is_cuda


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sliding_window_reads_only_the_window(num_splits: int) -> None:
    """A sliding-window layer attends over the last ``window`` positions; the blocks wholly before the window are
    NaN-poisoned (their pages may belong to something else by then), so reading them shows."""
    window, bs = 11, 8
    c = make_case([5, 11, 12, 40, 67], 4, 2, 64, bs, BF16, seed=23)
    for s, ctx in enumerate(c.context_lens.tolist()):
        for j in range(max(ctx - window, 0) // bs):
            unit = int(c.block_tables[s, j])
            c.k_cache[unit], c.v_cache[unit] = float("nan"), float("nan")
    got = paged_decode_attention(*c.args(), num_splits=num_splits, window=window)
    ref = paged_decode_attention_ref(*c.args(), window=window)
    assert_close(got, ref, BF16)
    for s, (kd, vd) in enumerate(zip(c.dense_k, c.dense_v, strict=True)):
        kd, vd = kd[-window:], vd[-window:]
        want = F.scaled_dot_product_attention(c.q[s, :, None].float(), kd.transpose(0, 1).float(),
                                              vd.transpose(0, 1).float(), scale=c.scale, enable_gqa=True)[:, 0]
        assert_close(got[s], want, BF16)
