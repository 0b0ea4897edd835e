"""Planner (control plane, numpy): greedy lowering/raising against brute force, floors, caps, budgets."""

from __future__ import annotations

import numpy as np
import pytest

from pwrun.core.planner.buckets import BucketPolicy
from pwrun.core.planner.greedy import fit_budget, lower_step, lower_until, predicted_damage, raise_step
from pwrun.core.planner.runtime import Planner, PlannerConfig
from pwrun.core.planner.tables import BlockTable


def random_table(n: int = 40, seed: int = 0) -> BlockTable:
    rng = np.random.default_rng(seed)
    bits = np.arange(3, 9)
    s = np.sort(rng.random((n, 6)) * rng.random((n, 1)) * 100, axis=1)[:, ::-1].copy()  # decreasing in b
    size = rng.integers(1, 5, n)[:, None]
    byts = (size * (bits * 1000 + 2 ** bits * 10)).astype(np.int64)
    return BlockTable(bits=bits, layer=np.arange(n) // 10, expert=np.arange(n) % 10 - (np.arange(n) % 10 == 9) * 10,
                      unit=np.arange(n) % 2, sens=s, bytes=byts, tokens=rng.integers(1, 100, n),
                      mass=rng.dirichlet(np.ones(n)))


def test_lower_step_matches_brute_force_greedy() -> None:
    t = random_table()
    pol = BucketPolicy.neutral(3)
    bucket = pol.assign(t)
    d_hat = predicted_damage(t, bucket, pol)
    q = np.random.default_rng(1).integers(1, 6, t.n)  # columns of t.bits
    need = 20000
    plan = lower_step(t, t.bits[q], need, d_hat, bucket, pol, 0)
    # brute force: per block the best single-bit drop (depth cap 1), blocks by ratio until need is met
    cands = sorted((d_hat[i, q[i], q[i] - 1] / (t.bytes[i, q[i]] - t.bytes[i, q[i] - 1]), i) for i in range(t.n))
    freed, chosen = 0, []
    for _, i in cands:
        if freed >= need:
            break
        chosen.append(i)
        freed += t.bytes[i, q[i]] - t.bytes[i, q[i] - 1]
    assert sorted(plan.blocks.tolist()) == sorted(chosen) and plan.freed == freed >= need
    assert (plan.to_bits == t.bits[q[plan.blocks] - 1]).all()


def _lower_step_reference(t: BlockTable, q: np.ndarray, need: float, d_hat: np.ndarray, bucket: np.ndarray,
                          pol: BucketPolicy, stage: int, movable: np.ndarray | None) -> tuple[list, list, int]:
    """lower_step by plain loops on columns ``q`` of ``t.bits``: per block the lowest-ratio target column within
    floor and cap (first on ties), blocks by ratio (block order on ties) until ``need`` is freed."""
    cands = []
    for i in range(t.n):
        if movable is not None and not movable[i]:
            continue
        floor = int(np.searchsorted(t.bits, max(pol.floors[stage][bucket[i]], t.bits[0])))
        best = None
        for c in range(q[i]):
            delta = int(t.bytes[i, q[i]] - t.bytes[i, c])
            if c < floor or c < q[i] - pol.depth_cap[bucket[i]] or delta <= 0:
                continue
            r = d_hat[i, q[i], c] / max(delta, 1)
            if best is None or r < best[0]:
                best = (r, c, delta)
        if best is not None:
            cands.append((best[0], i, best[1], best[2]))
    cands.sort(key=lambda x: (x[0], x[1]))
    blocks, to, freed = [], [], 0
    for _, i, c, delta in cands:
        if freed >= need or need <= 0:
            break
        blocks.append(i), to.append(c)
        freed += delta
    return blocks, to, freed


