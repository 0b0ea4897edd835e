"""``pwkernels.moe.align``: pairs sorted by expert and padded to whole tiles in one launch vs the ``torch.sort``
reference (Triton's interpreter on CPU, native on GPU)."""

from __future__ import annotations

import pytest
import torch

from pwkernels.moe.align import _align_kernel, align_by_expert, align_by_expert_ref, num_tiles

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _check_layout(sorted_pairs: torch.Tensor, tile_expert: torch.Tensor, ids: torch.Tensor, block_m: int,
                  experts: int) -> None:
    """The layout's contract, independent of either implementation: every pair once, in its expert's tiles, in
    pair order; padding (P) elsewhere; spare tiles at the end with expert E."""
    flat = ids.flatten().long().cpu()
    p = flat.numel()
    sp, te = sorted_pairs.long().cpu().view(-1, block_m), tile_expert.long().cpu()
    assert te.numel() == num_tiles(p, experts, block_m) == sp.shape[0]
    seen: list[int] = []
    for tile, e in enumerate(te.tolist()):
        real = [v for v in sp[tile].tolist() if v != p]
        assert all(flat[v] == e for v in real) and (e < experts or not real)
        seen += real
        assert sp[tile].tolist() == real + [p] * (block_m - len(real))  # pairs first, then padding
    assert sorted(seen) == list(range(p))
    assert seen == sorted(seen, key=lambda v: (flat[v].item(), v))  # stable order by expert
    assert te.tolist() == sorted(te.tolist())


@pytest.mark.parametrize(("t", "k", "experts", "block_m"),
                         [(1, 1, 1, 16), (1, 4, 60, 16), (5, 2, 3, 16), (16, 4, 60, 32), (33, 8, 128, 16),
                          (64, 2, 8, 64), (40, 4, 7, 16), (3, 6, 64, 32)])
def test_matches_the_reference(t: int, k: int, experts: int, block_m: int) -> None:
    """Random routings (many experts without pairs, ragged counts across tile edges), int32 and int64 ids: exactly
    the reference's tensors, and the layout's contract."""
    g = torch.Generator().manual_seed(t * 100 + k * 10 + experts)
    for dtype in (torch.int32, torch.int64):
        ids = torch.randint(0, experts, (t, k), generator=g).to(dtype).to(DEV)
        got, ref = align_by_expert(ids, experts, block_m), align_by_expert_ref(ids, experts, block_m)
        assert got[0].dtype == got[1].dtype == torch.int32
        for a, b in zip(got, ref, strict=True):
            assert torch.equal(a.cpu(), b.cpu())
        _check_layout(*got, ids, block_m, experts)


def test_one_hot_expert_and_skewed_routing() -> None:
    """Every pair on one expert (several full tiles) and a routing where one expert takes most pairs."""
    ids = torch.full((20, 4), 5, dtype=torch.int64, device=DEV)
    for block_m in (16, 32):
        got = align_by_expert(ids, 8, block_m)
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, align_by_expert_ref(ids, 8, block_m),
                                                                   strict=True))
        _check_layout(*got, ids, block_m, 8)
    skew = torch.where(torch.rand(50, 2, generator=torch.Generator().manual_seed(3)) < 0.8, 0, 9).to(DEV)
    _check_layout(*align_by_expert(skew, 10, 16), skew, 16, 10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels are cached on CUDA only")
def test_one_compile_serves_every_count() -> None:
    """Pair and tile counts of every Triton int class (1, multiples of 16, others) launch one compiled kernel:
    a step's token count never compiles inside a run."""
    before = sum(len(c[0]) for c in _align_kernel.device_caches.values())
    for t, k in ((1, 1), (1, 4), (4, 4), (40, 4), (401, 4), (402, 4), (1024, 4)):  # P 1, 4, 16, ..; tiles 1, 4, 17, ..
        ids = torch.randint(0, 60, (t, k), device="cuda", dtype=torch.int32)
        _check_layout(*align_by_expert(ids, 60, 16), ids, 16, 60)
    assert sum(len(c[0]) for c in _align_kernel.device_caches.values()) - before <= 1
