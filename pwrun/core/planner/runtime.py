"""The runtime planner (SPEC section 5, Algorithm 1): KV pressure, predicted damage, prepared plans, reload.

What it does: holds the calibration tables of every block (page-rounded M_i^b), the routing-bucket
policy and the prompt-residual heads, and keeps them current with the live batch's statistics
(``OnlineStats``). ``pressure`` is D of Eq. 7; ``plan_lower`` runs the floor stages from the most
conservative on, each as greedy rounds by lowest d_hat / Delta (Eq. 8 / Eq. 3) until the freed
bytes reach D; ``plan_raise`` spends an allowance of bytes by damage avoided per byte (reload,
with hysteresis decided by the caller through ``PlannerConfig``). ``prepare`` computes the plan the
next steps will need ahead of need, so that executing it under pressure is a lookup. Vectorized
over all blocks (numpy); the only Python loops run over floor stages, rounds and heads. A banded
bucket policy (``BucketPolicy.neutral_from_bits``) plans with the neutral policy while the expert
bytes are at or above its band.
Ablations (SPEC section 8) are switches of ``PlannerConfig``. It moves nothing (the mover does).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pwrun.core.planner.buckets import BucketPolicy
from pwrun.core.planner.greedy import Plan, lower_until, predicted_damage, raise_step
from pwrun.core.planner.online import OnlineStats, ResidualHeads
from pwrun.core.planner.tables import BlockTable


@dataclass(frozen=True)
class PlannerConfig:
    """Named planner parameters (SPEC section 5 leaves them to us).

    ``free_threshold``: T_blk of Eq. 7 (KV blocks kept free); ``reload_threshold``: free blocks above
    which planes are reloaded (hysteresis, > T_blk); ``alpha``: the prompt factor's strength (Eq. 6);
    ``online_weight``: weight of the live routing mass against the offline mass; ``decay``: per-step
    decay of the live statistics. ``use_*``/``movement``: the paper's ablations. ``overlapped``: the runtime
    refreshes d_hat (``refresh_if_stale``) and plans reloads while the device computes each step, so plans use
    d_hat as last refreshed; False: the first plan that needs d_hat after the statistics changed refreshes it (a
    prepared plan stays in use until then). None: ``pwrun.engine.build.assemble_engine`` decides, True on CUDA,
    False on CPU (nothing runs concurrently: the work stays after sampling); a Planner given None acts as False.
    """

    free_threshold: int = 2
    reload_threshold: int = 8
    alpha: float = 1.0
    online_weight: float = 0.5
    decay: float = 0.9
    use_routing: bool = True
    use_residual: bool = True
    use_sensitivity: bool = True
    movement: bool = True
    overlapped: bool | None = None

    def __post_init__(self) -> None:
        if self.free_threshold < 0 or self.reload_threshold <= self.free_threshold:
            raise ValueError("need 0 <= free_threshold < reload_threshold")
        if not 0 <= self.online_weight <= 1 or not 0 < self.decay < 1 or self.alpha < 0:
            raise ValueError("online_weight must be in [0, 1], decay in (0, 1), alpha >= 0")


class Planner:
    """Plans demotions and reloads over ``table``; block states and plans are bitwidths (one of ``table.bits``
    per block, as ``WeightPageTable.q`` holds them)."""

    def __init__(self, table: BlockTable, policy: BucketPolicy, cfg: PlannerConfig,
                 heads: ResidualHeads | None = None, stats: OnlineStats | None = None) -> None:
        self.cfg = cfg
        self.table = table if cfg.use_sensitivity else replace(table, sens=self._bit_drop_sens(table))
        self.policy = policy if cfg.use_routing else BucketPolicy.neutral(int(table.bits[0]))
        # a banded policy: the neutral one plans while the expert bytes are at or above ``band_bytes``
        self.band_bytes = self.policy.neutral_from_bytes(self.table)
        self._neutral = BucketPolicy.neutral(int(table.bits[0]))
        self._neutral_d_hat: np.ndarray | None = None
        self.heads = heads if cfg.use_residual else None
        self.stats = stats
        self._d_hat: np.ndarray | None = None
        self._bucket: np.ndarray | None = None
        self.prepared: Plan | None = None
        self._prepared_q: np.ndarray | None = None
        self.takes = {"prepared": 0, "fresh": 0}  # plans ``take`` returned, by kind
        self.stale = True  # the live statistics changed since d_hat was computed
        # the last reload plan (``next_raises``): the plan, the bitwidths it was made from, those it aims at, and
        # the d_hat it was made with (each refresh makes a new array)
        self._raise: tuple[Plan, np.ndarray, np.ndarray, np.ndarray] | None = None

    @staticmethod
    def _bit_drop_sens(table: BlockTable) -> np.ndarray:
        """Ablation 'without global sensitivity': s_i^b = 8 - b for every block (damage = bits dropped)."""
        return np.broadcast_to(8.0 - table.bits.astype(np.float64), table.sens.shape).copy()

    def pressure(self, free_blocks: int, kv_block_bytes: int) -> int:
        """D of SPEC Eq. 7 in bytes: max(0, T_blk + 1 - F_blk) * B_KV."""
        return max(0, self.cfg.free_threshold + 1 - free_blocks) * kv_block_bytes

    def refresh(self) -> None:
        """Recompute buckets and d_hat [n, nb, nb] from the offline tables and the live statistics."""
        table = self.table
        if self.cfg.use_routing and self.stats is not None and self.stats.steps:
            w = self.cfg.online_weight
            table = replace(table, mass=(1 - w) * table.mass + w * self.stats.block_mass())
        self._bucket = self.policy.assign(table)
        eta = None
        if self.heads is not None and self.stats is not None and self.stats.steps:
            eta = self.heads.eta(self.table.bits, self.table.unit, self.stats.block_log_features(), self.cfg.alpha)
        self._d_hat = predicted_damage(self.table, self._bucket, self.policy, eta)
        if self.band_bytes is not None:
            self._neutral_d_hat = predicted_damage(self.table, np.zeros(table.n, np.int64), self._neutral, eta)
        self.prepared = None
        self.stale = False

    def refresh_if_stale(self) -> bool:
        """Refresh now if the live statistics changed (the runtime calls this while the device computes a step,
        so that plans made on the step's critical path find d_hat ready); returns whether it refreshed."""
        if self.stale or self._d_hat is None:
            self.refresh()
            return True
        return False

    @property
    def buckets(self) -> np.ndarray | None:
        """Routing bucket [n] int64 of every block as plans use them now (they set the floors a plan may lower a
        block to); None before the first plan."""
        return self._bucket

    def _state(self) -> tuple[np.ndarray, np.ndarray]:
        if self._d_hat is None or self._bucket is None or (self.stale and not self.cfg.overlapped):
            self.refresh()
        assert self._d_hat is not None and self._bucket is not None
        return self._d_hat, self._bucket

    def plan_lower(self, q_bits: np.ndarray, need_bytes: float, movable: np.ndarray | None = None) -> Plan:
        """Demotions from the bitwidths ``q_bits`` [n] (to a final bitwidth per block) freeing >= ``need_bytes``, or
        as much as the last stage allows.

        With a banded policy, demotions above ``band_bytes`` of expert bytes follow the neutral policy.
        """
        if need_bytes <= 0:
            return Plan.none()
        d_hat, bucket = self._state()
        table, q = self.table, q_bits
        freed, damage = 0, 0.0
        if self.band_bytes is not None and (above := table.total_bytes(q) - self.band_bytes) > 0:
            assert self._neutral_d_hat is not None
            q, freed, damage, _ = lower_until(table, q, min(need_bytes, above), self._neutral_d_hat,
                                              np.zeros(table.n, np.int64), self._neutral, movable)
        q, more, dmg, stage = lower_until(table, q, need_bytes - freed, d_hat, bucket, self.policy.without_band(),
                                          movable)
        blocks = np.flatnonzero(q != q_bits)
        return Plan(blocks, q[blocks], freed + more, damage + dmg, stage)

    def plan_raise(self, q_bits: np.ndarray, allowance: float, movable: np.ndarray | None = None) -> Plan:
        """Promotions from the bitwidths ``q_bits`` [n] by damage avoided per byte within ``allowance`` bytes (empty
        without page movement).

        With a banded policy, bytes spent below ``band_bytes`` follow the policy, the rest the neutral policy
        (each block moves at most once per plan, as in one ``raise_step``). Blocks come in the order they are worth
        starting: by damage avoided per byte, the policy's part first (the runtime starts the head of the plan).
        """
        if allowance <= 0 or not self.cfg.movement:
            return Plan.none()
        d_hat, bucket = self._state()
        policy = self.policy.without_band()
        if self.band_bytes is None:
            return raise_step(self.table, q_bits, allowance, d_hat, bucket, policy, movable)
        assert self._neutral_d_hat is not None
        table, q = self.table, q_bits.copy()
        free_to_move = np.ones(table.n, bool) if movable is None else movable.copy()
        spent, damage = 0, 0.0
        parts: list[np.ndarray] = []  # each part in its benefit-per-byte order: the runtime starts the head
        below = self.band_bytes - table.total_bytes(q)
        if below > 0:
            p = raise_step(table, q, min(allowance, below), d_hat, bucket, policy, free_to_move)
            q[p.blocks] = p.to_bits
            free_to_move[p.blocks] = False
            spent, damage = -p.freed, p.damage
            parts.append(p.blocks)
        if allowance > below and allowance - spent > 0:  # the allowance reaches past the band
            p = raise_step(table, q, allowance - spent, self._neutral_d_hat, np.zeros(table.n, np.int64),
                           self._neutral, free_to_move)
            q[p.blocks] = p.to_bits
            spent, damage = spent - p.freed, damage + p.damage
            parts.append(p.blocks)
        blocks = np.concatenate(parts) if parts else np.empty(0, np.int64)
        return Plan(blocks, q[blocks], -spent, damage, 0)

    def next_raises(self, q_bits: np.ndarray, allowance: float, movable: np.ndarray, max_blocks: int) -> Plan:
        """The next <= ``max_blocks`` promotions to start (SPEC section 5, Algorithm 1's reload) within
        ``allowance`` bytes, in benefit-per-byte order: the head of the last ``plan_raise`` while it holds (made
        with the current d_hat, and the bitwidths ``q_bits`` [n] changed only by its own raises; entries already
        started, i.e. not ``movable`` [n], or done are skipped), else of a fresh plan. The runtime starts a few
        blocks per step, so this saves re-planning every block at every step while reloads are under way.
        ``freed`` is minus the bytes the head needs; ``damage`` is not computed (0)."""
        if allowance <= 0 or not self.cfg.movement or max_blocks <= 0:
            return Plan.none()
        d_hat, _ = self._state()  # refreshes d_hat where a fresh plan would (the non-overlapped path)
        held = self._raise is not None and self._raise[3] is d_hat and self._raise_holds(q_bits)
        head = self._raise_head(q_bits, allowance, movable, max_blocks) if held else None
        if head is None or head.empty:  # nothing held, or the held plan is used up: plan again
            p = self.plan_raise(q_bits, allowance, movable)
            target = q_bits.copy()
            target[p.blocks] = p.to_bits
            self._raise = (p, q_bits.copy(), target, d_hat)
            head = self._raise_head(q_bits, allowance, movable, max_blocks)
        return head

    def _raise_holds(self, q_bits: np.ndarray) -> bool:
        """Every bitwidth that differs from the held plan's start is one of its targets."""
        assert self._raise is not None
        _, q0, target, _ = self._raise
        changed = np.flatnonzero(q_bits != q0)
        return bool((q_bits[changed] == target[changed]).all())

    def _raise_head(self, q_bits: np.ndarray, allowance: float, movable: np.ndarray, max_blocks: int) -> Plan:
        assert self._raise is not None
        p = self._raise[0]
        todo = movable[p.blocks] & (q_bits[p.blocks] != p.to_bits)
        blocks, to = p.blocks[todo], p.to_bits[todo]
        col = self.table.columns
        cost = self.table.bytes[blocks, col(to)] - self.table.bytes[blocks, col(q_bits[blocks])]
        head = np.flatnonzero(np.cumsum(cost) <= allowance)[:max_blocks]
        return Plan(blocks[head], to[head], -int(cost[head].sum()), 0.0, 0)

    def prepare(self, q_bits: np.ndarray, need_bytes: float, movable: np.ndarray | None = None) -> None:
        """Plan ahead from the bitwidths ``q_bits`` [n] for ``need_bytes`` (the pressure a few steps from now) and
        queue the plan."""
        self.prepared = self.plan_lower(q_bits, need_bytes, movable)
        self._prepared_q = q_bits.copy()

    def is_prepared(self, q_bits: np.ndarray, need_bytes: float, movable: np.ndarray | None = None) -> bool:
        """The queued plan applies at the bitwidths ``q_bits`` [n]: ``why_not_prepared`` finds no reason against
        it."""
        return self.why_not_prepared(q_bits, need_bytes, movable) is None

    def why_not_prepared(self, q_bits: np.ndarray, need_bytes: float, movable: np.ndarray | None = None) -> str | None:
        """Why the queued plan does not apply at the bitwidths ``q_bits`` [n] for ``need_bytes`` (None: it applies):
        none is queued, it frees fewer bytes, one of its blocks changed bitwidth since it was made (blocks outside it
        may have: a reload that completed in between leaves the plan's bytes and targets as they were, so it need not
        be made again on the step's critical path), or one of them may not move now (``movable`` [n] bool, None:
        all may)."""
        p, q0 = self.prepared, self._prepared_q
        if p is None or q0 is None:
            return "none prepared"
        if p.freed < need_bytes:
            return "prepared frees too little"
        if not (q_bits[p.blocks] == q0[p.blocks]).all():
            return "its blocks changed bitwidth"
        if movable is not None and not movable[p.blocks].all():
            return "its blocks are moving"
        return None

    def take(self, q_bits: np.ndarray, need_bytes: float, movable: np.ndarray | None = None) -> Plan:
        """The plan to execute now: the prepared one if it still applies (``is_prepared``), else a fresh one.
        ``takes`` counts both kinds ("prepared", "fresh"): fresh plans run on the step's critical path."""
        holds = self.is_prepared(q_bits, need_bytes, movable)
        p, self.prepared = self.prepared, None
        self.takes["prepared" if holds else "fresh"] += 1
        if holds:
            assert p is not None
            return p
        return self.plan_lower(q_bits, need_bytes, movable)
