"""Control-plane tests of the pooled KV block allocator and block tables (no torch)."""

from __future__ import annotations

import random

import pytest

from pwrun.core.kv_blocks import BlockTables, OutOfBlocks, PooledBlockAllocator, blocks_needed
from pwrun.core.pool import KV, PagePool, PoolConfig


def BlockAllocator(num_blocks: int) -> PooledBlockAllocator:
    """``num_blocks`` KV blocks of a one-layer model (2 pages each) over a pool that holds exactly them."""
    return PooledBlockAllocator(PagePool(PoolConfig(2 * num_blocks, 64)), layout=1)


def test_blocks_needed() -> None:
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_release_refcount() -> None:
    a = BlockAllocator(5)
    got = a.allocate(3)
    assert len(set(got)) == 3 and a.num_free == 2
    with pytest.raises(OutOfBlocks):
        a.allocate(3)
    assert a.num_free == 2  # a failed allocation takes nothing
    a.share(got[0])
    a.release(got[0])
    assert a.num_free == 2 and a.refcount(got[0]) == 1
    a.release(got[0])
    assert a.num_free == 3
    with pytest.raises(ValueError):
        a.release(got[0])


def test_slots_follow_block_table() -> None:
    t = BlockTables(BlockAllocator(8), block_size=4)
    t.reserve(7, 3)
    t.reserve(9, 6)
    t.reserve(7, 10)  # grows from 1 to 3 blocks
    table = t.table(7)
    assert len(table) == 3
    slots = t.slots(7, 0, 10)
    assert slots == [table[p // 4] * 4 + p % 4 for p in range(10)]
    with pytest.raises(ValueError):
        t.slots(7, 10, 13)  # not reserved


def test_random_workload_conserves_blocks() -> None:
    rng = random.Random(0)
    alloc = BlockAllocator(40)
    t = BlockTables(alloc, block_size=3)
    lengths: dict[int, int] = {}
    for step in range(500):
        sid = rng.randrange(10)
        if sid in lengths and rng.random() < 0.2:
            t.free(sid)
            del lengths[sid]
        else:
            new = lengths.get(sid, 0) + rng.randrange(1, 7)
            try:
                t.reserve(sid, new)
                lengths[sid] = new
            except OutOfBlocks:
                pass
        used = [b for s in lengths for b in t.table(s)]
        assert len(used) == len(set(used)), f"block shared by two sequences at step {step}"
        assert len(used) + alloc.num_free == 40
        assert alloc.pool.count(KV) == 2 * len(used)  # every block in use holds its two pages, no more
        for s, n in lengths.items():
            assert len(t.table(s)) == blocks_needed(n, 3)
