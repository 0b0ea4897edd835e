"""The serving loop: the engine core decides, the model runner executes, one step at a time (SPEC 5, 6).

What it does: each step (a safe boundary) it (1) gives the core the reloads whose copies completed, (2)
takes the core's ``StepDecision`` (chunks, preemptions, demotions made for room), (3) has the runner
mirror the weight moves and launch the forward, and, with overlapped planning (CUDA), lets the core plan
while the device computes, (4) feeds the live routing statistics to the core, samples, and hands the
tokens back (the core retires finished requests and applies the weight policy after sampling, whose
moves the runner mirrors at once). It records one trace row per step (``StepTrace``) and the run totals.
With ``debug_checks`` it asserts page conservation and q_i <= resident planes after every step.

Requests may be given an arrival time (``add_request(..., arrival_s)``, seconds from the start of the run): the
run loop (``run_until_done``) queues each in the core at its time, at a step boundary, and sleeps while nothing
runs and the next arrival is ahead. Per request it records arrival, first scheduled, first token and finish
times (``RequestTimes``, on the engine's ``clock``) for the summary's TTFT, TPOT, queueing time and goodput.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from pwrun.core.engine_core import EngineCore
from pwrun.core.latency import RequestTimes
from pwrun.core.pool import KV, WEIGHT
from pwrun.core.request import Request, RequestOutput
from pwrun.engine.trace import StepTrace
from pwrun.runner.model_runner import ModelRunner

LONG_WAIT_S = 60.0  # an idle wait for an arrival longer than this is announced (``run_until_done``'s ``on_wait``)


class LLMEngine:
    """``core`` + ``runner``; ``info`` describes the build (budget split, policy) for the summary.
    ``bit_weights``: weights per block of the shared-expert and of the routed blocks (for the trace's bits).
    ``clock`` (seconds) and ``sleep`` time the arrivals and the per-request ``times`` (tests give fake ones)."""

    def __init__(self, core: EngineCore, runner: ModelRunner, info: dict[str, Any] | None = None,
                 bit_weights: tuple[np.ndarray, np.ndarray] | None = None,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep) -> None:
        self.core, self.runner = core, runner
        self.info = dict(info or {})
        self._bit_weights = bit_weights
        self.trace: list[StepTrace] = []
        self.seconds = 0.0
        self.outputs: dict[int, RequestOutput] = {}
        self.clock, self.sleep = clock, sleep
        self.times: dict[int, RequestTimes] = {}
        self._t0: float | None = None  # the start of the run on ``clock``: the first call of ``now``
        self._arrived = 0  # requests queued since the last step's trace row
        self.stopped_s: float | None = None  # when a stop (Ctrl-C, SIGTERM) ended ``run_until_done``, seconds from t0
        self._future: list[tuple[float, int, Request]] = []  # (arrival, rid, request): a heap of later arrivals
        # (WeightPageTable.version, its figures) of the last trace row (``_weight_figures``)
        self._weights_key: tuple[int, tuple[float, tuple[int, ...], float, float, int, int]] | None = None
        self.request_rate = math.inf  # the offered rate of the arrivals (requests/s; inf: all at t=0), for the summary

    # ------------------------------------------------------------------ requests
    def now(self) -> float:
        """Seconds since the start of the run (which is the first call of this method)."""
        if self._t0 is None:
            self._t0 = self.clock()
        return self.clock() - self._t0

    def add_request(self, request: Request, arrival_s: float | None = None) -> None:
        """Queue ``request``: now (``arrival_s`` None, any time: it joins the next step it fits), or once the run
        reaches ``arrival_s`` seconds from its start (``run_until_done`` admits it then; ``ValueError`` if the
        id is in use)."""
        if request.rid in self.times or request.rid in self.core.requests:
            raise ValueError(f"request id {request.rid} is already in use")
        if arrival_s is None or (self._t0 is not None and arrival_s <= self.now()):
            self._admit(request, self.now() if arrival_s is None else arrival_s)
        elif self._t0 is None and arrival_s <= 0:
            self._admit(request, 0.0)  # before the run starts: at its first step
        else:
            heapq.heappush(self._future, (arrival_s, request.rid, request))
            self.times[request.rid] = RequestTimes(arrival_s)

    def _admit(self, request: Request, arrival_s: float) -> None:
        self.core.add_request(request)
        self.runner.add_request(request)
        self.outputs[request.rid] = self.core.output(request.rid)
        self.times[request.rid] = RequestTimes(arrival_s)
        self._arrived += 1

    def _take_arrived(self) -> int:
        """Requests queued since the last call (the trace's ``arrived``)."""
        n, self._arrived = self._arrived, 0
        return n

    def _admit_due(self) -> None:
        """Queue every held request whose arrival time has come, in arrival order."""
        now = self.now()
        while self._future and self._future[0][0] <= now:
            arrival, _, request = heapq.heappop(self._future)
            self._admit(request, arrival)

    @property
    def next_arrival(self) -> float | None:
        """Seconds from the start of the run of the next request not queued yet (None: every one is)."""
        return self._future[0][0] if self._future else None

    def abort(self, rid: int) -> RequestOutput:
        """Stop request ``rid``; its pages return to the pool. Returns its output so far (finish "abort")."""
        held = [f for f in self._future if f[1] == rid]
        if held:  # not arrived yet: it never reaches the core
            self._future = [f for f in self._future if f[1] != rid]
            heapq.heapify(self._future)
            del self.times[rid]
            return RequestOutput(rid, (), len(held[0][2].prompt), "abort")
        out = self.core.abort(rid)
        self.runner.release(rid)
        self.outputs[rid] = out
        return out

    def forget(self, rid: int) -> None:
        """Drop finished request ``rid``'s output and records (``EngineCore.forget``); its id may then be reused."""
        self.core.forget(rid)
        self.runner.release(rid)
        self.outputs.pop(rid, None)
        self.times.pop(rid, None)

    def warm_up(self, table_blocks: int) -> None:
        """Compile the step kernels and capture every decode graph before the first request (CUDA with the
        kernels; nothing elsewhere), in a scratch KV block taken from the pool and given back; decode graphs get
        block tables of ``table_blocks`` columns. Records ``warm_up_seconds`` and ``graphs_captured_at_start``."""
        if not self.runner.wants_warm_up:
            return
        t = time.perf_counter()
        alloc, cfg = self.core.alloc, self.core.cfg
        block = alloc.allocate(1)[0]
        alloc.new_blocks.remove(block)  # mapped here, not by the next step's decision
        try:
            n = self.runner.warm_up(block, tuple(alloc.pages(block)), cfg.max_batch, cfg.max_step_tokens,
                                    table_blocks)
        finally:
            alloc.release(block)
        self.info |= {"warm_up_seconds": time.perf_counter() - t, "graphs_captured_at_start": n}

    @property
    def idle(self) -> bool:
        """No request waits, runs or is still to arrive."""
        return self.core.idle and not self._future

    # ------------------------------------------------------------------ steps
    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests that got a token (raises ``RuntimeError`` if no
        progress is possible)."""
        core, runner = self.core, self.runner
        w = core.weights
        t_step = time.perf_counter()
        started = self.now()
        p0 = (0.0, 0.0) if w is None else (w.planner_seconds, w.planner_overlapped_seconds)
        done = [] if core.overlapped else runner.finished_reloads()  # CPU: copies are done, commit now
        decision = core.step(done)
        for rid in decision.admitted:  # first scheduled: the start of the first step that runs it
            if self.times[rid].scheduled is None:
                self.times[rid].scheduled = started
        raised = len(decision.moves.committed)
        t_model = time.perf_counter()
        logits = runner.execute(decision)
        t_launched = time.perf_counter()
        poll_s = 0.0
        if core.overlapped:
            # while the device computes: commit the reloads whose copies are done (their tables change after this
            # step's kernels in stream order, so the next step reads them) and start new ones
            raised += len(core.while_computing(decision, runner.finished_reloads()))
            poll_s = time.perf_counter() - t_launched
            runner.apply(core.take_moves())
        reload_s = time.perf_counter() - t_launched
        runner.sync()  # sampling synchronises right after anyway; this makes the model's time measurable
        model_s = time.perf_counter() - t_model
        if core.wants_routing_stats and core.steps % core.cfg.stats_every == 0:
            core.observe_routing(*runner.take_stats())
        tokens, logprobs = runner.sample(decision, logits)
        t_after = time.perf_counter()
        prefill_before = core.prefill_tokens
        outs = core.update(decision, tokens, logprobs)
        ended = self.now()
        for o in outs:
            self.outputs[o.rid] = o
            t = self.times[o.rid]
            t.tokens = len(o.token_ids)
            if t.first_token is None:
                t.first_token = ended
            if o.finished:
                t.finish = ended
                runner.release(o.rid)
        runner.apply(core.take_moves())
        t_sync = time.perf_counter()
        runner.sync()
        if core.cfg.debug_checks:
            core.check()
        dt = time.perf_counter() - t_step
        self.seconds += dt
        p1 = (0.0, 0.0) if w is None else (w.planner_seconds, w.planner_overlapped_seconds)
        self.trace.append(self._trace(decision.num_tokens, len(decision.preempted), dt, self.now(), model_s,
                                      reload_s, t_sync - t_after, time.perf_counter() - t_sync, p1[0] - p0[0],
                                      p1[1] - p0[1], poll_s, raised, core.prefill_tokens - prefill_before))
        return outs

    def run_until_done(self, on_output: Callable[[RequestOutput], None] | None = None,
                       on_wait: Callable[[float, float], None] | None = None) -> dict[int, RequestOutput]:
        """Step until every request has arrived and finished, queueing each at its arrival time (at the step
        boundary after it; while nothing runs, sleeping until the next one instead of spinning); ``on_output``
        sees every output as it comes; ``on_wait(arrival, seconds to it)`` is called once per idle wait longer than
        ``LONG_WAIT_S`` (not per sleep slice), so that a caller can say why nothing happens. Returns the final output
        of every request by id; a stop records its time in ``stopped_s`` and propagates."""
        try:
            return self._run(on_output, on_wait)
        except KeyboardInterrupt:
            self.stopped_s = self.now()
            raise

    def _run(self, on_output: Callable[[RequestOutput], None] | None,
             on_wait: Callable[[float, float], None] | None) -> dict[int, RequestOutput]:
        announced = None  # the arrival whose wait was announced
        while True:
            self._admit_due()
            if self.core.idle:
                if not self._future:
                    return self.outputs
                arrival = self._future[0][0]
                wait = max(arrival - self.now(), 0.0)
                if on_wait is not None and wait > LONG_WAIT_S and arrival != announced:
                    on_wait(arrival, wait)
                    announced = arrival
                # in slices of at most a minute: the loop re-checks, and no sleep overflows the platform's time_t
                self.sleep(min(wait, 60.0))
                continue
            for o in self.step():
                if on_output is not None:
                    on_output(o)

    def _trace(self, step_tokens: int, preempted: int, dt: float, t_s: float, model_s: float, reload_s: float,
               after_s: float, sync_s: float, planner_s: float, planner_overlapped_s: float, poll_s: float,
               raised: int, prefill_tokens: int) -> StepTrace:
        core, pool = self.core, self.core.pool
        a = core.step_actions
        mean_bits, hist, shared, routed, weight_pages, committed_pages = self._weight_figures()
        page = pool.cfg.page_bytes
        return StepTrace(
            step=core.steps - 1, seconds=dt, t_s=t_s, model_seconds=model_s, graph_captured=self.runner.captured,
            after_seconds=after_s, sync_seconds=sync_s, reload_seconds=reload_s,
            planner_seconds=planner_s, planner_overlapped_seconds=planner_overlapped_s,
            poll_seconds=poll_s, refresh_seconds=a.refresh_seconds, raise_plan_seconds=a.raise_plan_seconds,
            raise_start_seconds=a.raise_start_seconds, prepare_seconds=a.prepare_seconds,
            free_blocks=core.alloc.num_free, kv_pages=pool.count(KV), weight_pages=pool.count(WEIGHT),
            free_pages=pool.num_free, pressure_bytes=int(a.pressure_bytes), demoted_blocks=a.demoted_blocks,
            reload_started_blocks=a.reload_started_blocks, promoted_blocks=raised,
            mean_bits=mean_bits, weight_bytes=weight_pages * page, committed_weight_bytes=committed_pages * page,
            bytes_in_flight=0 if core.weights is None else core.weights.in_flight_bytes(),
            running=len(core.scheduler.running), waiting=len(core.scheduler.waiting), preempted=preempted,
            step_tokens=step_tokens, prefill_tokens=prefill_tokens, bits_hist=list(hist),
            shared_bits=shared, routed_bits=routed, device_peak_bytes=self.runner.peak_bytes(),
            kv_pages_global=core.alloc.kv_pages - core.alloc.sliding_kv_pages,
            kv_pages_sliding=core.alloc.sliding_kv_pages, trimmed_blocks=core.trimmed_blocks,
            arrived=self._take_arrived())

    def mean_committed_bits(self) -> float:
        """Mean committed bits of the expert blocks now (16.0 for 16-bit experts), as the trace rows give it."""
        return self._weight_figures()[0]

    def _weight_figures(self) -> tuple[float, tuple[int, ...], float, float, int, int]:
        """Mean bits, bits histogram, shared and routed mean bits, weight pages held and committed: derived from
        the weight page table once per change of it (``WeightPageTable.version``), not once per step."""
        wpt = self.core.wpt
        if wpt is None:  # 16-bit experts: no bitwidths, every weight page committed
            held = self.core.pool.count(WEIGHT)
            return 16.0, (0,) * 9, math.nan, math.nan, held, held
        if self._weights_key is not None and self._weights_key[0] == wpt.version:
            return self._weights_key[1]
        q = wpt.q
        shared = routed = math.nan
        if self._bit_weights is not None:
            s, r = self._bit_weights
            shared = float(np.dot(q, s) / s.sum()) if s.any() else math.nan
            routed = float(np.dot(q, r) / r.sum()) if r.any() else math.nan
        figures = (float(q.mean()) if q.size else 16.0, tuple(np.bincount(q, minlength=9).tolist()), shared, routed,
                   wpt.weight_pages(), int(wpt.pages_at(q).sum()))
        self._weights_key = (wpt.version, figures)
        return figures
