"""When expert bit-planes move: demotion under KV pressure and reload on slack (SPEC sections 5 and 6).

What it does: owns the weight page table's changes for the engine core. ``make_room`` frees KV blocks the
scheduler asks for by executing a demotion plan, all or nothing, and remembers a request for room that
failed (``_room_key``) so that it is not planned again while nothing that decides it changed. After
sampling, ``after_step`` acts on the pressure D (Eq. 7): lower blocks (the prepared plan) when free blocks
fall to the threshold, start reloads when they stay above the higher threshold (hysteresis, ``reload``),
and prepare the plan the next steps will need. With ``overlapped`` planning (CUDA) the refresh of d_hat,
the reloads and the preparation run while the device computes (``overlapped``). Reloads whose copies the
runner reports complete are committed by ``commit``. Every change is recorded in ``WeightMoves`` for the
runner to mirror on the device. Planner seconds are counted on and off the step's critical path.
Control plane: numpy only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pwrun.core.config import EngineConfig
from pwrun.core.decision import Reload, WeightMoves
from pwrun.core.kv_blocks import BlockTables, PooledBlockAllocator
from pwrun.core.planner.runtime import Planner
from pwrun.core.pool import PagePool
from pwrun.core.scheduler import RequestState, Scheduler
from pwrun.core.weight_table import WeightPageTable


@dataclass
class StepActions:
    """One step's weight actions: ``demoted_blocks`` (blocks lowered), ``reload_started_blocks`` (blocks whose reload
    began), ``pressure_bytes`` (D of Eq. 7 after sampling) and host seconds by phase (``refresh``, ``raise_plan``,
    ``raise_start``, ``prepare``; 0: did not run)."""

    demoted_blocks: int = 0
    reload_started_blocks: int = 0
    pressure_bytes: int = 0
    refresh_seconds: float = 0.0
    raise_plan_seconds: float = 0.0
    raise_start_seconds: float = 0.0
    prepare_seconds: float = 0.0


class WeightPolicy:
    """Demotion and reload policy over ``wpt`` (blocks in ``pool``) for ``planner`` (None: weights never move)."""

    def __init__(self, wpt: WeightPageTable, pool: PagePool, planner: Planner | None, cfg: EngineConfig,
                 alloc: PooledBlockAllocator, tables: BlockTables, scheduler: Scheduler,
                 kv_block_bytes: int) -> None:
        self.wpt, self.pool, self.planner, self.cfg = wpt, pool, planner, cfg
        # pages the experts may hold at most (EngineConfig.max_mean_bits), or None
        self.cap_pages = None if cfg.max_mean_bits is None else int(wpt.pages_at_mean_bits(cfg.max_mean_bits))
        self.alloc, self.tables, self.scheduler = alloc, tables, scheduler
        self.kv_block_bytes = kv_block_bytes
        self.overlapped = planner is not None and bool(planner.cfg.overlapped)
        self.moves = WeightMoves()  # changes since the runner last took them (``take_moves``)
        self.step = StepActions()
        self.demoted_blocks = 0  # blocks lowered, whole run
        self.promoted_blocks = 0  # blocks whose reload committed, whole run
        self.planner_seconds = 0.0  # on the step's critical path (host, with the device idle or waiting)
        self.planner_overlapped_seconds = 0.0  # while the device computed a step (CUDA; on CPU nothing overlaps)
        self.planner_calls = 0
        self._pending: dict[int, tuple[int, ...]] = {}  # reload batch id -> blocks, in flight
        self._next_batch = 0
        self._no_room: tuple[Any, ...] | None = None  # ``_room_key`` of the last request for room that failed

    def take_moves(self) -> WeightMoves:
        moves, self.moves = self.moves, WeightMoves()
        return moves

    # ------------------------------------------------------------------ state the planner reads
    def movable(self) -> np.ndarray:
        """[n] blocks with no reload in flight (the planner may change them now)."""
        return self.wpt.pending == 0

    def in_flight_bytes(self) -> int:
        """Bytes of the reloads in flight (their pages at the target minus at the committed bitwidth)."""
        bl = np.array([i for blocks in self._pending.values() for i in blocks], dtype=np.int64)
        if not bl.size:
            return 0
        w = self.wpt
        pend, q = w.pending[bl], w.q[bl]
        pages = (pend - q) * w.plane_pages[bl] + w.lut_pages[bl, pend] - w.lut_pages[bl, q]
        return int(pages.sum()) * self.pool.cfg.page_bytes

    # ------------------------------------------------------------------ demotion
    def make_room(self, blocks: int) -> bool:
        """Free KV blocks until ``blocks`` are free by lowering expert bitwidths (SPEC section 5, Algorithm 1's
        lowering under KV pressure, for room the scheduler asks for), all or nothing: a demotion plan that cannot
        free enough is not executed (the scheduler then preempts, or leaves the request waiting; lowering part of
        the way would only demote blocks that the reloads raise again). A request for room that failed is not
        planned again while nothing that decides it changed (free blocks, bitwidths, blocks in motion, routing
        buckets): a waiting request that does not fit costs the steps after it no planning."""
        if self.alloc.num_free >= blocks:
            return True
        if self.planner is None:
            return False
        key = self._room_key(blocks)
        if self._no_room is not None and key[0] >= self._no_room[0] and all(
                np.array_equal(a, b) if a is not None and b is not None else a is b
                for a, b in zip(key[1:], self._no_room[1:], strict=True)):
            return False
        for _ in range(8):  # freed pages are counted exactly; the loop guards against a plan that fell short
            need = (blocks - self.alloc.num_free) * self.kv_block_bytes
            if not self._lower(need, whole=True):
                break
            if self.alloc.num_free >= blocks:
                return True
        if self.alloc.num_free >= blocks:
            return True
        self._no_room = self._room_key(blocks)
        return False

    def _room_key(self, blocks: int) -> tuple[Any, ...]:
        """(KV blocks missing, bitwidths [n], movable [n], routing buckets [n]): what decides whether ``make_room``
        can succeed (a plan that fell short took every movable block to its bucket's last floor)."""
        assert self.planner is not None
        b = self.planner.buckets
        return (blocks - self.alloc.num_free, self.wpt.q.copy(), self.movable(), None if b is None else b.copy())

    def _lower(self, need_bytes: int, whole: bool = False) -> bool:
        """Execute the demotion plan for ``need_bytes`` (``whole``: only if it frees all of them); whether it ran."""
        assert self.planner is not None
        t0 = time.perf_counter()
        plan = self.planner.take(self.wpt.q, need_bytes, self.movable())
        self._planner_time(t0)
        if plan.empty or (whole and plan.freed < need_bytes):
            return False
        self.lower(plan.blocks, plan.to_bits)
        return True

    def lower(self, blocks: np.ndarray, to_bits: np.ndarray) -> None:
        """Commit q_i <- ``to_bits`` [m] for ``blocks`` [m] now (step boundary; see ``WeightPageTable.lower_many``)."""
        self.moves.lut_copies += self.wpt.lower_many(self.pool, blocks, to_bits)
        self.moves.lowered += np.asarray(blocks).tolist()
        self.demoted_blocks += int(np.asarray(blocks).size)
        self.step.demoted_blocks += int(np.asarray(blocks).size)

    def _planner_time(self, t0: float, overlapped: bool = False) -> None:
        dt = time.perf_counter() - t0
        if overlapped:
            self.planner_overlapped_seconds += dt
        else:
            self.planner_seconds += dt
        self.planner_calls += 1

    # ------------------------------------------------------------------ after a step
    def after_step(self, running: list[RequestState]) -> None:
        """After sampling: pressure (Eq. 7) -> lower (not overlapped: else reload); then prepare the next plan."""
        if self.planner is None:
            return
        d = self.planner.pressure(self.alloc.num_free, self.kv_block_bytes)
        self.step.pressure_bytes = d
        if d > 0:
            self._lower(d)
        elif not self.overlapped:
            self.reload()
        if not self.overlapped:  # overlapped: prepared while the device computed the step (``overlapped``)
            self._prepare_next(running)

    def while_computing(self, running: list[RequestState], finishing: Iterable[int]) -> None:
        """Planner work done while the device computes the step just launched (host work hidden behind it):
        d_hat from the latest live statistics, reloads, and the demotion plan that this step's ``after_step``
        (or the next admission) takes, computed as if the ``finishing`` requests (those that reach their length
        limit in this step) had already freed their blocks (else it would demote for blocks about to be freed)."""
        if self.planner is None:
            return
        t0 = time.perf_counter()
        self.planner.refresh_if_stale()
        self._planner_time(t0, overlapped=True)
        t1 = time.perf_counter()
        self.reload(overlapped=True)
        t2 = time.perf_counter()
        gone = set(finishing)
        self._prepare_next([s for s in running if s.rid not in gone], gone, overlapped=True)
        self.step.refresh_seconds, self.step.prepare_seconds = t1 - t0, time.perf_counter() - t2

    def _ahead(self, s: RequestState, tokens: int, ahead: int | None = None) -> int:
        """Tokens ``s`` may hold ``ahead`` tokens (None: ``lookahead_tokens``) past ``tokens``: never
        past its last token (a request about to finish needs no more blocks; provisioning past its end demoted
        experts for KV nobody would use)."""
        ahead = self.cfg.lookahead_tokens if ahead is None else ahead
        return min(tokens + ahead, s.total_tokens)

    def reload(self, overlapped: bool = False) -> None:
        """Sustained slack -> start reloads (SPEC section 6); the runner's copies wait for the running step."""
        if self.planner is None or not self.planner.cfg.movement:
            return
        free = self.alloc.num_free
        cfgp = self.planner.cfg
        if free <= cfgp.reload_threshold or self.planner.pressure(free, self.kv_block_bytes) > 0:
            return
        t0 = time.perf_counter()
        # reload only into what the next steps will not need: the blocks the running requests take within
        # ``reload_reserve_tokens`` (None: up to their last token) and those of the requests about to be admitted
        # (prompts + lookahead). With a reserve as long as the demotion's lookahead, planes lowered at a KV peak
        # come back as the load eases (evaluation's text suite at U3.5: WikiText-2 / C4 +2.7% / +1.5% against
        # 16-bit, to-the-last-token +4.7% / +2.9%), at about twice the blocks moved
        slots = max(0, self.cfg.max_batch - len(self.scheduler.running))
        soon = sum(self.tables.extra_blocks(s.rid, self._ahead(s, len(s.tokens)))
                   for s in list(self.scheduler.waiting)[:slots])
        reserve = self.cfg.reload_reserve_tokens
        soon += sum(self.tables.extra_blocks(s.rid, s.total_tokens if reserve is None else
                                             self._ahead(s, s.computed, reserve))
                    for s in self.scheduler.running)
        allowance = (free - cfgp.reload_threshold - soon) * self.kv_block_bytes
        if self.cap_pages is not None:
            allowance = min(allowance, (self.cap_pages - self.wpt.weight_pages()) * self.pool.cfg.page_bytes)
        # the head of the plan (benefit-per-byte order), kept across steps while it holds
        plan = self.planner.next_raises(self.wpt.q, allowance, self.movable(), self.cfg.max_raise_blocks)
        self._planner_time(t0, overlapped)
        t1 = time.perf_counter()
        if not plan.empty:
            self.step.reload_started_blocks += len(self.begin_raise(plan.blocks, plan.to_bits))
        self.step.raise_plan_seconds, self.step.raise_start_seconds = t1 - t0, time.perf_counter() - t1

    def begin_raise(self, blocks: np.ndarray, to_bits: np.ndarray) -> list[int]:
        """Take pages for the listed raises in order, up to the first that does not fit; returns those started."""
        started: list[int] = []
        orders = []
        for i, b in zip(blocks.tolist(), to_bits.tolist(), strict=True):
            o = self.wpt.begin_raise(self.pool, i, b)
            if o is None:
                break  # no room for this one: later raises are worth less per byte
            started.append(i)
            orders += o
        if started:
            batch = self._next_batch
            self._next_batch += 1
            self._pending[batch] = tuple(started)
            self.moves.reloads.append(Reload(batch, tuple(started), tuple(orders)))
        return started

    def commit(self, batches: Iterable[int]) -> list[int]:
        """Commit the reload batches whose copies completed (step boundary); returns the blocks raised."""
        done: list[int] = []
        for batch in batches:
            for i in self._pending.pop(batch):
                self.wpt.finish_raise(self.pool, i)
                done.append(i)
        self.moves.committed += done
        self.promoted_blocks += len(done)
        return done

    def _next_need(self, running: list[RequestState], gone: set[int] | None = None) -> int:
        """Bytes to free for the pressure expected ``lookahead_tokens`` from now: KV blocks the ``running`` requests
        will take, minus the free ones and those that the ``gone`` requests will release."""
        assert self.planner is not None
        ahead = sum(self.tables.extra_blocks(s.rid, self._ahead(s, s.computed)) for s in running)
        released = sum(1 for rid in gone or () if rid in self.tables
                       for b in self.tables.table(rid) if self.alloc.refcount(b) == 1)
        blocks = self.planner.cfg.free_threshold + 1 + ahead - self.alloc.num_free - released
        return max(0, blocks) * self.kv_block_bytes

    def _prepare_next(self, running: list[RequestState], gone: set[int] | None = None,
                      overlapped: bool = False) -> None:
        """Queue the demotion plan for ``_next_need`` bytes (the next lowering takes it)."""
        assert self.planner is not None
        t0 = time.perf_counter()
        need = self._next_need(running, gone)
        if need > 0 and not self.planner.is_prepared(self.wpt.q, need, self.movable()):
            self.planner.prepare(self.wpt.q, need, self.movable())
        self._planner_time(t0, overlapped)