def test_lower_step_matches_loop_reference_on_random_states() -> None:
    """The vectorized lower_step (only blocks that can go lower enter its arrays) against plain loops: random
    bitwidths, floors of three stages, depth caps 1..5, blocks held by reloads, needs from 0 to more than all."""
    for seed in range(40):
        rng = np.random.default_rng(seed)
        t = random_table(n=int(rng.integers(3, 120)), seed=seed)
        pol = BucketPolicy((0.3, 0.7), (1.0, 2.0, 4.0), ((3, 4, 6), (3, 3, 5), (3, 3, 3)),
                           tuple(int(v) for v in rng.integers(1, 6, 3)))
        bucket = pol.assign(t)
        d_hat = predicted_damage(t, bucket, pol)
        for k in range(4):
            q = rng.integers(0, 6, t.n)
            movable = rng.random(t.n) < 0.7 if k % 2 else None
            need = float(rng.choice([0, rng.integers(1, 5000), rng.integers(5000, 10**6), 10**9]))
            for stage in range(3):
                plan = lower_step(t, t.bits[q], need, d_hat, bucket, pol, stage, movable)
                blocks, to, freed = _lower_step_reference(t, q, need, d_hat, bucket, pol, stage, movable)
                assert plan.blocks.tolist() == blocks and plan.to_bits.tolist() == t.bits[to].tolist()
                assert plan.freed == freed


def _lower_until_reference(t: BlockTable, q_bits: np.ndarray, need: float, d_hat: np.ndarray, bucket: np.ndarray,
                           pol: BucketPolicy, movable: np.ndarray | None, step_fraction: float | None
                           ) -> tuple[np.ndarray, int, float, int]:
    """lower_until as its definition: ``lower_step`` rounds from stage 0, a stage left when it frees nothing."""
    q, freed, damage, stage = q_bits.copy(), 0, 0.0, 0
    for stage in range(len(pol.floors)):
        while freed < need:
            ask = need - freed
            if step_fraction is not None:
                ask = min(ask, max(1.0, step_fraction * t.total_bytes(q)))
            plan = lower_step(t, q, ask, d_hat, bucket, pol, stage, movable)
            if plan.empty:
                break
            q[plan.blocks] = plan.to_bits
            freed, damage = freed + plan.freed, damage + plan.damage
        if freed >= need:
            break
    return q, freed, damage, stage


def test_lower_until_equals_rounds_of_lower_step() -> None:
    """lower_until (each block's best demotion kept between rounds, recomputed only for the blocks that moved)
    against one lower_step call per round: random states, three floor stages, caps 1..5, held blocks, small and
    whole-need rounds, needs up to more than all."""
    for seed in range(25):
        rng = np.random.default_rng(100 + seed)
        t = random_table(n=int(rng.integers(3, 90)), seed=seed)
        pol = BucketPolicy((0.3, 0.7), (1.0, 2.0, 4.0), ((3, 5, 7), (3, 4, 5), (3, 3, 3)),
                           tuple(int(v) for v in rng.integers(1, 6, 3)))
        bucket = pol.assign(t)
        d_hat = predicted_damage(t, bucket, pol)
        for k in range(4):
            q = t.bits[rng.integers(0, 6, t.n)]
            movable = rng.random(t.n) < 0.7 if k % 2 else None
            need = float(rng.choice([rng.integers(1, 5000), rng.integers(5000, 10**6), 10**9]))
            for frac in (None, 0.01):
                got = lower_until(t, q, need, d_hat, bucket, pol, movable, frac)
                want = _lower_until_reference(t, q, need, d_hat, bucket, pol, movable, frac)
                assert got[0].tolist() == want[0].tolist() and got[1] == want[1] and got[3] == want[3]
                assert got[2] == pytest.approx(want[2], rel=1e-12)


def test_floors_and_depth_caps_are_respected() -> None:
    t = random_table(seed=2)
    pol = BucketPolicy((0.5,), (1.0, 3.0), ((3, 6), (3, 5)), (2, 1))
    bucket = pol.assign(t)
    d_hat = predicted_damage(t, bucket, pol)
    q = np.full(t.n, 8)
    plan = lower_step(t, q, 10**12, d_hat, bucket, pol, 0)  # more than can be freed: take everything allowed
    floors = np.array([3, 6])[bucket[plan.blocks]]
    caps = np.array([2, 1])[bucket[plan.blocks]]  # t.bits are consecutive: a cap in columns is one in bits
    assert (plan.to_bits >= floors).all() and (q[plan.blocks] - plan.to_bits <= caps).all()
    assert (plan.to_bits[bucket[plan.blocks] == 1] >= 6).all()


