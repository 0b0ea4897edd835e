"""The serving loop: scheduler + planner + mover + model, one step at a time (SPEC sections 5 and 6).

What it does: each step (a safe boundary) it (1) commits reloads whose copies completed, (2) asks
the scheduler for the step's chunks, making KV room by demoting expert blocks when the planner
allows (``make_room``), else preempting, (3) runs the model over the paged KV cache with the AP
experts, (4) samples, retires finished requests, (5) feeds the live routing statistics to the
planner, then acts on KV pressure D (Eq. 7): lower blocks (the prepared plan) when free blocks fall
to the threshold, start reloads when they stay above the higher threshold (hysteresis), and
prepares the plan the next steps will need. It records one trace row per step and the totals of
the summary. With ``debug_checks`` it asserts, after every step, page conservation and
q_i <= resident planes. It owns no policy of its own: the planner is None for static policies.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pwrun.engine.experts import ExpertStore
from pwrun.engine.graphs import DecodeGraphs
from pwrun.engine.kv_store import PooledKVCache
from pwrun.engine.scheduler import Scheduler, Sequence, StepPlan
from pwrun.kv.blocks import BlockTables, blocks_needed
from pwrun.kv.pooled import PooledBlockAllocator
from pwrun.model.inventory import SHARED_EXPERT
from pwrun.model.lean import LeanMoEModel
from pwrun.model.step import SeqChunk, StepTensors
from pwrun.planner.runtime import Planner
from pwrun.pool.pages import KV, WEIGHT, PagePool
from pwrun.sampling import SamplingParams, sample

HOST_PHASES = ("poll", "refresh", "raise_plan", "raise_start", "prepare")  # per-step host timings in the trace



def _no_actions() -> dict[str, int]:
    """A step's planner actions before it runs: blocks lowered, blocks being raised, and D (trace columns)."""
    return {"lowered": 0, "raising": 0, "D": 0}


@dataclass(frozen=True)
class EngineConfig:
    """``max_batch`` running requests; ``max_step_tokens`` tokens per step (chunked prefill);
    ``lookahead_tokens``: tokens per running request the prepared plan provisions for; ``cuda_graphs``:
    replay decode steps from CUDA graphs (CUDA only); ``stats_every``: steps between reads of the live
    routing statistics (each read is a small device -> host copy); ``max_raise_blocks``: blocks whose
    reload may start in one step (spreads the host-side copy launches over steps); ``fused_kernels``:
    on CUDA, the Triton kernels for residual+RMSNorm, RoPE+KV write and routing+statistics instead of
    the eager ops (``kernels/fused_norm.py``, ``rope_kv.py``, ``route_topk.py``); ``precompile_workers``: on CUDA,
    processes that compile the decode MoE kernels for 1..``max_batch`` tokens before the page pool is allocated
    (``kernels/warmup.py``; -1: one per CPU core up to 8, 0: compile on first use)."""

    block_size: int = 16
    max_batch: int = 16
    max_step_tokens: int = 512
    lookahead_tokens: int = 32
    debug_checks: bool = False
    cuda_graphs: bool = True
    stats_every: int = 4
    max_raise_blocks: int = 16
    fused_kernels: bool = True
    precompile_workers: int = -1

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_batch < 1 or self.max_step_tokens < 1 or self.lookahead_tokens < 0:
            raise ValueError("block_size, max_batch and max_step_tokens must be >= 1, lookahead_tokens >= 0")
        if (not isinstance(self.precompile_workers, int) or isinstance(self.precompile_workers, bool)
                or self.precompile_workers < -1):
            raise ValueError(f"precompile_workers must be -1 (one per core, up to 8), 0 (off) or a process count, "
                             f"got {self.precompile_workers}")


@dataclass
class Totals:
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    demoted_blocks: int = 0
    promoted_blocks: int = 0
    preemptions: int = 0
    planner_seconds: float = 0.0  # on the step's critical path (host, with the device idle or waiting)
    planner_overlapped_seconds: float = 0.0  # while the device computed a step (CUDA; on CPU nothing overlaps)
    planner_calls: int = 0
    seconds: float = 0.0
    trace: list[dict[str, Any]] = field(default_factory=list)


