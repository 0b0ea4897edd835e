"""The engine in its own process (``pwrun serve``'s default): the HTTP side's Python work (parsing requests,
detokenizing, server-sent events) then never holds the interpreter lock between the engine's kernel launches.

What it does: ``EngineProcess`` spawns a child (a fresh interpreter: CUDA cannot be forked) that builds the engine with
``build`` (a picklable callable: a module-level function or a ``functools.partial`` of one) and runs an ``EngineLoop``
on it. Requests, aborts, calls and the stop go down one pipe; each loop iteration's outputs (each request's new tokens
only: the parent keeps the rest), call results and metric events come back up another in one message, which a reader
thread hands to the requests' sinks and the parent's ``ServerMetrics``. It has ``EngineLoop``'s interface, so the HTTP
side cannot tell them apart. The bound on held requests is kept here; the child's stderr is the parent's (its build
progress and warnings show). If the child dies, every held request gets ``EngineStopped`` and ``alive`` turns false; if
the parent dies, the child sees its pipe close and stops.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing as mp
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import torch

from pwformat.errors import BudgetTooSmall, PagedWeightError
from pwrun.core.request import Request, RequestOutput
from pwrun.engine.llm_engine import LLMEngine
from pwrun.engine.trace import StepTrace
from pwrun.serve.engine_loop import FINISHED, Admission, EngineLoop, EngineStopped, Metrics, Sink
from pwrun.serve.metrics import PoolState, pool_state

Builder = Callable[[], LLMEngine]


class _Relay:
    """The child's ``Metrics``: records each call as an event for the parent's ``ServerMetrics``."""

    def __init__(self) -> None:
        self.events: list[tuple[str, tuple[Any, ...]]] = []

    def step(self, t: StepTrace) -> None:
        self.events.append(("step", (t,)))

    def pool(self, p: PoolState) -> None:
        self.events.append(("pool", (p,)))

    def first_token(self, seconds: float) -> None:
        self.events.append(("first_token", (seconds,)))

    def finished(self, out: RequestOutput, reason: str, latency: float, per_token: float | None) -> None:
        self.events.append(("finished", (out, reason, latency, per_token)))

    def engine_down(self, failed: int = 0) -> None:
        self.events.append(("engine_down", (failed,)))

    def loop(self, idle: float, between: float) -> None:
        self.events.append(("loop", (idle, between)))


def _take(items: list[Any]) -> list[Any]:
    """Everything in ``items`` now, removed (appends from another thread meanwhile stay for the next take)."""
    batch = items[:]
    del items[:len(batch)]
    return batch


def _post(events: Connection, msg: tuple[Any, ...]) -> None:
    """Send ``msg`` to the parent; nothing if it has gone (the command pipe's end then stops the child)."""
    try:
        events.send(msg)
    except OSError:
        pass


def _delta(out: RequestOutput, sent: dict[int, int]) -> tuple[Any, ...]:
    """``out`` as the message ``EngineProcess`` rebuilds it from: its tokens past the ``sent`` ones (a step's
    message then grows with the batch, not with the tokens generated so far)."""
    start = sent.get(out.rid, 0)
    if start > len(out.token_ids):
        start = 0
    if out.finish is None:
        sent[out.rid] = len(out.token_ids)
    else:
        sent.pop(out.rid, None)
    return ("out", out.rid, start, out.token_ids[start:], out.prompt_tokens, out.finish, out.logprobs,
            out.preemptions)


def _child(build: Builder, threads: int, commands: Connection, events: Connection) -> None:
    """The child's main: build, report ``ready`` (or ``failed``), then apply commands until ``stop``."""
    # Ctrl-C reaches the whole group, and so does SIGTERM from systemd, `timeout` or `kill -- -PGID`: the parent
    # decides (it drains, then stops this process; it kills it if it must end first)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    try:
        engine = build()
    except BudgetTooSmall as exc:
        _post(events, ("failed", str(exc), exc.minimum))
        return
    except PagedWeightError as exc:
        _post(events, ("failed", str(exc), None))
        return
    except (MemoryError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        if isinstance(exc, MemoryError) or "alloc" in first.lower() or "out of memory" in first.lower():
            # the page pool (and the KV of every request it must hold) is larger than the device: the caller's
            # hint (BudgetTooSmall) names the options that size it
            _post(events, ("failed", f"not enough memory to build the engine ({type(exc).__name__}: {first}): its "
                           "page pool is what --gpu-memory gives, or what --max-batch requests of --max-model-len "
                           "tokens need", 0))
            return
        traceback.print_exc()
        _post(events, ("failed", f"the engine could not be built: {type(exc).__name__}: {exc}", None))
        return
    except BaseException as exc:
        traceback.print_exc()
        _post(events, ("failed", f"the engine could not be built: {type(exc).__name__}: {exc}", None))
        return
    relay = _Relay()
    outs: list[tuple[Any, ...]] = []  # ("out", ...) (``_delta``) | ("fail", rids, message) | ("call", cid, ok, value)
    sent: dict[int, int] = {}  # tokens of each running request the parent has

    def flush() -> None:
        batch, evs = _take(outs), _take(relay.events)
        if batch or evs:
            _post(events, ("batch", batch, evs, dict(loop.finished)))

    loop = EngineLoop(engine, sys.maxsize, relay, flush)
    _post(events, ("ready", engine.info, pool_state(engine)))
    loop.start()
    draining = False
    while True:
        if draining:  # the loop finishes or aborts the held requests; aborts meanwhile still reach it
            if not loop.running:
                flush()
                _post(events, ("stopped", loop.error, loop.failure, dict(loop.finished)))
                return
            try:
                if not commands.poll(0.05):
                    continue
            except (EOFError, OSError):
                pass
        try:
            kind, *args = commands.recv()
        except (EOFError, OSError):  # the parent is gone: nobody reads the outputs
            kind, args = "stop", [0.0]
        if kind == "add":
            requests, arrival = args
            rids = [r.rid for r in requests]

            def sink(item: RequestOutput | BaseException, rids: list[int] = rids) -> None:
                outs.append(_delta(item, sent) if isinstance(item, RequestOutput) else ("fail", rids, str(item)))
            try:
                loop.submit(requests, sink, arrival)
            except EngineStopped as exc:
                outs.append(("fail", rids, str(exc)))
                flush()
        elif kind == "abort":
            loop.abort(*args)
        elif kind == "call":
            cid, fn = args

            def done(f: Future[Any], cid: int = cid) -> None:
                exc = f.exception()
                value = f.result() if exc is None else exc
                try:
                    pickle.dumps(value)  # what cannot cross the pipe must not take the step's outputs with it
                except Exception as err:
                    exc = value = TypeError(f"the call's result does not pickle: {err}")
                outs.append(("call", cid, exc is None, value))
            loop.call(fn).add_done_callback(done)
        elif kind == "stop":  # drain: finish the held requests for up to args[0] s, taking aborts meanwhile
            loop.drain(args[0])
            if args[0] <= 0 or draining:  # nothing to drain, or the parent is gone: end now
                loop.stop()
                flush()
                _post(events, ("stopped", loop.error, loop.failure, dict(loop.finished)))
                return
            draining = True


class EngineProcess(Admission):
    """``EngineLoop``'s interface over an engine built by ``build`` in a child process (see the module docstring);
    ``max_pending``: most requests held at once; ``metrics``: the parent's ``ServerMetrics``."""

    def __init__(self, build: Builder, max_pending: int, metrics: Metrics | None = None) -> None:
        super().__init__(max_pending)
        self.build, self.metrics = build, metrics
        self._cids = itertools.count()
        self._sinks: dict[int, Sink] = {}
        self._tokens: dict[int, list[int]] = {}  # reader thread: the tokens of each running request so far
        self._calls: dict[int, Future[Any]] = {}
        self._proc: Any = None
        self._commands: Connection | None = None
        self._reader: threading.Thread | None = None
        self.info: dict[str, Any] = {}
        self._counts = dict.fromkeys(FINISHED, 0)  # the child loop's, as of its last message
        self._lost = 0  # requests held when the child died
        self._drain_seconds = 0.0
        self._exiting = False  # this process is exiting: multiprocessing terminates the child, not a failure

    @property
    def finished(self) -> dict[str, int]:
        """Requests ended, by how (``FINISHED``)."""
        return self._counts | {"failed": self._counts["failed"] + self._lost}

    def start(self, timeout: float | None = None) -> None:
        """Spawn the child and wait until its engine is built (``timeout`` seconds at most; None: no limit).
        Raises ``PagedWeightError`` (``BudgetTooSmall``) with the child's message if the build fails."""
        if self._proc is not None:
            return
        try:
            pickle.dumps(self.build)
        except Exception as exc:
            raise TypeError(f"the engine's builder must pickle (a module-level function, or a functools.partial of "
                            f"one): {exc}") from None
        ctx = mp.get_context("spawn")
        cmd_read, cmd_write = ctx.Pipe(duplex=False)
        ev_read, ev_write = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(self.build, torch.get_num_threads(), cmd_read, ev_write),
                           name="pwrun-engine")  # not a daemon: its kernel warm-up runs worker processes
        self._proc = proc
        proc.start()
        cmd_read.close()
        ev_write.close()
        stopped: BaseException | None = None
        try:
            if not ev_read.poll(timeout):
                raise PagedWeightError(f"the engine process was not ready within {timeout:g} s")
            msg = ev_read.recv()
        except EOFError:
            msg = ("failed", self._exit_reason().replace("; see", " before its engine was built; see"), None)
        except BaseException as exc:  # Ctrl-C, SIGTERM or the time limit during the build: leave nothing building
            proc.kill()
            stopped, msg = exc, ("killed",)
        if msg[0] != "ready":
            proc.join(30)
            self._proc = None
            cmd_write.close()
            ev_read.close()
            if stopped is not None:
                raise stopped
            raise PagedWeightError(msg[1]) if msg[2] is None else BudgetTooSmall(msg[1], msg[2])
        self._commands = cmd_write
        atexit.register(self._at_exit)  # runs before multiprocessing's exit hook, which would wait for the child
        self.info = msg[1]
        if self.metrics is not None:
            self.metrics.pool(msg[2])  # the pool before any request (the loop's first report waits for a step)
        self._reader = threading.Thread(target=self._read, args=(ev_read,), name="pwrun-engine-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive() and self.error is None

    def submit(self, requests: list[Request], sink: Sink, arrival: float | None = None) -> None:
        """As ``EngineLoop.submit``: ``QueueFull`` past ``max_pending``, ``EngineStopped`` once stopping or failed."""
        with self._lock:
            self._admit(len(requests), self._commands is not None)
            for r in requests:
                self._sinks[r.rid] = sink
            self._send("add", requests, time.perf_counter() if arrival is None else arrival)

    def abort(self, rid: int, reason: str = "abort") -> None:
        """As ``EngineLoop.abort``."""
        with self._lock:
            self._send("abort", rid, reason)

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future[Any]:
        """Run ``fn(engine)`` in the child at a step boundary (``fn`` and its result must pickle)."""
        fut: Future[Any] = Future()
        with self._lock:
            if self.error is not None or self._commands is None:
                fut.set_exception(EngineStopped(self.error or "the engine process is not running"))
                return fut
            cid = next(self._cids)
            self._calls[cid] = fut
            self._send("call", cid, fn)
        return fut

    def drain(self, drain_seconds: float) -> None:
        """Take no more requests; the child finishes the held ones for up to ``drain_seconds``, aborts the rest and
        exits (returns at once; ``stop`` waits)."""
        with self._lock:
            self._accepting = False
            self._send("stop", drain_seconds)
        self._drain_seconds = drain_seconds

    def stop(self, drain_seconds: float = 0.0, timeout: float = 120.0) -> None:
        """``drain`` (unless draining already), then wait for the child to exit (killed if it has not after the
        drain time + ``timeout``)."""
        if self._accepting:
            self.drain(drain_seconds)
        drain_seconds = self._drain_seconds
        if self._reader is not None:
            self._reader.join(drain_seconds + timeout)
        if self._proc is not None:
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()

    def _send(self, *msg: Any) -> None:  # under self._lock
        if self._commands is None:
            return
        try:
            self._commands.send(msg)
        except (BrokenPipeError, OSError):  # the child is gone: the reader fails what it held
            pass

    def _read(self, events: Connection) -> None:
        """The reader thread: hand each message's outputs to their sinks and its events to the metrics."""
        why = "the engine process stopped"
        try:
            while True:
                msg = events.recv()
                if msg[0] == "stopped":
                    why, self.failure, self._counts = msg[1] or "the server has shut down", msg[2], msg[3]
                    break
                _, batch, evs, self._counts = msg
                for item in batch:
                    self._dispatch(item)
                if self.metrics is not None:
                    for name, args in evs:
                        getattr(self.metrics, name)(*args)
        except (EOFError, OSError):
            if self._exiting:
                return
            why = self.failure = self._exit_reason()
            n = len(self._sinks)
            logging.getLogger("uvicorn.error").error(
                f"{why.split(';')[0]}: {n} request{'' if n == 1 else 's'} failed; restart the server")
        with self._lock:
            self.error = self.error or why
            if self.failure is not None:  # down also when it held no request (an idle engine killed)
                self._lost = len(self._sinks)
                if self.metrics is not None:
                    self.metrics.engine_down(self._lost)
            sinks, calls = list(self._sinks.values()), list(self._calls.values())
            self._sinks.clear()
            self._tokens.clear()
            self._calls.clear()
            self._pending = 0
            self._commands = None
        for sink in dict.fromkeys(sinks):  # once per submit, as the thread loop's failure path
            sink(EngineStopped(self.error))
        for fut in calls:
            fut.set_exception(EngineStopped(self.error))

    def _at_exit(self) -> None:
        """This process is exiting: close the command pipe (the child stops at its next step boundary), killed if
        it has not ended within a few seconds."""
        self._exiting = True
        with self._lock:
            if self._commands is not None:
                self._commands.close()
                self._commands = None
        if self._proc is not None and self._proc.is_alive():
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)

    def _exit_reason(self) -> str:
        if self._proc is None:
            return "the engine process stopped"
        self._proc.join(5)  # its pipe closed: it has exited or is about to
        code = self._proc.exitcode
        if code is None or code == 0:
            return "the engine process stopped"
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return f"the engine process exited ({how}); see the server's log, then restart it"

    def _dispatch(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "out":
            _, rid, start, new, prompt_tokens, finish, logprobs, preemptions = item
            ids = self._tokens.pop(rid, []) if finish is not None else self._tokens.setdefault(rid, [])
            del ids[start:]
            ids.extend(new)
            sink = self._sinks.get(rid)
            if sink is None:
                self._tokens.pop(rid, None)
                return
            out = RequestOutput(rid, tuple(ids), prompt_tokens, finish, logprobs, preemptions)
            if out.finish is not None:
                with self._lock:
                    del self._sinks[out.rid]
                    self._pending -= 1
            sink(out)
        elif kind == "fail":
            with self._lock:
                sinks = [s for s in (self._sinks.pop(r, None) for r in item[1]) if s is not None]
                for r in item[1]:
                    self._tokens.pop(r, None)
                self._pending -= len(sinks)
            for sink in dict.fromkeys(sinks):
                sink(EngineStopped(item[2]))
        else:
            _, cid, ok, value = item
            fut = self._calls.pop(cid, None)
            if fut is not None:
                fut.set_result(value) if ok else fut.set_exception(value)


AnyLoop = EngineLoop | EngineProcess  # what the HTTP side steps requests through