def test_fit_budget_meets_budget_or_reports_infeasible() -> None:
    t = random_table(seed=3)
    pol = BucketPolicy((0.5,), (1.0, 4.0), ((3, 5), (3, 3)), (1, 1))
    for frac in (0.9, 0.6, 0.3):
        budget = int(t.bytes[:, 0].sum() + frac * (t.bytes[:, -1].sum() - t.bytes[:, 0].sum()))
        q = fit_budget(t, pol, budget)
        assert q is not None and t.total_bytes(q) <= budget
    assert fit_budget(t, pol, int(t.bytes[:, 0].sum()) - 1) is None
    q = fit_budget(t, pol, int(t.bytes[:, 0].sum()))
    assert q is not None and (q == 3).all()


def test_hot_multiplier_protects_hot_experts() -> None:
    t = random_table(n=200, seed=4)
    budget = int(t.bytes[:, 1].sum())
    neutral = fit_budget(t, BucketPolicy.neutral(3), budget)
    hot_pol = BucketPolicy((0.5,), (1.0, 50.0), ((3, 3),), (1, 1))
    hot = fit_budget(t, hot_pol, budget)
    assert neutral is not None and hot is not None
    is_hot = hot_pol.assign(t) == 1
    assert hot[is_hot].mean() > neutral[is_hot].mean()


def test_raise_step_uses_at_most_the_allowance() -> None:
    t = random_table(seed=5)
    pol = BucketPolicy.neutral(3)
    bucket = pol.assign(t)
    d_hat = predicted_damage(t, bucket, pol)
    q = np.full(t.n, 3)
    plan = raise_step(t, q, 15000, d_hat, bucket, pol)
    used = -plan.freed
    assert 0 < used <= 15000 and (plan.to_bits == 4).all()


@pytest.mark.parametrize("bad", [dict(quantiles=(0.7, 0.3)), dict(mu=(0.0, 1.0)), dict(depth_cap=(0, 1))])
def test_bad_policies(bad: dict) -> None:
    kw = dict(quantiles=(0.5,), mu=(1.0, 2.0), floors=((3, 4),), depth_cap=(1, 1))
    kw.update(bad)
    if "quantiles" in bad:
        kw.update(mu=(1.0, 2.0, 3.0), floors=((3, 4, 5),), depth_cap=(1, 1, 1))
    with pytest.raises(ValueError):
        BucketPolicy(**kw)


@pytest.mark.parametrize("overlapped", [None, False, True])
def test_overlapped_planner_refreshes_only_when_asked(overlapped: bool | None) -> None:
    """Not overlapped (the CPU runtime; None when built directly): the first plan after the statistics changed
    refreshes d_hat. Overlapped (the CUDA runtime): plans keep the last d_hat until ``refresh_if_stale``."""
    t = random_table(seed=5)
    planner = Planner(t, BucketPolicy.neutral(3), PlannerConfig(overlapped=overlapped))
    q = np.full(t.n, t.bits[-1])
    planner.plan_lower(q, 5000)
    first = planner._d_hat
    assert first is not None and not planner.stale
    planner.stale = True
    planner.plan_lower(q, 5000)
    planner.plan_raise(q - 1, 5000)
    assert (planner._d_hat is first) == bool(overlapped) and planner.stale == bool(overlapped)
    assert planner.refresh_if_stale() == bool(overlapped) and not planner.stale


def test_uniform_bytes_interpolates_between_bitwidths() -> None:
    t = random_table(seed=6)
    assert t.uniform_bytes(4) == t.bytes[:, 1].sum() and t.uniform_bytes(8.0) == t.bytes[:, -1].sum()
    assert t.uniform_bytes(3.5) == int((t.bytes[:, 0].sum() + t.bytes[:, 1].sum()) / 2)


