"""Continuous-batching scheduler with preemption by recomputation (control plane: no torch).

What it does: keeps waiting and running sequences; each step it gives every running sequence its
next chunk (one token when decoding, the next piece of the prompt when prefilling, within a
per-step token budget: chunked prefill), then admits waiting requests in arrival order while the
batch has room. KV blocks come from a ``KVCapacity`` (the engine core), which may demote expert
weights to make room (the planner). When even that cannot make room, the newest running sequence
is preempted: its blocks are freed and it goes back to the front of the queue to be recomputed
later from its prompt and the tokens it already produced (as vLLM does). Nothing is dropped or
truncated. It does not run the model or sample.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from pwrun.core.request import FinishReason


@dataclass(eq=False)
class RequestState:
    """The scheduler's state of one request: ``prompt`` and generated ``out`` token ids; ``computed`` tokens have
    K/V in the cache (private to the engine core: callers get ``RequestOutput``s)."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    out: list[int] = field(default_factory=list)
    computed: int = 0
    finish: FinishReason | None = None  # "eos", "length" or "abort" once done
    preemptions: int = 0
    forced: list[int] | None = None  # teacher forcing: these tokens are fed instead of sampled ones
    logprobs: list[float] = field(default_factory=list)  # log p(forced token) at each step (nats)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def total_tokens(self) -> int:
        """Tokens this request can ever hold in the KV cache (prompt + all generated but the last)."""
        return len(self.prompt) + self.max_new_tokens - 1


@dataclass(frozen=True)
class Chunk:
    """Tokens ``token_ids`` of request ``rid`` at positions ``start ..``; ``last`` if it ends the known tokens."""

    rid: int
    start: int
    token_ids: tuple[int, ...]
    last: bool


@dataclass
class StepPlan:
    chunks: list[Chunk]
    admitted: list[int]
    preempted: list[int]


class KVCapacity(Protocol):
    """What the scheduler needs from the engine's KV side."""

    def blocks_needed(self, rid: int, num_tokens: int) -> int: ...

    def admission_blocks(self, rid: int, num_tokens: int) -> int:
        """Blocks' worth of free pages a waiting request of ``num_tokens`` known tokens needs to be admitted."""

    def make_room(self, blocks: int) -> bool:
        """True once ``blocks`` KV blocks are free (may demote expert weights first)."""

    def reserve(self, rid: int, num_tokens: int) -> None: ...

    def free(self, rid: int) -> None: ...


class Scheduler:
    """At most ``max_batch`` running sequences and ``max_step_tokens`` tokens per step."""

    def __init__(self, max_batch: int, max_step_tokens: int) -> None:
        if max_batch < 1 or max_step_tokens < 1:
            raise ValueError("max_batch and max_step_tokens must be >= 1")
        self.max_batch, self.max_step_tokens = max_batch, max_step_tokens
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.preemptions = 0
        self.recomputed_tokens = 0  # tokens whose KV a preemption discarded: computed again after re-admission

    def add(self, seq: RequestState) -> None:
        self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _preempt(self, kv: KVCapacity, plan: StepPlan) -> RequestState:
        victim = self.running.pop()
        kv.free(victim.rid)
        self.recomputed_tokens += victim.computed
        victim.computed = 0
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)
        plan.preempted.append(victim.rid)
        plan.chunks = [c for c in plan.chunks if c.rid != victim.rid]
        return victim

    def _chunk(self, s: RequestState, budget: int) -> Chunk:
        toks = s.tokens
        n = min(len(toks) - s.computed, max(budget, 1))
        end = s.computed + n
        return Chunk(s.rid, s.computed, tuple(toks[s.computed:end]), end == len(toks))

    def schedule(self, kv: KVCapacity) -> StepPlan:
        """The chunks of the next step (in running order), after any preemption and admission."""
        plan = StepPlan([], [], [])
        budget = self.max_step_tokens
        i = 0
        while i < len(self.running):
            s = self.running[i]
            if budget <= 0 and len(s.tokens) - s.computed > 1:
                i += 1  # a prefill waits for the next step's budget; decodes always run
                continue
            c = self._chunk(s, budget)
            need = kv.blocks_needed(s.rid, c.start + len(c.token_ids))
            victim = None
            while not kv.make_room(need):
                victim = self._preempt(kv, plan)
                if victim is s:
                    break
            if victim is s:
                break
            kv.reserve(s.rid, c.start + len(c.token_ids))
            plan.chunks.append(c)
            budget -= len(c.token_ids)
            i += 1
        while self.waiting and len(self.running) < self.max_batch and budget > 0:
            s = self.waiting[0]
            c = self._chunk(s, budget)
            # admission: room for the pages all the tokens it has will hold (the rest of a chunked prefill too; with
            # sliding-window layers, blocks behind the window keep only their global pages); room for the first chunk
            # only let a request in whose next chunks then preempted it (prefilled, preempted and re-admitted over
            # and over near the smallest budgets)
            if not kv.make_room(kv.admission_blocks(s.rid, len(s.tokens))):
                break
            kv.reserve(s.rid, c.start + len(c.token_ids))
            self.waiting.popleft()
            self.running.append(s)
            plan.chunks.append(c)
            plan.admitted.append(s.rid)
            budget -= len(c.token_ids)
        if not plan.chunks and self.running:
            raise RuntimeError("scheduler made no progress with sequences running (KV capacity below one request)")
        return plan

    def finish(self, s: RequestState, kv: KVCapacity) -> None:
        """Retire a finished sequence and free its blocks."""
        self.running.remove(s)
        kv.free(s.rid)

    def abort(self, s: RequestState, kv: KVCapacity) -> None:
        """Drop ``s`` wherever it is (waiting or running) and free its blocks."""
        if s in self.running:
            self.running.remove(s)
        elif s in self.waiting:
            self.waiting.remove(s)
        kv.free(s.rid)
