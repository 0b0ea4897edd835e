"""Page pool and weight page table (control plane): conservation and the q <= resident invariant."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pwrun.pool.pages import KV, WEIGHT, OutOfPages, PagePool, PoolConfig
from pwrun.pool.weight_table import CPU, GPU, WeightPageTable


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


def test_pages_for_rounds_up() -> None:
    cfg = PoolConfig(10, 1000)
    assert [cfg.pages_for(b) for b in (1, 1000, 1001, 0)] == [1, 1, 2, 0]


def test_weight_table_invariant_lower_then_raise() -> None:
    t = WeightPageTable(bits=[3, 4, 5, 6, 7, 8], plane_pages=[2, 2, 3], q0=np.array([8, 8, 4]))
    for i in range(3):
        for p in range(int(t.q[i])):
            t.set_resident(i, p, [10 * i + p])
    t.check()
    t.commit_lower(np.array([0]), np.array([5]))
    assert t.surplus_planes(0) == [5, 6, 7]
    for p in t.surplus_planes(0):
        t.state[0, p] = CPU  # moved to the host after the commit
    t.check()
    with pytest.raises(ValueError, match="before its planes are resident"):
        t.commit_raise(np.array([0]), np.array([7]))
    t.state[0, 5] = GPU
    t.state[0, 6] = GPU
    t.commit_raise(np.array([0]), np.array([7]))
    t.check()
    t.state[0, 6] = CPU  # a plane leaving while still committed breaks the invariant
    with pytest.raises(AssertionError):
        t.check()