def test_band_hands_budgets_at_and_above_it_to_the_neutral_policy() -> None:
    t = random_table(n=200, seed=4)
    hot = BucketPolicy((0.5,), (1.0, 50.0), ((3, 5), (3, 3)), (1, 1))
    banded = BucketPolicy(hot.quantiles, hot.mu, hot.floors, hot.depth_cap, neutral_from_bits=5.0)
    band = banded.neutral_from_bytes(t)
    assert band == t.uniform_bytes(5.0) and hot.neutral_from_bytes(t) is None
    for budget in (band, t.uniform_bytes(6.5)):  # at and above the band: exactly the neutral allocation
        q, q_neutral = fit_budget(t, banded, budget), fit_budget(t, BucketPolicy.neutral(3), budget)
        assert q is not None and q_neutral is not None and (q == q_neutral).all()
        q_hot = fit_budget(t, hot, budget)
        assert q_hot is not None and not (q_hot == q_neutral).all()  # the band changes something there
    budget = t.uniform_bytes(3.5)  # below the band the policy itself decides (neutral first, down to the band)
    q, q_neutral = fit_budget(t, banded, budget), fit_budget(t, BucketPolicy.neutral(3), budget)
    assert q is not None and q_neutral is not None and t.total_bytes(q) <= budget
    is_hot = hot.assign(t) == 1
    assert q[is_hot].mean() > q_neutral[is_hot].mean()


