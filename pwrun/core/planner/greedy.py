"""Greedy precision planning over all blocks at once (SPEC Algorithm 1, Eq. 3-8), vectorized with numpy.

What it does: ``predicted_damage`` forms d_hat_i^{b->b'} = max(eps, mu_beta(i) * g_i^{b->b'} * eta_i^{b->b'})
(Eq. 8); ``lower_step`` picks, under one floor stage, each block's best demotion (lowest
d_hat / Delta, within its floor and depth cap) and takes blocks in that order until the freed bytes
reach D; ``raise_step`` does the reverse (highest damage avoided per byte) within a byte
allowance; ``lower_until`` repeats lowering steps, escalating floor stages only when a stage can
free nothing more (the runtime planner's ``plan_lower`` and the offline ``fit_budget`` both use it);
``fit_budget`` lowers from the top bitwidth until the blocks fit a byte budget (the offline use of the
same planner, by ``pwcal search-buckets``; a banded policy lowers with the neutral policy down to its
band first).
No Python loop runs over blocks. Every function takes and returns bitwidths (as ``WeightPageTable.q`` holds
them); the vectorized internals index the [n, nb] arrays by column (``BlockTable.columns``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pwrun.core.planner.buckets import BucketPolicy
from pwrun.core.planner.tables import BlockTable

EPS_DAMAGE = 1e-12


@dataclass(frozen=True)
class Plan:
    """Blocks to move: ``blocks`` [k] and their new bitwidths ``to_bits`` [k]; bytes freed (< 0: used)."""

    blocks: np.ndarray
    to_bits: np.ndarray
    freed: int
    damage: float
    stage: int

    @property
    def empty(self) -> bool:
        return self.blocks.size == 0

    @staticmethod
    def none(stage: int = 0) -> Plan:
        """The plan that moves nothing."""
        return Plan(np.empty(0, np.int64), np.empty(0, np.int64), 0, 0.0, stage)


def predicted_damage(table: BlockTable, bucket: np.ndarray, policy: BucketPolicy,
                     eta: np.ndarray | None = None) -> np.ndarray:
    """d_hat [n, nb, nb] (Eq. 8): d_hat[i, a, c] for moving block i from bits[a] to bits[c]."""
    mu = np.asarray(policy.mu)[bucket][:, None, None]
    g = table.global_damage()
    return np.maximum(EPS_DAMAGE, mu * g * (1.0 if eta is None else eta))


def floor_bits(table: BlockTable, bucket: np.ndarray, policy: BucketPolicy, stage: int) -> np.ndarray:
    """Per-block floor [n] (bits) at floor stage ``stage``: the lowest table bitwidth at or above the bucket's
    floor."""
    return table.bits[_floor_columns(table, bucket, policy, stage)]


def _floor_columns(table: BlockTable, bucket: np.ndarray, policy: BucketPolicy, stage: int) -> np.ndarray:
    floors = np.asarray(policy.floors[stage])[bucket]
    return np.searchsorted(table.bits, np.maximum(floors, table.bits[0]))


def _take(order: np.ndarray, amount: np.ndarray, need: float) -> np.ndarray:
    """The shortest prefix of ``order`` whose ``amount`` sums to >= need (all if never)."""
    cum = np.cumsum(amount[order])
    k = int(np.searchsorted(cum, need, side="left")) + 1
    return order[: min(k, order.size)]


def lower_step(table: BlockTable, q_bits: np.ndarray, need_bytes: float, d_hat: np.ndarray, bucket: np.ndarray,
               policy: BucketPolicy, stage: int, movable: np.ndarray | None = None) -> Plan:
    """Demotions from the bitwidths ``q_bits`` [n] that free >= ``need_bytes`` at least damage per byte (or as many
    as the stage allows).

    ``movable`` [n] bool: blocks that may change now (e.g. not while a reload is in flight). Only the blocks that
    can go lower at all (above their floor and movable) enter the [m, nb] ratio arrays: under pressure most blocks
    sit at their floor, and a stage with none left is found without them (the runtime plans on the step's
    critical path).
    """
    blocks, to, freed, damage = _lower_columns(table, table.columns(q_bits), need_bytes, d_hat, bucket, policy, stage,
                                               movable)
    return Plan(blocks, table.bits[to], freed, damage, stage)


def _lower_columns(table: BlockTable, q: np.ndarray, need_bytes: float, d_hat: np.ndarray, bucket: np.ndarray,
                   policy: BucketPolicy, stage: int, movable: np.ndarray | None
                   ) -> tuple[np.ndarray, np.ndarray, int, float]:
    """``lower_step`` on columns ``q`` [n]: (blocks [k], their new columns [k], bytes freed, damage)."""
    none = np.empty(0, np.int64)
    if need_bytes <= 0:
        return none, none, 0, 0.0
    moves = _Demotions(table, d_hat, _floor_columns(table, bucket, policy, stage), np.asarray(policy.depth_cap)[bucket],
                       movable)
    moves.update(q, np.flatnonzero(moves.can_lower(q)))  # the others keep no demotion (ratio inf)
    take = moves.take(need_bytes)
    return take, moves.to[take], int(moves.delta[take].sum()), float(moves.damage[take].sum())


def raise_step(table: BlockTable, q_bits: np.ndarray, allowance: float, d_hat: np.ndarray, bucket: np.ndarray,
               policy: BucketPolicy, movable: np.ndarray | None = None) -> Plan:
    """Promotions from the bitwidths ``q_bits`` [n] by damage avoided per byte, using at most ``allowance`` bytes
    (Algorithm 1, reload)."""
    n, nb = table.n, table.bits.size
    q = table.columns(q_bits)
    rows = np.arange(n)
    c = np.arange(nb)[None, :]
    cap = np.asarray(policy.depth_cap)[bucket][:, None]
    a = q[:, None]
    valid = (c > a) & (c <= a + cap)
    if movable is not None:
        valid &= movable[:, None]
    cost = table.bytes - table.bytes[rows, q][:, None]  # bytes needed to raise to c
    avoided = d_hat[rows, :, q]  # [n, nb]: damage avoided by raising from bits[c] back to the current bits
    benefit = np.where(valid & (cost > 0), avoided / np.maximum(cost, 1), -np.inf)
    best = benefit.argmax(axis=1)
    best_b = benefit[rows, best]
    cand = np.flatnonzero(np.isfinite(best_b))
    if cand.size == 0 or allowance <= 0:
        return Plan.none()
    order = cand[np.argsort(-best_b[cand], kind="stable")]
    fits = order[np.cumsum(cost[order, best[order]]) <= allowance]
    return Plan(fits, table.bits[best[fits]], -int(cost[fits, best[fits]].sum()),
                -float(avoided[fits, best[fits]].sum()), 0)


def lower_until(table: BlockTable, q_bits: np.ndarray, need_bytes: float, d_hat: np.ndarray, bucket: np.ndarray,
                policy: BucketPolicy, movable: np.ndarray | None = None, step_fraction: float | None = None,
                max_rounds: int = 100_000) -> tuple[np.ndarray, int, float, int]:
    """Greedy ``lower_step`` rounds from the bitwidths ``q_bits`` [n], floor stage 0 on, until >= ``need_bytes``
    are freed (Algorithm 1).

    A stage is left only when it can free nothing more. With ``step_fraction``, each round asks for at most
    that fraction of the current bytes (small rounds: close to a global greedy by damage per byte; offline),
    else for all that is still needed (runtime). Returns (new bitwidths [n], bytes freed, predicted
    damage, last stage); fewer bytes than asked if the last stage runs out. Each block's best demotion is
    computed once per stage and again only after the block moves: the rounds equal ``lower_step`` calls.
    """
    q = table.columns(q_bits)  # a new array: rounds update it in place
    total = 0 if step_fraction is None else int(table.bytes[np.arange(table.n), q].sum())  # offline rounds only
    freed, damage, stage, rounds = 0, 0.0, 0, 0
    for stage in range(len(policy.floors)):
        moves = _Demotions(table, d_hat, _floor_columns(table, bucket, policy, stage),
                           np.asarray(policy.depth_cap)[bucket], movable)
        moves.update(q, np.flatnonzero(moves.can_lower(q)))  # only blocks that can go lower: most sit at a floor
        while freed < need_bytes and rounds < max_rounds:
            ask = need_bytes - freed
            if step_fraction is not None:
                ask = min(ask, max(1.0, step_fraction * (total - freed)))
            rounds += 1
            take = moves.take(ask)
            if take.size == 0:
                break
            q[take] = moves.to[take]
            freed, damage = freed + int(moves.delta[take].sum()), damage + float(moves.damage[take].sum())
            if freed < need_bytes:  # another round (the runtime's one round stops here)
                moves.update(q, take)
        if freed >= need_bytes:
            break
    return table.bits[q], freed, damage, stage


class _Demotions:
    """Each block's best demotion within one floor stage (``lower_step``'s choice, lowest damage per byte freed):
    column ``to``, bytes ``delta``, ``damage`` and their ``ratio`` [n] (inf: none), kept for the blocks' current
    columns by ``update``. ``floor`` [n]: the stage's floor columns; ``cap`` [n]: how many columns one step may
    lower a block."""

    def __init__(self, table: BlockTable, d_hat: np.ndarray, floor: np.ndarray, cap: np.ndarray,
                 movable: np.ndarray | None) -> None:
        self.table, self.d_hat, self.floor, self.cap, self.movable = table, d_hat, floor, cap, movable
        n = table.n
        self.to, self.delta = np.zeros(n, np.int64), np.zeros(n, np.int64)
        self.damage, self.ratio = np.zeros(n), np.full(n, np.inf)

    def can_lower(self, q: np.ndarray) -> np.ndarray:
        """[n] bool: the blocks that may go lower from columns ``q`` (above their floor and step limit, movable)."""
        can = np.maximum(self.floor, q - self.cap) < q
        return can if self.movable is None else can & self.movable

    def take(self, need: float) -> np.ndarray:
        """The blocks to lower now: by ratio (block order on ties) until their bytes reach ``need`` (all if never)."""
        cand = np.flatnonzero(np.isfinite(self.ratio))  # ascending: ties keep the block order
        if cand.size == 0:
            return cand
        return _take(cand[np.argsort(self.ratio[cand], kind="stable")], self.delta, need)

    def update(self, q: np.ndarray, rows: np.ndarray) -> None:
        """Recompute the demotions of ``rows`` from their columns ``q[rows]``."""
        if rows.size == 0:
            return
        a = q[rows]
        lo = np.maximum(self.floor[rows], a - self.cap[rows])
        byts = self.table.bytes[rows]
        m = np.arange(rows.size)
        c = np.arange(self.table.bits.size)[None, :]
        delta = byts[m, a][:, None] - byts
        dmg = self.d_hat[rows, a]
        valid = (c < a[:, None]) & (c >= lo[:, None]) & (delta > 0)
        if self.movable is not None:
            valid &= self.movable[rows][:, None]
        ratio = np.where(valid, dmg / np.maximum(delta, 1), np.inf)
        best = ratio.argmin(axis=1)
        self.to[rows], self.delta[rows], self.damage[rows] = best, delta[m, best], dmg[m, best]
        self.ratio[rows] = ratio[m, best]


def fit_budget(table: BlockTable, policy: BucketPolicy, budget_bytes: int, eta: np.ndarray | None = None,
               step_fraction: float = 0.01, max_steps: int = 100_000) -> np.ndarray | None:
    """Bitwidths [n] that fit ``budget_bytes`` starting from the top bitwidth, or None if infeasible.

    Each step asks ``lower_step`` for at most ``step_fraction`` of the current bytes, so blocks are
    lowered in small rounds (close to a global greedy by damage per byte) rather than all at once.
    A banded policy (``policy.neutral_from_bits``) is followed as the runtime planner follows it: the
    neutral policy lowers down to the band's bytes, the policy itself below them.
    """
    band = policy.neutral_from_bytes(table)
    top = np.full(table.n, table.bits[-1], dtype=np.int64)
    q = top if band is None else _fit(table, BucketPolicy.neutral(int(table.bits[0])), max(budget_bytes, band), eta,
                                      top, step_fraction, max_steps)
    return None if q is None else _fit(table, policy.without_band(), budget_bytes, eta, q, step_fraction, max_steps)


def _fit(table: BlockTable, policy: BucketPolicy, budget_bytes: int, eta: np.ndarray | None, q: np.ndarray,
         step_fraction: float, max_steps: int) -> np.ndarray | None:
    """``fit_budget`` from the bitwidths ``q`` [n] with one (unbanded) policy."""
    bucket = policy.assign(table)
    need = table.total_bytes(q) - budget_bytes
    q, freed, _, _ = lower_until(table, q, need, predicted_damage(table, bucket, policy, eta), bucket, policy,
                                 step_fraction=step_fraction, max_rounds=max_steps)
    return q if freed >= need else None
