"""The engine thread: one ``LLMEngine``, stepped beside the HTTP event loop.

What it does: a dedicated thread owns the engine and is the only one that touches it. The HTTP side hands it commands
through a thread-safe queue (``submit`` requests, ``abort`` one, ``call`` a function on the engine); the thread applies
them at step boundaries (``LLMEngine.add_request`` / ``abort``, SPEC 5: requests join and leave the running batch
between steps), runs one step, and hands each output to its request's sink (a callable that must only post it, e.g.
``loop.call_soon_threadsafe``), then calls ``flush`` once (a batch boundary for sinks that collect), and reports the
iteration's time besides the step (``Metrics.loop``: waiting for work, and applying commands and handing out outputs).
Finished requests are forgotten (their records do not pile up) and the step's trace row goes to the metrics.
``max_pending`` bounds the requests held (waiting and running): ``submit`` past it raises ``QueueFull`` (the server
answers 503). ``stop`` finishes the requests held for up to ``drain_seconds``, aborts the rest and joins the thread.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pwrun.core.request import Request, RequestOutput
from pwrun.engine.llm_engine import LLMEngine
from pwrun.engine.trace import StepTrace
from pwrun.serve.metrics import PoolState, pool_state

Sink = Callable[[RequestOutput | BaseException], None]


class Metrics(Protocol):
    """What the engine loop reports (``ServerMetrics``, or a relay to it from another process)."""

    def step(self, t: StepTrace) -> None: ...
    def pool(self, p: PoolState) -> None: ...
    def first_token(self, seconds: float) -> None: ...
    def finished(self, out: RequestOutput, reason: str, latency: float, per_token: float | None) -> None: ...
    def engine_down(self, failed: int = 0) -> None: ...
    def loop(self, idle: float, between: float) -> None: ...


class QueueFull(Exception):
    """More requests than ``max_pending`` would be held."""


class EngineStopped(Exception):
    """The engine thread has stopped (shut down, or failed: the message says why)."""


@dataclass
class _Held:
    sink: Sink
    arrival: float
    first: float | None = None


FINISHED = ("eos", "length", "stop", "abort", "failed")  # how held requests end (stop: a stop string; failed: the
# engine failed or its process died under them)


class Admission:
    """Request ids and the bound on requests held (``max_pending``), shared by the engine's thread and process
    fronts; ``error`` once the engine has stopped or failed, ``failure`` (the reason) only if it failed."""

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._pending = 0
        self._ids = itertools.count()
        self._accepting = True
        self.error: str | None = None
        self.failure: str | None = None

    def next_rid(self) -> int:
        return next(self._ids)

    @property
    def pending(self) -> int:
        return self._pending

    def _admit(self, n: int, open_: bool = True) -> None:
        """Count ``n`` more requests held (call under ``_lock``); ``QueueFull`` past the bound, ``EngineStopped``
        once stopping, failed or not ``open_``."""
        if not self._accepting or self.error is not None or not open_:
            raise EngineStopped(self.error or "the server is shutting down")
        if self._pending + n > self.max_pending:
            raise QueueFull(f"{self._pending} requests are queued or running (at most {self.max_pending})")
        self._pending += n


class EngineLoop(Admission):
    """Steps ``engine`` on its own thread; ``max_pending``: most requests held at once."""

    def __init__(self, engine: LLMEngine, max_pending: int, metrics: Metrics | None = None,
                 flush: Callable[[], None] | None = None) -> None:
        super().__init__(max_pending)
        self.engine, self.metrics, self.flush = engine, metrics, flush
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._held: dict[int, _Held] = {}  # engine thread only
        self._deadline: float | None = None  # set by ``drain``: abort what is left after it
        self._stop_strings: set[int] = set()  # requests aborted because their text reached a stop string
        self.finished = dict.fromkeys(FINISHED, 0)
        self._step_wall = 0.0  # engine thread only: the last step's wall seconds
        self._thread = threading.Thread(target=self._run, name="pwrun-engine", daemon=True)

    # ------------------------------------------------------------------ any thread
    @property
    def info(self) -> dict[str, Any]:
        """The engine's build figures (``LLMEngine.info``)."""
        return self.engine.info

    def start(self) -> None:
        if self.metrics is not None:
            self.metrics.pool(pool_state(self.engine))
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def running(self) -> bool:
        """The engine thread has not ended (also while it drains)."""
        return self._thread.is_alive()

    def submit(self, requests: list[Request], sink: Sink, arrival: float | None = None) -> None:
        """Queue ``requests`` (added together, before the next step); ``sink`` gets every output of each;
        ``arrival``: their ``time.perf_counter()`` arrival (default now). Raises ``QueueFull`` past ``max_pending``
        and ``EngineStopped`` once stopping or failed."""
        with self._lock:
            self._admit(len(requests))
            self._inbox.put(("add", (requests, sink, time.perf_counter() if arrival is None else arrival)))

    def abort(self, rid: int, reason: str = "abort") -> None:
        """Abort request ``rid`` at the next step boundary (nothing if it has finished); ``reason`` "stop": its
        text reached a stop string (counted as such)."""
        self._inbox.put(("abort", (rid, reason)))

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future[Any]:
        """Run ``fn(engine)`` on the engine thread at a step boundary; its result as a future."""
        fut: Future[Any] = Future()
        self._inbox.put(("call", (fn, fut)))
        if not self._thread.is_alive() and self._thread.ident is not None:  # stopped: nobody will answer
            self._fail_inbox()
        return fut

    def drain(self, drain_seconds: float) -> None:
        """Take no more requests; finish the held ones for up to ``drain_seconds``, then abort the rest (returns at
        once; ``stop`` waits)."""
        with self._lock:
            self._accepting = False
        self._inbox.put(("stop", time.perf_counter() + drain_seconds))

    def stop(self, drain_seconds: float = 0.0) -> None:
        """``drain`` (unless draining already), then wait for the engine thread to end."""
        if self._accepting:
            self.drain(drain_seconds)
        self._thread.join()

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        device = self.engine.runner.device
        if device.type == "cuda":  # the current device is per thread; kernels launch on it
            torch.cuda.set_device(device)
        mark = time.perf_counter()
        try:
            while True:
                waited = self.engine.idle
                t = time.perf_counter()
                self._commands(block=waited)
                idle = time.perf_counter() - t if waited else 0.0
                self._step_wall = 0.0
                if self._deadline is not None and (self.engine.idle or time.perf_counter() >= self._deadline):
                    for rid in list(self._held):
                        self._abort(rid)
                    self._commands(block=False)  # answer calls queued meanwhile
                    self.error = "the server has shut down"
                    self._fail_inbox()
                    self._flush()
                    return
                if not self.engine.idle:
                    self._step()
                self._flush()
                now = time.perf_counter()
                if self.metrics is not None:  # where the thread's time went besides the steps
                    self.metrics.loop(idle, max(now - mark - idle - self._step_wall, 0.0))
                mark = now
        except BaseException as exc:  # the engine is in an unknown state: fail every request and stop
            self.error = self.failure = f"the engine failed: {type(exc).__name__}: {exc}"
            self.finished["failed"] += len(self._held)
            if self.metrics is not None:
                self.metrics.engine_down(len(self._held))
            for held in self._held.values():
                held.sink(EngineStopped(self.error))
            self._held.clear()
            self._fail_inbox()
            self._flush()

    def _flush(self) -> None:
        if self.flush is not None:
            self.flush()

    def _commands(self, block: bool) -> None:
        while True:
            try:
                # an idle wait wakes every second, so that the idle time reaches the metrics while it lasts
                kind, arg = (self._inbox.get(timeout=1.0) if block and self._deadline is None
                             else self._inbox.get_nowait())
            except queue.Empty:
                return
            block = False
            if kind == "add":
                requests, sink, arrival = arg
                for r in requests:
                    self.engine.add_request(r)
                    self._held[r.rid] = _Held(sink, arrival)
            elif kind == "abort":
                rid, reason = arg
                if rid in self._held:
                    if reason == "stop":
                        self._stop_strings.add(rid)
                    self._abort(rid)
            elif kind == "call":
                fn, fut = arg
                try:
                    fut.set_result(fn(self.engine))
                except Exception as exc:
                    fut.set_exception(exc)
            elif kind == "stop":
                self._deadline = arg

    def _abort(self, rid: int) -> None:
        self._deliver(self.engine.abort(rid))
        if self.metrics is not None:
            self.metrics.pool(pool_state(self.engine))

    def _step(self) -> None:
        t = time.perf_counter()
        outs = self.engine.step()
        now = time.perf_counter()
        self._step_wall = now - t
        for o in outs:
            held = self._held.get(o.rid)
            if held is not None and held.first is None:
                held.first = now
                if self.metrics is not None:
                    self.metrics.first_token(now - held.arrival)
            self._deliver(o, now)
        if self.metrics is not None and self.engine.trace:
            self.metrics.step(self.engine.trace[-1])
        self.engine.trace.clear()  # rows go to the metrics; a server runs too long to keep them

    def _deliver(self, out: RequestOutput, now: float | None = None) -> None:
        held = self._held.get(out.rid)
        if held is None:
            return
        held.sink(out)
        if out.finish is None:
            return
        del self._held[out.rid]
        self.engine.forget(out.rid)
        reason: str = out.finish
        if out.rid in self._stop_strings:
            self._stop_strings.discard(out.rid)
            reason = "stop" if out.finish == "abort" else out.finish
        self.finished[reason] += 1
        with self._lock:
            self._pending -= 1
        if self.metrics is not None:
            now = time.perf_counter() if now is None else now
            tpot = (now - held.first) / (len(out.token_ids) - 1) if held.first and len(out.token_ids) > 1 else None
            self.metrics.finished(out, reason, now - held.arrival, tpot)

    def _fail_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                arg[1](EngineStopped(self.error or "stopped"))
                with self._lock:
                    self._pending -= len(arg[0])
            elif kind == "call":
                arg[1].set_exception(EngineStopped(self.error or "stopped"))
