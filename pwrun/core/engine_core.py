"""The engine core: requests, scheduling, KV blocks and the weight policy, one step at a time (SPEC 5, 6).

What it does: accepts requests at any time (``add_request``) and drops them (``abort``: their KV pages
return to the pool). ``step`` commits the reloads the runner reports complete, asks the scheduler for
the step's chunks (making KV room by demoting expert blocks when the planner allows, else preempting)
and returns one ``StepDecision``. After the runner computed and sampled, ``update`` takes the sampled
(or forced) tokens, retires finished requests, feeds the live routing statistics to the planner
(``observe_routing``) and applies the weight policy after sampling; the weight moves it makes go to the
runner through ``take_moves``. With overlapped planning (CUDA) ``while_computing`` does the planner's
work while the device computes. It never touches tensors: the page pool, the weight page table, the
KV block tables and the planner are numpy and ints; the runner mirrors them on the device. On a model
with sliding-window layers, ``update`` gives back the sliding layers' pages of every block that has left
its sequence's window (``BlockTables.trim``), so the planner sees them as free pages at once.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pwformat.kv_layout import KVLayout
from pwrun.core.config import EngineConfig
from pwrun.core.decision import ScheduledChunk, StepDecision, WeightMoves
from pwrun.core.kv_blocks import BlockTables, PooledBlockAllocator, blocks_needed
from pwrun.core.planner.runtime import Planner
from pwrun.core.pool import KV, WEIGHT, PagePool
from pwrun.core.request import Request, RequestOutput
from pwrun.core.scheduler import Chunk, RequestState, Scheduler
from pwrun.core.weight_policy import StepActions, WeightPolicy
from pwrun.core.weight_table import WeightPageTable


class EngineCore:
    """Requests over ``pool`` (KV blocks laid out as ``layout``, or of that many uniform layers; expert blocks of
    ``weights`` if given, moved by ``planner`` if given: None for static policies and for 16-bit experts outside
    the pool)."""

    def __init__(self, cfg: EngineConfig, pool: PagePool, layout: int | KVLayout,
                 weights: WeightPageTable | None = None, planner: Planner | None = None) -> None:
        self.cfg, self.pool = cfg, pool
        self.alloc = PooledBlockAllocator(pool, layout)
        self.layout, self.num_layers = self.alloc.layout, self.alloc.num_layers
        self.tables = BlockTables(self.alloc, cfg.block_size)
        self.kv_block_bytes = self.alloc.block_pages * pool.cfg.page_bytes  # B_KV of Eq. 7
        self.trimmed_blocks = 0  # blocks that gave back their sliding-window pages in the last ``update``
        self.scheduler = Scheduler(cfg.max_batch, cfg.max_step_tokens)
        self.wpt = weights
        self.planner = planner
        self.weights = None if weights is None else WeightPolicy(
            weights, pool, planner, cfg, self.alloc, self.tables, self.scheduler, self.kv_block_bytes)
        self.requests: dict[int, RequestState] = {}
        self._eos: dict[int, frozenset[int]] = {}
        self.steps = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.max_table_blocks = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue ``request`` (``ValueError`` if its id is in use)."""
        if request.rid in self.requests:
            raise ValueError(f"request id {request.rid} is already in use")
        s = RequestState(request.rid, list(request.prompt), request.budget,
                         forced=None if request.forced is None else list(request.forced))
        self.requests[request.rid] = s
        self._eos[request.rid] = request.eos
        self.max_table_blocks = max(self.max_table_blocks, blocks_needed(s.total_tokens + 1, self.cfg.block_size))
        self.scheduler.add(s)

    def abort(self, rid: int) -> RequestOutput:
        """Stop request ``rid`` now (its KV pages return to the pool); its output so far, finished "abort"."""
        s = self.requests[rid]
        if s.finish is None:
            self.scheduler.abort(s, self)
            s.finish = "abort"
        return self.output(rid)

    def forget(self, rid: int) -> None:
        """Drop the record of finished request ``rid`` (a long-running server would otherwise keep every one)."""
        if self.requests[rid].finish is None:
            raise ValueError(f"request {rid} has not finished: abort it first")
        del self.requests[rid], self._eos[rid]

    def output(self, rid: int) -> RequestOutput:
        s = self.requests[rid]
        return RequestOutput(rid, tuple(s.out), len(s.prompt), s.finish, tuple(s.logprobs),
                             s.preemptions)

    @property
    def idle(self) -> bool:
        """No request waits or runs."""
        return self.scheduler.idle

    # ------------------------------------------------------------------ KVCapacity (the scheduler's view)
    def blocks_needed(self, rid: int, num_tokens: int) -> int:
        return self.tables.extra_blocks(rid, num_tokens)

    def admission_blocks(self, rid: int, num_tokens: int) -> int:
        """Whole blocks' worth of the pages ``rid`` will hold at most while its ``num_tokens`` tokens are computed
        (``KVLayout.peak_pages``: with sliding-window layers, blocks behind the window hold only global pages)."""
        need = self.tables.extra_blocks(rid, num_tokens)
        return min(need, self.layout.peak_blocks(num_tokens, self.cfg.block_size, self.cfg.max_step_tokens))

    def make_room(self, blocks: int) -> bool:
        if self.weights is None:
            return self.alloc.num_free >= blocks
        return self.weights.make_room(blocks)

    def reserve(self, rid: int, num_tokens: int) -> None:
        self.tables.reserve(rid, num_tokens)

    def free(self, rid: int) -> None:
        self.tables.free(rid)

    # ------------------------------------------------------------------ the step
    def step(self, reloads_done: Iterable[int] = ()) -> StepDecision:
        """The next step's decision. ``reloads_done``: reload batches whose copies the runner saw complete (their
        blocks commit first). Raises ``RuntimeError`` if no request can run (nothing fits the KV cache even with
        every expert at its floor, or no request waits or runs)."""
        if self.idle:
            raise RuntimeError("no request waits or runs (none was added, every one has finished, or the next has not "
                               "arrived yet): step only while the engine is not idle")
        if self.weights is not None:
            self.weights.step = StepActions()
            self.weights.commit(reloads_done)
        plan = self.scheduler.schedule(self)
        if not plan.chunks:
            raise RuntimeError("no request fits in the KV cache even with every expert at its floor")
        chunks = tuple(self._chunk(c) for c in plan.chunks)
        new = self.alloc.new_blocks
        kv = tuple((b, tuple(self.alloc.pages(b))) for b in new)
        new.clear()
        return StepDecision(chunks, tuple(plan.preempted), tuple(plan.admitted), kv, self.take_moves(),
                            self.max_table_blocks)

    def _chunk(self, c: Chunk) -> ScheduledChunk:
        s = self.requests[c.rid]
        start, toks, last = c.start, c.token_ids, c.last
        end = start + len(toks)
        s.computed = end
        forced = s.forced[len(s.out)] if last and s.forced is not None else None
        return ScheduledChunk(s.rid, toks, start, tuple(self.tables.slots(s.rid, start, end)),
                              tuple(self.tables.table(s.rid)), last, forced)

    def take_moves(self) -> WeightMoves:
        """Weight page table changes since the runner last took them."""
        return WeightMoves() if self.weights is None else self.weights.take_moves()

    def finishing(self, decision: StepDecision) -> list[int]:
        """Requests that sample their last token (length limit) in ``decision``'s step; an EOS is not foreseen."""
        return [c.rid for c in decision.chunks
                if c.last and len((s := self.requests[c.rid]).out) + 1 >= s.max_new_tokens]

    def while_computing(self, decision: StepDecision, reloads_done: Iterable[int]) -> list[int]:
        """Overlapped planning (CUDA), while the device computes ``decision``'s step: commit ``reloads_done``,
        refresh d_hat, start reloads, prepare the next demotion plan. Returns the blocks committed."""
        if self.weights is None:
            return []
        done = self.weights.commit(reloads_done)
        self.weights.while_computing(self.scheduler.running, self.finishing(decision))
        return done

    @property
    def overlapped(self) -> bool:
        """The planner works while the device computes (``while_computing``), not after sampling."""
        return self.weights is not None and self.weights.overlapped

    @property
    def wants_routing_stats(self) -> bool:
        """A planner reads the live routing statistics (``observe_routing``)."""
        return self.planner is not None and self.planner.stats is not None

    def observe_routing(self, mass: np.ndarray, acc: np.ndarray) -> None:
        """Routing weight sums [L, E+1] and norm accumulators [L, E+1, 4] since the last call (SPEC Eq. 1, 5)."""
        assert self.planner is not None and self.planner.stats is not None
        self.planner.stats.update(mass, acc)
        self.planner.stale = True

    def update(self, decision: StepDecision, sampled: list[int | None],
               logprobs: list[float | None]) -> list[RequestOutput]:
        """Take the step's ``sampled`` tokens (one per chunk; None for a chunk that does not end its request's
        known tokens) and the ``logprobs`` of forced tokens; retire finished requests, then apply the weight policy
        (its moves wait in ``take_moves``). Returns one output per request that got a token."""
        outs = []
        for c, tok, lp in zip(decision.chunks, sampled, logprobs, strict=True):
            s = self.requests[c.rid]
            if len(c.token_ids) == 1 and c.start >= len(s.prompt) and c.last:
                self.decode_tokens += 1
            else:
                self.prefill_tokens += len(c.token_ids)
            if not c.last:
                continue
            if s.forced is not None:  # teacher-forced scoring: the precision in force now is what is scored
                assert lp is not None
                s.logprobs.append(lp)
                tok = s.forced[len(s.out)]
            assert tok is not None
            if tok in self._eos[s.rid] and s.forced is None:
                s.finish = "eos"
            else:
                s.out.append(tok)
                if len(s.out) >= s.max_new_tokens:
                    s.finish = "length"
            if s.finish is not None:
                self.scheduler.finish(s, self)
            outs.append(self.output(s.rid))
        self.trimmed_blocks = self._trim(decision)
        if self.weights is not None:
            self.weights.after_step(self.scheduler.running)
        self.steps += 1
        return outs

    def _trim(self, decision: StepDecision) -> int:
        """Give back the sliding-window pages of the blocks the step's sequences no longer read: a later query
        (position >= the chunk's end) reads keys from end - window + 1 on. Returns the blocks trimmed."""
        window = self.layout.window
        if window is None:
            return 0
        return sum(self.tables.trim(c.rid, c.end - window + 1) for c in decision.chunks)

    @property
    def step_actions(self) -> StepActions:
        return StepActions() if self.weights is None else self.weights.step

    def check(self) -> None:
        """Page conservation, q <= resident planes, KV pages = the pages of the KV blocks in use, trimmed ones
        without their sliding-window pages (``AssertionError`` if not)."""
        self.pool.check()
        assert self.pool.count(KV) == self.alloc.kv_pages
        if self.wpt is not None:
            self.wpt.check()
            assert self.pool.count(WEIGHT) == self.wpt.weight_pages()