class Engine:
    """Serves ``Sequence``s with ``model`` (non-expert weights) and ``store`` (AP experts in ``pool``)."""

    def __init__(self, model: LeanMoEModel, store: ExpertStore, pool: PagePool, memory: torch.Tensor,
                 planner: Planner | None, cfg: EngineConfig, params: SamplingParams, eos: set[int]) -> None:
        self.model, self.store, self.pool, self.planner, self.cfg = model, store, pool, planner, cfg
        self.params, self.eos = params, eos
        model.fused = cfg.fused_kernels
        store.observe = planner is not None and planner.stats is not None  # nobody else reads them
        spec = model.spec
        a = spec.layers[0].attention
        self.alloc = PooledBlockAllocator(pool, spec.num_layers)
        self.tables = BlockTables(self.alloc, cfg.block_size)
        self.cache = PooledKVCache(memory, self.alloc, cfg.block_size, a.num_kv_heads, a.head_dim, model.dtype)
        self.kv_block_bytes = 2 * spec.num_layers * pool.cfg.page_bytes
        # weights per block, split into shared-expert blocks (read by every token) and routed ones (trace only)
        size = np.array([n * k for n, k in store.shape], dtype=np.float64)
        shared = np.array([e == SHARED_EXPERT for _, e, _ in store.key], dtype=bool)
        self._bit_weights = (size * shared, size * ~shared)
        self.scheduler = Scheduler(cfg.max_batch, cfg.max_step_tokens)
        self.seqs: dict[int, Sequence] = {}
        self.gens: dict[int, torch.Generator] = {}
        self.totals = Totals()
        self.on_token: Callable[[Sequence], None] | None = None
        # wait for the compute stream only: reload copies on the side stream go on across step boundaries
        self._sync = torch.cuda.current_stream(model.device).synchronize if model.device.type == "cuda" \
            else (lambda: None)
        self.graphs: DecodeGraphs | None = None
        self._captured = False
        self._phases = (0.0, 0.0)
        self._planner_at_start = (0.0, 0.0)  # Totals' planner seconds when the current step began
        self._no_room: tuple[Any, ...] | None = None  # ``_room_key`` of the last request for room that failed
        self._step_actions = _no_actions()  # this step's planner actions
        self._reload_s = 0.0
        # host seconds of this step's overlapped work by phase (what a step that moves planes spends its host on)
        self._host_s: dict[str, float] = {}
        # commit and start reloads and refresh d_hat while the device computes each step (host work hidden; CUDA),
        # or after sampling, where they see the blocks just freed (CPU: nothing runs concurrently)
        self._overlap = planner is not None and bool(planner.cfg.overlapped)

    # ------------------------------------------------------------------ KVCapacity
    def blocks_needed(self, rid: int, num_tokens: int) -> int:
        return self.tables.extra_blocks(rid, num_tokens)

    def make_room(self, blocks: int) -> bool:
        """Free KV blocks until ``blocks`` are free by lowering expert bitwidths (SPEC section 5, Algorithm 1's
        lowering under KV pressure, for room the scheduler asks for), all or nothing: a demotion plan
        that cannot free enough is not executed (the scheduler then preempts, or leaves the request waiting;
        lowering part of the way would only demote blocks that the reloads raise again). A request for room that
        failed is not planned again while nothing that decides it changed (free blocks, bitwidths, blocks in
        motion, routing buckets): a waiting request that does not fit costs the steps after it no planning."""
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
        """(KV blocks missing, bit indices [n], movable [n], routing buckets [n]): what decides whether ``make_room``
        can succeed (a plan that fell short took every movable block to its bucket's last floor)."""
        assert self.planner is not None
        b = self.planner.buckets
        return (blocks - self.alloc.num_free, self.q_idx(), self.store.movable(), None if b is None else b.copy())

    def reserve(self, rid: int, num_tokens: int) -> None:
        self.tables.reserve(rid, num_tokens)

    def free(self, rid: int) -> None:
        self.tables.free(rid)

    # ------------------------------------------------------------------ planner actions
    def q_idx(self) -> np.ndarray:
        return np.searchsorted(self.store.table.bits, self.store.wpt.q)

    def _lower(self, need_bytes: int, whole: bool = False) -> bool:
        """Execute the demotion plan for ``need_bytes`` (``whole``: only if it frees all of them); whether it ran."""
        assert self.planner is not None
        t0 = time.perf_counter()
        plan = self.planner.take(self.q_idx(), need_bytes, self.store.movable())
        self._planner_time(t0)
        if plan.empty or (whole and plan.freed < need_bytes):
            return False
        self.store.lower(plan.blocks, self.store.table.bits[plan.to_idx])
        self.totals.demoted_blocks += int(plan.blocks.size)
        self._step_actions["lowered"] += int(plan.blocks.size)
        return True

    def _planner_time(self, t0: float, overlapped: bool = False) -> None:
        dt = time.perf_counter() - t0
        if overlapped:
            self.totals.planner_overlapped_seconds += dt
        else:
            self.totals.planner_seconds += dt
        self.totals.planner_calls += 1

    def _ahead(self, s: Sequence, tokens: int) -> int:
        """Tokens ``s`` may hold ``lookahead_tokens`` from now: never past its last token (a request about to
        finish needs no more blocks; provisioning past its end demoted experts for KV nobody would use)."""
        return min(tokens + self.cfg.lookahead_tokens, s.total_tokens)

    def _after_step(self) -> None:
        """After sampling: pressure (Eq. 7) -> lower (on CPU: else reload); then prepare the next plan."""
        if self.planner is None:
            return
        free = self.alloc.num_free
        d = self.planner.pressure(free, self.kv_block_bytes)
        self._step_actions["D"] = d
        if d > 0:
            self._lower(d)
        elif not self._overlap:
            self._reload()
        if not self._overlap:  # CUDA: prepared while the device computed the step (``_plan_overlapped``)
            self._prepare_next()

    def _plan_overlapped(self, plan: StepPlan) -> None:
        """Planner work done while the device computes the step just launched (host work hidden behind it):
        d_hat from the latest live statistics, reloads, and the demotion plan that this step's ``_after_step``
        (or the next admission) takes, computed as if the requests that reach their length limit in this step
        had already freed their blocks (else it would demote for blocks about to be freed)."""
        if self.planner is None:
            return
        t0 = time.perf_counter()
        self.planner.refresh_if_stale()
        self._planner_time(t0, overlapped=True)
        t1 = time.perf_counter()
        self._reload(overlapped=True)
        t2 = time.perf_counter()
        self._prepare_next(self._finishing(plan), overlapped=True)
        self._host_s.update(refresh=t1 - t0, prepare=time.perf_counter() - t2)

    def _finishing(self, plan: StepPlan) -> list[Sequence]:
        """Requests that sample their last token (length limit) in ``plan``'s step; an EOS is not foreseen."""
        return [s for c in plan.chunks if c.last and len((s := self.seqs[c.rid]).out) + 1 >= s.max_new_tokens]

    def _reload(self, overlapped: bool = False) -> None:
        """Sustained slack -> start reloads (SPEC section 6); the copies wait for the running step on the side
        stream."""
        if self.planner is None or not self.planner.cfg.movement:
            return
        free = self.alloc.num_free
        cfgp = self.planner.cfg
        if free <= cfgp.reload_threshold or self.planner.pressure(free, self.kv_block_bytes) > 0:
            return
        t0 = time.perf_counter()
        # reload only what no request will need: keep the blocks the running requests may still take up
        # to their last token, and those of the requests about to be admitted (prompts + lookahead);
        # a narrower margin made the planner demote and reload the same blocks over and over
        slots = max(0, self.cfg.max_batch - len(self.scheduler.running))
        soon = sum(self.tables.extra_blocks(s.rid, self._ahead(s, len(s.tokens)))
                   for s in list(self.scheduler.waiting)[:slots])
        soon += sum(self.tables.extra_blocks(s.rid, len(s.prompt) + s.max_new_tokens)
                    for s in self.scheduler.running)
        allowance = (free - cfgp.reload_threshold - soon) * self.kv_block_bytes
        # the head of the plan (benefit-per-byte order), kept across steps while it holds
        plan = self.planner.next_raises(self.q_idx(), allowance, self.store.movable(), self.cfg.max_raise_blocks)
        self._planner_time(t0, overlapped)
        t1 = time.perf_counter()
        if not plan.empty:
            started = self.store.begin_raise(plan.blocks, self.store.table.bits[plan.to_idx])
            self._step_actions["raising"] += len(started)
        self._host_s.update(raise_plan=t1 - t0, raise_start=time.perf_counter() - t1)

    def _next_need(self, finishing: list[Sequence] | None = None) -> int:
        """Bytes to free for the pressure expected ``lookahead_tokens`` from now: KV blocks the running requests
        will take, minus the free ones and those that the ``finishing`` requests will release."""
        assert self.planner is not None
        gone = {s.rid for s in finishing or ()}
        ahead = sum(self.tables.extra_blocks(s.rid, self._ahead(s, s.computed))
                    for s in self.scheduler.running if s.rid not in gone)
        released = sum(1 for rid in gone if rid in self.tables
                       for b in self.tables.table(rid) if self.alloc.refcount(b) == 1)
        blocks = self.planner.cfg.free_threshold + 1 + ahead - self.alloc.num_free - released
        return max(0, blocks) * self.kv_block_bytes

    def _prepare_next(self, finishing: list[Sequence] | None = None, overlapped: bool = False) -> None:
        """Queue the demotion plan for ``_next_need(finishing)`` bytes (the next lowering takes it)."""
        assert self.planner is not None
        t0 = time.perf_counter()
        need = self._next_need(finishing)
        if need > 0 and not self.planner.is_prepared(self.q_idx(), need, self.store.movable()):
            self.planner.prepare(self.q_idx(), need, self.store.movable())
        self._planner_time(t0, overlapped)

    # ------------------------------------------------------------------ requests and steps
    def add(self, seq: Sequence) -> None:
        self.seqs[seq.rid] = seq
        self.gens[seq.rid] = torch.Generator().manual_seed(self.params.seed + seq.rid)
        self.scheduler.add(seq)

    def _run(self, plan: StepPlan) -> torch.Tensor:
        chunks = []
        for c in plan.chunks:
            end = c.start + len(c.token_ids)
            chunks.append(SeqChunk(c.rid, c.token_ids, c.start, tuple(self.tables.slots(c.rid, c.start, end)),
                                   tuple(self.tables.table(c.rid))))
            self.seqs[c.rid].computed = end
        self.cache.map_blocks()
        step = StepTensors.build(chunks, self.model.device)
        if self.cfg.cuda_graphs and self.model.device.type == "cuda" and step.decode_only:
            if self.graphs is None:
                width = max(blocks_needed(len(s.prompt) + s.max_new_tokens, self.cfg.block_size)
                            for s in self.seqs.values())
                self.graphs = DecodeGraphs(self.model, self.cache, self.store.moe, width,
                                           [self.store.mass_acc, self.store.norm_acc])
            if self.graphs.fits(step):
                before = len(self.graphs.sizes)
                out = self.graphs.run(step)
                self._captured = len(self.graphs.sizes) > before
                return out
        return self.model.forward(step, self.cache, logits_for="last", moe=self.store.moe)  # type: ignore[arg-type]

    def step(self) -> None:
        """One engine step (raises ``RuntimeError`` if no progress is possible)."""
        t_step = time.perf_counter()
        self._planner_at_start = (self.totals.planner_seconds, self.totals.planner_overlapped_seconds)
        self._step_actions = _no_actions()
        self._host_s = {}
        self._captured = False
        raised: list[int] = [] if self._overlap else self.store.poll()  # CPU: copies are done, commit now
        plan = self.scheduler.schedule(self)
        if not plan.chunks:
            raise RuntimeError("no request fits in the KV cache even with every expert at its floor")
        t_model = time.perf_counter()
        logits = self._run(plan)
        t_launched = time.perf_counter()
        # while the device computes: commit the reloads whose copies are done (their tables change after this
        # step's kernels in stream order, so the next step reads them) and start new ones
        if self._overlap:
            raised = self.store.poll()
            self._host_s["poll"] = time.perf_counter() - t_launched
            self._plan_overlapped(plan)
        self.totals.promoted_blocks += len(raised)
        self._reload_s = time.perf_counter() - t_launched
        self._sync()  # sampling synchronises right after anyway; this makes the model's time measurable
        self._model_s = time.perf_counter() - t_model
        if self.planner is not None and self.planner.stats is not None and \
                self.totals.steps % self.cfg.stats_every == 0:
            mass, acc = self.store.take_stats()
            self.planner.stats.update(mass, acc)
            self.planner.stale = True
        for c, row in zip(plan.chunks, logits, strict=True):
            s = self.seqs[c.rid]
            if len(c.token_ids) == 1 and c.start >= len(s.prompt) and c.last:
                self.totals.decode_tokens += 1
            else:
                self.totals.prefill_tokens += len(c.token_ids)
            if not c.last:
                continue
            if s.forced is not None:  # teacher-forced scoring: the precision in force now is what is scored
                tok = s.forced[len(s.out)]
                s.logprobs.append(float(torch.log_softmax(row.float(), dim=-1)[tok]))
            else:
                tok = int(sample(row[None], self.params, self.gens[c.rid])[0])
            if tok in self.eos and s.forced is None:
                s.finish = "eos"
            else:
                s.out.append(tok)
                if len(s.out) >= s.max_new_tokens:
                    s.finish = "length"
            if self.on_token is not None:
                self.on_token(s)
            if s.finish is not None:
                self.scheduler.finish(s, self)
        t_after = time.perf_counter()
        self._after_step()
        t_sync = time.perf_counter()
        self._sync()
        self._phases = (t_sync - t_after, time.perf_counter() - t_sync)
        if self.cfg.debug_checks:
            self.check()
        dt = time.perf_counter() - t_step
        self.totals.steps += 1
        self.totals.seconds += dt
        self.totals.preemptions = self.scheduler.preemptions
        self._trace(plan, dt, len(raised))

    def _trace(self, plan: StepPlan, dt: float, raised: int) -> None:
        w = self.store.wpt
        self.totals.trace.append({
            "step": self.totals.steps, "seconds": dt, "model_seconds": self._model_s,
            "graph_captured": self._captured,  # this step captured a CUDA graph (one-off cost: warm-up + capture)
            # host seconds in: planner + lowering after sampling, waiting for the device at the end
            "after_seconds": self._phases[0], "sync_seconds": self._phases[1],
            "reload_seconds": self._reload_s,  # committing + planning + starting reloads, overlapped with compute
            # planner seconds of this step (as in Totals): on the critical path (scheduling's demotions and those
            # after sampling) and while the device computed
            "planner_seconds": self.totals.planner_seconds - self._planner_at_start[0],
            "planner_overlapped_seconds": self.totals.planner_overlapped_seconds - self._planner_at_start[1],
            # host seconds by phase (0: did not run): poll (commit finished reloads, table writes), refresh
            # (d_hat), raise_plan, raise_start (page table + copy launches), prepare (next demotion plan)
            **{f"{k}_seconds": self._host_s.get(k, 0.0) for k in HOST_PHASES},
            "free_blocks": self.alloc.num_free,
            "kv_pages": self.pool.count(KV), "weight_pages": self.pool.count(WEIGHT), "free_pages": self.pool.num_free,
            "pressure_bytes": int(self._step_actions["D"]), "lowered": self._step_actions["lowered"],
            "raise_started": self._step_actions["raising"], "raised": raised,
            "mean_bits": float(w.q.mean()), "weight_bytes": int(w.weight_pages() * self.pool.cfg.page_bytes),
            "committed_weight_bytes": int(w.pages_at(w.q).sum() * self.pool.cfg.page_bytes),
            "bytes_in_flight": self.store.in_flight_bytes(), "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting), "preempted": len(plan.preempted),
            "step_tokens": sum(len(c.token_ids) for c in plan.chunks),
            "bits_hist": np.bincount(w.q, minlength=9).tolist(),
            # committed bits per weight of the shared-expert blocks (every token reads them; nan: none) and of
            # the routed blocks (a token reads top-k of them): what a decode step reads, unlike mean_bits
            **{k: float(np.dot(w.q, m) / m.sum()) if m.any() else float("nan")
               for k, m in zip(("shared_bits", "routed_bits"), self._bit_weights, strict=True)},
            "device_peak_bytes": int(torch.cuda.max_memory_allocated()) if self.model.device.type == "cuda" else 0,
        })

    def check(self) -> None:
        """Page conservation, q <= resident planes, KV pages = KV blocks in use (``AssertionError`` if not)."""
        self.pool.check()
        self.store.wpt.check()
        assert self.pool.count(KV) == 2 * self.model.spec.num_layers * self.alloc.num_used
        assert self.pool.count(WEIGHT) == self.store.wpt.weight_pages()

    def run(self) -> None:
        """Step until every added request has finished."""
        while not self.scheduler.idle:
            self.step()
