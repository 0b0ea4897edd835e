"""``pwkernels.moe.pair_sort``: (token, slot) pairs sorted by expert in one launch vs ``torch.sort`` + ``searchsorted``
(Triton's interpreter on CPU, native on GPU)."""

from __future__ import annotations

import pytest
import torch

from pwkernels.moe import pair_sort
from pwkernels.moe.pair_sort import group_pairs, group_pairs_ref, sort_pairs, sort_pairs_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("p", "experts"), [(1, 4), (5, 3), (63, 60), (64, 8), (65, 2), (200, 7), (300, 1)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_matches_a_stable_sort(p: int, experts: int, dtype: torch.dtype) -> None:
    """Random ids with many ties (a stable sort keeps pair order within an expert), sizes around the 64-pair
    tiles; every output compared exactly with the reference."""
    g = torch.Generator().manual_seed(p * 10 + experts)
    ids = torch.randint(0, experts, (p,), generator=g).to(dtype).to(DEV)
    got, ref = sort_pairs(ids), sort_pairs_ref(ids)
    assert got[0].dtype == dtype and got[1].dtype == got[2].dtype == torch.int32
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    sorted_ids, order, seg = (t.cpu().long() for t in got)
    assert torch.equal(ids.cpu().long()[order], sorted_ids)  # order maps sorted positions back to pairs
    assert all(sorted_ids[seg[k]] == sorted_ids[k] and (seg[k] == 0 or sorted_ids[seg[k] - 1] < sorted_ids[k])
               for k in range(p))  # seg: the first position of each run


def test_strided_empty_and_bad_ids() -> None:
    ids = torch.randint(0, 5, (6, 4), generator=torch.Generator().manual_seed(1)).to(DEV)
    col = ids[:, 1]  # a strided view
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(sort_pairs(col), sort_pairs_ref(col), strict=True))
    assert all(t.numel() == 0 for t in sort_pairs(torch.empty(0, dtype=torch.int64, device=DEV)))
    for bad in (ids, torch.rand(4, device=DEV), torch.ones(4, dtype=torch.bool, device=DEV)):
        with pytest.raises(ValueError, match="1-D integer"):
            sort_pairs(bad)


@pytest.mark.parametrize(("p", "experts"), [(1, 4), (63, 60), (200, 7), (300, 1), (130, 200)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_group_pairs_is_a_stable_grouping_with_ends_and_inverse(p: int, experts: int, dtype: torch.dtype) -> None:
    """``group_pairs`` (kernel + searchsorted) equals its reference exactly and means what it says: order is the
    stable sort by expert, ends[e] the number of pairs of experts <= e (empty experts included), inv its inverse."""
    g = torch.Generator().manual_seed(p + experts)
    ids = torch.randint(0, min(experts, 9), (p,), generator=g).to(dtype).to(DEV)  # experts past 9 stay empty
    got, ref = group_pairs(ids, experts), group_pairs_ref(ids, experts)
    assert all(t.dtype == torch.int32 for t in got)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, ref, strict=True))
    order, ends, inv = (t.cpu().long() for t in got)
    flat = ids.cpu().long()
    assert torch.equal(order, torch.sort(flat, stable=True)[1])
    assert ends.tolist() == [int((flat <= e).sum()) for e in range(experts)]
    assert torch.equal(order[inv], torch.arange(p))


def test_group_pairs_above_the_kernel_limit_takes_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = torch.randint(0, 5, (40,), generator=torch.Generator().manual_seed(3)).to(DEV)
    want = group_pairs(ids, 5)
    monkeypatch.setattr(pair_sort, "MAX_PAIRS", 16)
    monkeypatch.setattr(pair_sort, "_launch", None)  # the kernel path would fail: it must not run
    assert all(torch.equal(a, b) for a, b in zip(group_pairs(ids, 5), want, strict=True))
    with pytest.raises(ValueError, match="1-D integer"):
        group_pairs(ids.view(8, 5), 5)