def test_runtime_planner_follows_the_band() -> None:
    from pwrun.core.planner.runtime import Planner, PlannerConfig

    t = random_table(n=200, seed=7)
    hot = BucketPolicy((0.5,), (1.0, 50.0), ((3, 5), (3, 3)), (1, 1))
    banded = Planner(t, BucketPolicy(hot.quantiles, hot.mu, hot.floors, hot.depth_cap, 5.0), PlannerConfig())
    neutral, plain = Planner(t, BucketPolicy.neutral(3), PlannerConfig()), Planner(t, hot, PlannerConfig())
    band = banded.band_bytes
    assert band is not None
    top = np.full(t.n, t.bits[-1])
    need = (t.total_bytes(top) - band) // 2  # lowering that stays above the band: the neutral plan
    a, b = banded.plan_lower(top, need), neutral.plan_lower(top, need)
    assert a.freed >= need and (a.blocks == b.blocks).all() and (a.to_bits == b.to_bits).all()
    q = fit_budget(t, BucketPolicy.neutral(3), band)
    assert q is not None
    a, c = banded.plan_lower(q, t.total_bytes(q) // 4), plain.plan_lower(q, t.total_bytes(q) // 4)
    assert (a.blocks == c.blocks).all() and (a.to_bits == c.to_bits).all()  # below the band: the policy's plan
    low = np.full(t.n, 3)
    allowance = (band - t.total_bytes(low)) // 2  # reloads that stay below the band: the policy's plan
    a, c = banded.plan_raise(low, allowance), plain.plan_raise(low, allowance)
    # the same moves in the same order (by benefit per byte: the runtime starts the head of the plan)
    assert a.blocks.size > 1 and (a.blocks == c.blocks).all() and (a.to_bits == c.to_bits).all()
    q = fit_budget(t, BucketPolicy.neutral(3), t.uniform_bytes(4.8))
    assert q is not None
    allowance = t.uniform_bytes(5.3) - t.total_bytes(q)  # past the band: within the allowance, one move each
    a = banded.plan_raise(q, allowance)
    assert band < t.total_bytes(q) - a.freed <= t.total_bytes(q) + allowance
    assert len(set(a.blocks.tolist())) == a.blocks.size and (a.to_bits == q[a.blocks] + 1).all()


def test_next_raises_walks_one_plan_until_it_no_longer_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """While reloads are under way the runtime starts a few blocks per step: ``next_raises`` hands out the head of
    one plan in its order (skipping blocks started or done), re-plans only when d_hat is refreshed or the
    bitwidths change otherwise (a lowering), and never exceeds the allowance or the block count."""
    t = random_table(n=300, seed=9)
    planner = Planner(t, BucketPolicy.neutral(3), PlannerConfig())
    q = np.full(t.n, 3)
    allowance = (t.total_bytes(np.full(t.n, 5)) - t.total_bytes(q)) // 2
    full = planner.plan_raise(q, allowance)
    assert full.blocks.size > 12
    calls = []
    real = planner.plan_raise
    monkeypatch.setattr(planner, "plan_raise", lambda *a: calls.append(1) or real(*a))
    movable = np.ones(t.n, bool)
    first = planner.next_raises(q, allowance, movable, 4)
    assert (first.blocks == full.blocks[:4]).all() and (first.to_bits == full.to_bits[:4]).all() and len(calls) == 1
    movable[first.blocks] = False  # started, copies in flight
    second = planner.next_raises(q, allowance, movable, 4)
    assert (second.blocks == full.blocks[4:8]).all() and len(calls) == 1  # the same plan, its next head
    q = q.copy()
    q[first.blocks] = first.to_bits  # the first ones committed
    movable[first.blocks] = True
    movable[second.blocks] = False
    third = planner.next_raises(q, allowance, movable, 4)
    assert (third.blocks == full.blocks[8:12]).all() and len(calls) == 1
    # the plan fits the allowance it is given now: a smaller one takes a shorter head
    cost = t.bytes[full.blocks[8], t.columns(full.to_bits[8])] - t.bytes[full.blocks[8], 0]
    assert planner.next_raises(q, cost, movable, 4).blocks.tolist() == [full.blocks[8]] and len(calls) == 1
    # a bitwidth the plan did not set (here one past the plan's target) or a refresh of d_hat: a fresh plan
    q_other = q.copy()
    q_other[full.blocks[-1]] = full.to_bits[-1] + 1
    planner.next_raises(q_other, allowance, movable, 4)
    assert len(calls) == 2
    planner.refresh()
    fresh = planner.next_raises(q, allowance, movable, 4)
    expect = real(q, allowance, movable)
    assert len(calls) == 3 and (fresh.blocks == expect.blocks[:4]).all()
    assert planner.next_raises(q, 0, movable, 4).empty and planner.next_raises(q, allowance, movable, 0).empty


def test_next_raises_on_the_cpu_path_replans_once_the_statistics_changed() -> None:
    """Not overlapped (the CPU runtime): a plan is refreshed by the first plan after the statistics changed, so a
    held reload plan must not outlive that either."""
    t = random_table(n=100, seed=10)
    planner = Planner(t, BucketPolicy.neutral(3), PlannerConfig(overlapped=False))
    q = np.full(t.n, 3)
    movable = np.ones(t.n, bool)
    allowance = (t.total_bytes(np.full(t.n, 5)) - t.total_bytes(q)) // 2
    planner.next_raises(q, allowance, movable, 4)
    d_hat = planner._d_hat
    planner.stale = True
    planner.next_raises(q, allowance, movable, 4)
    assert planner._d_hat is not d_hat and not planner.stale and planner._raise is not None
    assert planner._raise[3] is planner._d_hat  # the held plan was made again, with the refreshed d_hat


def test_bitwidths_outside_the_table_are_refused() -> None:
    """The planner speaks bits: a bitwidth the table does not have (here 2 and 9 against 3..8) is a clear error,
    not a silent wrong column."""
    t = random_table(seed=11)
    assert t.columns(np.array([3, 8, 5])).tolist() == [0, 5, 2] and int(t.columns(4)) == 1
    planner = Planner(t, BucketPolicy.neutral(3), PlannerConfig())
    for bad in (2, 9):
        q = np.full(t.n, 6)
        q[7] = bad
        msg = rf"bitwidths \[{bad}\] are not among the calibrated"
        with pytest.raises(ValueError, match=msg):
            planner.plan_lower(q, 5000)
        with pytest.raises(ValueError, match=msg):
            planner.plan_raise(q, 5000)
        with pytest.raises(ValueError, match=msg):
            t.total_bytes(q)
