"""Scheduler (continuous batching, chunked prefill, preemption) and runtime planner, control plane only."""

from __future__ import annotations

import random

import numpy as np

from pwrun.core.kv_blocks import BlockTables, PooledBlockAllocator
from pwrun.core.planner.buckets import BucketPolicy
from pwrun.core.planner.online import OnlineStats, ResidualHeads
from pwrun.core.planner.runtime import Planner, PlannerConfig
from pwrun.core.planner.tables import BlockTable
from pwrun.core.pool import PagePool, PoolConfig
from pwrun.core.scheduler import RequestState, Scheduler


class FakeKV:
    """Block tables over a fixed allocator; ``make_room`` can only wait for free blocks (no weights)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.tables = BlockTables(PooledBlockAllocator(PagePool(PoolConfig(2 * num_blocks, 64)), 1), block_size)

    def blocks_needed(self, rid: int, num_tokens: int) -> int:
        return self.tables.extra_blocks(rid, num_tokens)

    def admission_blocks(self, rid: int, num_tokens: int) -> int:
        return self.tables.extra_blocks(rid, num_tokens)

    def make_room(self, blocks: int) -> bool:
        return self.tables.allocator.num_free >= blocks

    def reserve(self, rid: int, num_tokens: int) -> None:
        self.tables.reserve(rid, num_tokens)

    def free(self, rid: int) -> None:
        self.tables.free(rid)


def _drive(sched: Scheduler, kv: FakeKV, seqs: list[RequestState], rng: random.Random) -> int:
    """Run to completion with random 'sampled' tokens; returns the tokens computed (all chunks). Checks invariants
    each step."""
    steps = computed = 0
    while not sched.idle:
        plan = sched.schedule(kv)
        assert plan.chunks, "no progress"
        assert sum(len(c.token_ids) for c in plan.chunks) <= sched.max_step_tokens + len(sched.running)
        for c in plan.chunks:
            s = seqs[c.rid]
            assert c.start == s.computed and list(c.token_ids) == s.tokens[c.start:c.start + len(c.token_ids)]
            s.computed += len(c.token_ids)
            computed += len(c.token_ids)
            assert kv.tables.extra_blocks(c.rid, s.computed) == 0  # the chunk's blocks were reserved
            if c.last:
                s.out.append(rng.randrange(1000))
                if len(s.out) >= s.max_new_tokens:
                    s.finish = "length"
                    sched.finish(s, kv)
        steps += 1
        assert steps < 10_000
    return computed


def test_every_request_completes_under_tight_kv_with_preemption() -> None:
    rng = random.Random(0)
    seqs = [RequestState(i, [rng.randrange(1000) for _ in range(rng.randint(1, 70))], rng.randint(1, 40))
            for i in range(25)]
    kv = FakeKV(num_blocks=14, block_size=8)  # the longest request needs 14 blocks: forces preemption
    sched = Scheduler(max_batch=6, max_step_tokens=48)
    for s in seqs:
        sched.add(s)
    computed = _drive(sched, kv, seqs, rng)
    assert all(s.finish == "length" and len(s.out) == s.max_new_tokens for s in seqs)
    assert sched.preemptions > 0
    # every prompt and fed token once (the last sampled token is never fed), plus what preemption discarded
    assert sched.recomputed_tokens > 0
    assert computed == sum(len(s.prompt) + len(s.out) - 1 for s in seqs) + sched.recomputed_tokens
    assert kv.tables.allocator.num_free == 14  # everything released


def test_no_preemption_with_room_and_chunked_prefill() -> None:
    rng = random.Random(1)
    seqs = [RequestState(i, list(range(100)), 5) for i in range(3)]
    kv = FakeKV(num_blocks=1000, block_size=16)
    sched = Scheduler(max_batch=8, max_step_tokens=64)
    for s in seqs:
        sched.add(s)
    first = sched.schedule(kv)
    assert [len(c.token_ids) for c in first.chunks] == [64] and not first.chunks[0].last
    computed = _drive(sched, kv, seqs, rng)
    assert sched.preemptions == 0 and sched.recomputed_tokens == 0
    assert computed == sum(len(s.prompt) + len(s.out) - 1 for s in seqs)


def test_admission_waits_for_room_for_the_whole_prompt() -> None:
    """Room for one long prompt at a time and chunked prefill: admitting a request for its first chunk only made it
    the victim of the first request's next chunks (prefilled, preempted, re-admitted: its prompt computed again);
    now it waits until its whole prompt fits, so no prompt token is computed twice."""
    rng = random.Random(2)
    seqs = [RequestState(i, [rng.randrange(1000) for _ in range(100)], 2) for i in range(4)]  # 13 blocks each
    kv = FakeKV(num_blocks=16, block_size=8)
    sched = Scheduler(max_batch=4, max_step_tokens=16)
    for s in seqs:
        sched.add(s)
    computed = 0
    while not sched.idle:
        plan = sched.schedule(kv)
        assert plan.chunks
        for c in plan.chunks:
            q = seqs[c.rid]
            q.computed += len(c.token_ids)
            computed += len(c.token_ids)
            if c.last:
                q.out.append(0)
                if len(q.out) >= q.max_new_tokens:
                    q.finish = "length"
                    sched.finish(q, kv)
    assert all(len(q.out) == 2 for q in seqs)
    assert sched.preemptions == 0 and computed == 4 * (100 + 1)  # every token computed once


def _table(n: int = 40, seed: int = 0) -> BlockTable:
    rng = np.random.default_rng(seed)
    bits = np.arange(3, 9)
    sens = np.sort(rng.gamma(1.0, 1.0, (n, bits.size)) * rng.uniform(0.1, 10, (n, 1)), axis=1)[:, ::-1].copy()
    m = rng.integers(100, 200, (n, 1))
    return BlockTable(bits=bits, layer=np.repeat(np.arange(n // 10), 10), expert=np.tile(np.arange(10), n // 10),
                      unit=np.zeros(n, np.int64), sens=sens, bytes=(bits[None, :] * m + 16 * 2 ** bits[None, :]),
                      tokens=np.full(n, 100), mass=rng.dirichlet(np.ones(n)))


def test_planner_meets_pressure_within_floors_and_prefers_cheap_damage() -> None:
    table = _table()
    pol = BucketPolicy((0.5,), (1.0, 1.0), ((5, 6), (3, 4)), (2, 2))
    planner = Planner(table, pol, PlannerConfig())
    q = np.full(table.n, table.bits[-1])
    need = 0.1 * table.total_bytes(q)
    plan = planner.plan_lower(q, need)
    assert plan.freed >= need and plan.stage == 0
    q2 = q.copy()
    q2[plan.blocks] = plan.to_bits
    assert table.total_bytes(q) - table.total_bytes(q2) == plan.freed
    bucket = pol.assign(table)
    assert (q2 >= np.asarray(pol.floors[0])[bucket]).all()
    # a larger need escalates to the aggressive floors, never below them
    big = planner.plan_lower(q, 10 * table.total_bytes(q))
    q3 = q.copy()
    q3[big.blocks] = big.to_bits
    assert big.stage == 1 and (q3 == np.asarray(pol.floors[1])[bucket]).all()
    # frozen blocks do not move; prepared plans are reused only while valid
    movable = np.ones(table.n, bool)
    movable[plan.blocks[:3]] = False
    p2 = planner.plan_lower(q, need, movable)
    assert not np.isin(plan.blocks[:3], p2.blocks).any()
    planner.prepare(q, need)
    assert planner.take(q, need) is not None


def test_prepared_plan_survives_changes_outside_it() -> None:
    """A queued demotion plan is taken while its own blocks keep their bitwidths (a reload that completed elsewhere
    in between leaves it valid: no fresh plan on the step's critical path); it is made again when one of its
    blocks changed or may not move, or when it frees too little."""
    table = _table()
    planner = Planner(table, BucketPolicy.neutral(3), PlannerConfig())
    q = np.full(table.n, table.bits[-1])
    need = 0.05 * table.total_bytes(q)
    outside = np.setdiff1d(np.arange(table.n), planner.plan_lower(q, need).blocks)[0]
    cases = []  # (bitwidths at take time, movable, need, expected kind)
    q_out = q.copy()
    q_out[outside] -= 1  # a block outside the plan changed
    cases.append((q_out, None, need, "prepared"))
    cases.append((q, None, 2 * need, "fresh"))  # frees too little
    for i, (qt, mov, nd, kind) in enumerate(cases):
        planner.prepare(q, need)
        prepared = planner.prepared
        assert prepared is not None and planner.is_prepared(qt, nd, mov) == (kind == "prepared")
        before = dict(planner.takes)
        got = planner.take(qt, nd, mov)
        assert (got is prepared) == (kind == "prepared"), i
        assert planner.takes[kind] == before[kind] + 1 and planner.prepared is None
    planner.prepare(q, need)
    p = planner.prepared
    assert p is not None and p.blocks.size
    q_in = q.copy()
    q_in[p.blocks[0]] -= 1  # a block of the plan changed: its bytes and target are stale
    assert not planner.is_prepared(q_in, need) and planner.take(q_in, need) is not p
    planner.prepare(q, need)
    p = planner.prepared
    frozen = np.ones(table.n, bool)
    frozen[p.blocks[-1]] = False  # a block of the plan is being moved
    assert planner.take(q, need, frozen) is not p
    assert planner.pressure(free_blocks=5, kv_block_bytes=100) == 0
    assert planner.pressure(free_blocks=1, kv_block_bytes=100) == 200  # (T_blk + 1 - F) * B_KV, T_blk = 2


def test_raise_spends_allowance_by_benefit_and_not_without_movement() -> None:
    table = _table()
    planner = Planner(table, BucketPolicy.neutral(3), PlannerConfig())
    q = np.full(table.n, 3)
    allowance = 0.2 * (table.total_bytes(np.full(table.n, 8)) - table.total_bytes(q))
    plan = planner.plan_raise(q, allowance)
    assert 0 < -plan.freed <= allowance
    off = Planner(table, BucketPolicy.neutral(3), PlannerConfig(movement=False))
    assert off.plan_raise(q, allowance).empty


def test_online_stats_and_residual_heads() -> None:
    layer, expert = np.array([0, 0, 0, 1]), np.array([-1, 0, 1, 1])
    st = OnlineStats(layer, expert, 2, 2, decay=0.5, calib_features=np.ones((4, 3)))
    mass = np.array([[3.0, 1.0, 4.0], [0.0, 2.0, 4.0]])
    acc = np.zeros((2, 3, 4))
    acc[0, 0] = [1.0, 2.0, 4.0, 2.0]  # expert 0 of layer 0: mean 2, rms 2, max 2
    st.update(mass, acc)
    np.testing.assert_allclose(st.block_mass(), [1.0, 0.75, 0.25, 1.0])
    phi = st.block_log_features()
    np.testing.assert_allclose(phi[1], np.log([2.0, 2.0, 2.0]))
    assert (phi[[0, 2, 3]] == 0).all()  # no live tokens: no evidence
    import pandas as pd

    heads = ResidualHeads(pd.DataFrame([{"unit": "gate_up", "bits_from": 4, "bits_to": 3, "w_mean_norm": 1.0,
                                         "w_rms_norm": 0.0, "w_max_norm": 0.0, "intercept": 0.0, "confidence": 0.5,
                                         "rho_min": -1.0, "rho_max": 0.5}]))
    eta = heads.eta(np.arange(3, 9), np.zeros(4, np.int64), phi, alpha=1.0)
    np.testing.assert_allclose(eta[1, 1, 0], np.exp(0.5 * min(np.log(2.0), 0.5)))  # Eq. 6 with the clip
    assert eta[0, 1, 0] == 1.0 and eta[1, 2, 0] == 1.0
