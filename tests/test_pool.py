"""Page pool and weight page table (control plane): conservation and the q <= resident invariant."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pwrun.core.pool import KV, WEIGHT, OutOfPages, PagePool, PoolConfig
from pwrun.core.weight_table import CPU, GPU, WeightPageTable


def test_pages_move_between_weights_and_kv_and_are_conserved() -> None:
    pool = PagePool(PoolConfig(num_pages=50, page_bytes=4096))
    rng = random.Random(0)
    owned: dict[int, list[list[int]]] = {KV: [], WEIGHT: []}
    for _ in range(400):
        kind = rng.choice([KV, WEIGHT])
        if owned[kind] and rng.random() < 0.45:
            pool.release(owned[kind].pop(rng.randrange(len(owned[kind]))), kind)
        else:
            try:
                owned[kind].append(pool.allocate(rng.randint(1, 6), kind))
            except OutOfPages:
                assert pool.num_free < 6
        pool.check()
        assert pool.count(KV) == sum(map(len, owned[KV])) and pool.count(WEIGHT) == sum(map(len, owned[WEIGHT]))
    weight_page = owned[WEIGHT][0][0] if owned[WEIGHT] else pool.allocate(1, WEIGHT)[0]
    with pytest.raises(ValueError, match="not owned"):
        pool.release([weight_page], KV)  # a weight page handed back as KV: refused


def test_release_run_matches_release_of_the_same_pages() -> None:
    """release_run (slices) leaves the pool exactly as release of the run's pages would (kinds, counts, the KV
    allocation mark, later allocations), and refuses what release refuses: a page of another kind, a double free,
    pages outside the pool (release's arange would wrap a negative start)."""
    rng = random.Random(5)
    a, b = (PagePool(PoolConfig(num_pages=400, page_bytes=8)) for _ in range(2))
    runs: list[tuple[int, int]] = []
    for _ in range(300):
        if runs and rng.random() < 0.45:
            s, n = runs.pop(rng.randrange(len(runs)))
            a.release(np.arange(s, s + n), WEIGHT)
            b.release_run(s, n, WEIGHT)
        else:
            try:
                n = rng.randint(1, 9)
                s = a.allocate_run(n, WEIGHT)
                assert b.allocate_run(n, WEIGHT) == s
                runs.append((s, n))
                if rng.random() < 0.2:
                    assert a.allocate_top(3, KV) == b.allocate_top(3, KV)
            except OutOfPages:
                pass
        assert (a._kind == b._kind).all() and a._top == b._top and a.num_free == b.num_free
        b.check()
    s, n = runs[0]
    b.release_run(s, 0, WEIGHT)  # an empty run: nothing changes
    assert (a._kind == b._kind).all()
    with pytest.raises(ValueError, match="not owned"):
        b.release_run(s, n, KV)
    b.release_run(s, n, WEIGHT)
    with pytest.raises(ValueError, match="not owned"):
        b.release_run(s, n, WEIGHT)  # a double free
    s2, n2 = runs[1]
    for start, count in ((-2, 3), (398, 5), (2**63 - 1, 1), (5, -1)):
        with pytest.raises(ValueError, match="not in the pool"):
            b.release_run(start, count, WEIGHT)
        with pytest.raises(ValueError, match="outside the pool"):
            b.release_runs(np.array([s2, start]), np.array([n2, count]), WEIGHT)  # refused whole: s2 stays taken
        assert b._kind[s2] == WEIGHT
    with pytest.raises(ValueError, match="not in the pool"):
        b.release([-1], WEIGHT)
    b.check()


def test_pages_for_rounds_up() -> None:
    cfg = PoolConfig(10, 1000)
    assert [cfg.pages_for(b) for b in (1, 1000, 1001, 0)] == [1, 1, 2, 0]


def _table(pool: PagePool) -> WeightPageTable:
    lut = np.zeros((3, 9), dtype=np.int64)
    for b in range(3, 9):
        lut[:, b] = [2 ** (b - 3), 2 ** (b - 3), 1]
    return WeightPageTable(bits=[3, 4, 5, 6, 7, 8], plane_pages=np.array([2, 1, 3]), lut_pages=lut)


def test_weight_table_lower_raise_keeps_invariant_and_conserves_pages() -> None:
    pool = PagePool(PoolConfig(num_pages=200, page_bytes=64))
    t = _table(pool)
    for i, b in enumerate([8, 8, 4]):
        t.place(pool, i, b)
    t.check()
    assert pool.count(WEIGHT) == t.weight_pages() == int(t.pages_at(t.q).sum())
    free0 = pool.num_free
    orders = t.lower(pool, 0, 5)
    assert [(o.what, o.index) for o in orders] == [("lut", 5)]  # the 5-bit LUT is written over the 8-bit one
    assert pool.num_free - free0 == int(t.pages_at(8)[0] - t.pages_at(5)[0])  # Delta of Eq. 3, in pages
    t.check()
    assert (t.state[0, 5:] == CPU).all() and (t.state[0, :5] == GPU).all()
    orders = t.begin_raise(pool, 0, 7)
    assert orders is not None and sorted(o.index for o in orders if o.what == "plane") == [5, 6]
    assert t.q[0] == 5 and t.pending[0] == 7  # not committed before the copies are confirmed
    t.check()
    with pytest.raises(ValueError, match="pending"):
        t.lower(pool, 0, 4)
    t.finish_raise(pool, 0)
    assert t.q[0] == 7 and t.pending[0] == 0
    t.check()
    pool.check()
    assert pool.count(WEIGHT) == t.weight_pages() == int(t.pages_at(t.q).sum())
    t.state[0, 6] = CPU  # a plane leaving while still committed breaks the invariant
    with pytest.raises(AssertionError):
        t.check()


def _state(pool: PagePool, t: WeightPageTable) -> list[np.ndarray]:
    return [pool._kind.copy(), np.array([pool._top, pool.num_free]), t.q.copy(), t.state.copy(),
            t.plane_start.copy(), t.lut_start.copy(), t.lut_bits.copy(), t.pending.copy()]


def test_lower_many_matches_lower_block_by_block() -> None:
    """WeightPageTable.lower_many (one vectorized release of every plane run and LUT tail) leaves the pool and the
    table exactly as lower called block by block, returns the same copy orders, and on bad input (a bitwidth that
    is not supported, not lower, a raise in flight, a block twice) raises before changing anything."""
    rng = np.random.default_rng(7)
    n = 40
    lut = np.zeros((n, 9), dtype=np.int64)
    base = rng.integers(1, 3, n)
    for b in range(3, 9):
        lut[:, b] = base * 2 ** max(b - 4, 0)  # a b-bit LUT takes no more pages than a wider one
    plane_pages = rng.integers(1, 4, n)
    pools, tables = [], []
    for _ in range(2):
        pools.append(PagePool(PoolConfig(num_pages=6000, page_bytes=64)))
        tables.append(WeightPageTable(bits=[3, 4, 5, 6, 7, 8], plane_pages=plane_pages,
                                      lut_pages=lut))
    start = rng.integers(3, 9, n)
    for pool, t in zip(pools, tables, strict=True):
        for i in range(n):
            t.place(pool, i, int(start[i]))
            if i % 7 == 0:
                pool.allocate_top(3, KV)  # KV pages between the weight runs
    (pa, ta), (pb, tb) = zip(pools, tables, strict=True)
    for _round in range(12):
        can = np.flatnonzero((ta.q > 3) & (ta.pending == 0))
        blocks = rng.permutation(can)[: rng.integers(0, can.size + 1)]
        to = np.array([rng.integers(3, ta.q[i]) for i in blocks], dtype=np.int64)
        orders_a = [o for i, b in zip(blocks.tolist(), to.tolist(), strict=True) for o in ta.lower(pa, i, b)]
        orders_b = tb.lower_many(pb, blocks, to)
        assert orders_a == orders_b
        assert all((x == y).all() for x, y in zip(_state(pa, ta), _state(pb, tb), strict=True))
        pb.check()
        tb.check()
        for i in rng.permutation(np.flatnonzero((ta.q < 8) & (ta.pending == 0)))[:5]:  # some raises in between
            b = int(ta.q[i]) + 1
            if ta.begin_raise(pa, int(i), b) is not None:
                assert tb.begin_raise(pb, int(i), b) is not None
                if rng.random() < 0.5:
                    ta.finish_raise(pa, int(i))
                    tb.finish_raise(pb, int(i))
    before = _state(pb, tb)
    ok = int(np.flatnonzero((tb.q > 3) & (tb.pending == 0))[0])
    busy = np.flatnonzero(tb.pending > 0)
    bad_inputs = [([ok], [2]), ([ok], [int(tb.q[ok])]), ([ok, ok], [3, 3]), ([ok, ok + 1], [3]), ([ok], [3.0]),
                  ([float(ok)], [3]), ([-1], [3]), ([n], [3])]
    if busy.size:
        bad_inputs.append(([ok, int(busy[0])], [3, 3]))
    for blocks, to in bad_inputs:
        with pytest.raises(ValueError):
            tb.lower_many(pb, np.array(blocks), np.array(to))
        assert all((x == y).all() for x, y in zip(before, _state(pb, tb), strict=True))


def test_raise_without_room_takes_nothing() -> None:
    pool = PagePool(PoolConfig(num_pages=60, page_bytes=64))
    t = _table(pool)
    t.place(pool, 0, 8)
    t.lower(pool, 0, 3)
    pool.allocate(pool.num_free - 1, KV)  # fill the pool but one page
    before = pool.num_free
    assert t.begin_raise(pool, 0, 8) is None
    assert pool.num_free == before and t.pending[0] == 0 and t.q[0] == 3


def test_runs_and_top_allocation() -> None:
    pool = PagePool(PoolConfig(num_pages=16, page_bytes=8))
    top = pool.allocate_top(3, KV)
    assert top == [15, 14, 13]
    start = pool.allocate_run(4, WEIGHT)
    assert start == 0
    pool.release([1], WEIGHT)  # a hole of one page inside the run
    assert pool.find_run(2) == 4
    assert pool.find_run(9) == 4 and pool.find_run(10) == -1
    with pytest.raises(OutOfPages):
        pool.allocate_run(10, WEIGHT)
    pool.check()


def test_find_run_is_first_fit_like_a_full_scan() -> None:
    rng = random.Random(3)
    pool = PagePool(PoolConfig(num_pages=3000, page_bytes=8))
    runs = []
    for _ in range(300):
        try:
            for _k in range(rng.randint(1, 4)):  # several runs in a row: the free-run table is updated in place
                n = rng.randint(1, 9)
                free = np.concatenate(([0], np.cumsum(pool._kind == 0)))
                ok = np.flatnonzero(free[n:] - free[:-n] == n)
                got = pool.allocate_run(n, WEIGHT)
                assert got == int(ok[0]), "allocate_run is not the first fit of a full scan"
                runs.append((got, n))
            if rng.random() < 0.1:
                pool.allocate_top(rng.randint(1, 5), KV)
        except OutOfPages:
            break
        if runs and rng.random() < 0.4:
            s, k = runs.pop(rng.randrange(len(runs)))
            pool.release_run(s, k, WEIGHT)
        want = rng.randint(1, 40)
        free = np.concatenate(([0], np.cumsum(pool._kind == 0)))
        ok = np.flatnonzero(free[want:] - free[:-want] == want)
        assert pool.find_run(want) == (int(ok[0]) if ok.size else -1)
    pool.check()


def test_allocate_top_takes_the_highest_free_pages_like_a_full_scan() -> None:
    """``allocate_top`` scans down from a mark instead of the whole pool: after any mix of KV, run and any-page
    allocations and releases (of either kind, anywhere) it must still take exactly the n highest free pages."""
    rng = random.Random(11)
    pool = PagePool(PoolConfig(num_pages=5000, page_bytes=8))
    kv: list[int] = []
    runs: list[tuple[int, int]] = []
    loose: list[int] = []
    for i in range(600):
        r = rng.random()
        try:
            if r < 0.45:
                n = rng.choice([0, 1, 3, 48, 200])
                want = np.flatnonzero(pool._kind == 0)[::-1][:n].tolist()
                got = pool.allocate_top(n, KV)
                assert got == want, f"step {i}: not the {n} highest free pages"
                kv += got
            elif r < 0.6:
                n = rng.randint(1, 60)
                runs.append((pool.allocate_run(n, WEIGHT), n))
            elif r < 0.65:
                loose += pool.allocate(rng.randint(1, 20), WEIGHT)
            elif r < 0.85 and kv:  # release KV pages from anywhere, high ones included
                rng.shuffle(kv)
                k = rng.randint(1, min(len(kv), 100))
                pool.release(kv[:k], KV)
                kv = kv[k:]
            elif runs:
                s, n = runs.pop(rng.randrange(len(runs)))
                pool.release_run(s, n, WEIGHT)
        except OutOfPages:
            if kv:
                pool.release(kv, KV)
                kv = []
        pool.check()
    with pytest.raises(OutOfPages):
        pool.allocate_top(pool.num_free + 1, KV)
    pool.check()
