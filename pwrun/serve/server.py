"""``pwrun serve``: the engine built as ``pwrun generate`` builds it, in its own process or thread, and uvicorn.

What it does: ``build_serving_engine`` (``pwrun.serve.builder``) makes the engine for requests that arrive later.
``Server`` joins an engine to the HTTP
application: given a builder (a picklable callable, e.g. ``functools.partial`` of ``build_serving_engine``) it
builds and steps the engine in a child process (``EngineProcess``: what ``pwrun serve`` does); given an
``LLMEngine`` it steps it on a thread of this process (``EngineLoop``). It runs uvicorn in the foreground
(``run``: SIGTERM or Ctrl-C stop taking requests, let the running ones finish for up to ``drain_seconds``, abort
the rest, stop the engine) or on a background thread (``start``/``stop``, for tests and benchmarks).
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

from pwformat.errors import PagedWeightError
from pwrun.engine.llm_engine import LLMEngine
from pwrun.serve.app import ServerState, create_app
from pwrun.serve.engine_loop import EngineLoop
from pwrun.serve.engine_process import Builder, EngineProcess
from pwrun.serve.generation import ServeLimits
from pwrun.serve.metrics import ServerMetrics

LOG_LEVELS = tuple(uvicorn.config.LOG_LEVELS)  # what --log-level accepts
ABORT_SECONDS = 10  # after the drain time: for the aborted requests' last chunks before uvicorn cancels them


class Server:
    """``engine`` served over HTTP on ``host``:``port`` as ``model_name`` (see the module docstring)."""

    def __init__(self, engine: LLMEngine | Builder, tokenizer: Any, model_name: str, limits: ServeLimits,
                 eos: set[int], host: str = "127.0.0.1", port: int = 8000, max_pending: int = 256,
                 drain_seconds: float = 30.0, log_level: str = "warning") -> None:
        self.metrics = ServerMetrics()
        self.loop: EngineLoop | EngineProcess = (EngineLoop(engine, max_pending, self.metrics)
                                                 if isinstance(engine, LLMEngine)
                                                 else EngineProcess(engine, max_pending, self.metrics))
        self.state = ServerState(self.loop, tokenizer, model_name, limits, frozenset(eos), self.metrics,
                                 shutting_down=lambda: self._uvicorn.should_exit)
        self.app = create_app(self.state)
        self.drain_seconds = drain_seconds
        config = uvicorn.Config(_QuietShutdown(self.app, self.state.shutting_down), host=host, port=port,
                                log_level=log_level, lifespan="off",
                                timeout_graceful_shutdown=math.ceil(drain_seconds) + ABORT_SECONDS)
        self._uvicorn = _Uvicorn(config, lambda: self.loop.drain(drain_seconds), lambda: self.loop.drain(0.0))
        self._thread: threading.Thread | None = None
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def open(self) -> None:
        """Start the engine (a builder: spawn its process and wait for the build; raises ``PagedWeightError`` with
        the build's message). ``run`` and ``start`` do it if it has not been done."""
        if isinstance(self.loop, EngineProcess):
            self.loop.start()

    def run(self) -> None:
        """Serve in the foreground until SIGTERM or Ctrl-C; the engine is stopped on return."""
        self.open()
        if isinstance(self.loop, EngineLoop):
            self.loop.start()
        try:
            self._uvicorn.run()
        finally:
            self.loop.stop(0.0)  # uvicorn let the requests finish (or cancelled them, which aborts them)

    def start(self, timeout: float = 30.0) -> None:
        """Serve on a background thread; returns once the socket accepts connections."""
        self.open()
        if isinstance(self.loop, EngineLoop):
            self.loop.start()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._uvicorn.serve()), name="pwrun-http",
                                        daemon=True)
        self._thread.start()
        end = time.monotonic() + timeout
        while not self._uvicorn.started:
            if time.monotonic() > end or not self._thread.is_alive():
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop a ``start``-ed server: no more requests; running ones finish for up to ``drain_seconds``."""
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()
        self.loop.stop(0.0)


class _Uvicorn(uvicorn.Server):
    """uvicorn's server that, as its shutdown begins, starts the engine's drain: the running requests finish for up
    to the drain time, then the engine aborts the rest, whose responses end properly (a last chunk with
    ``finish_reason`` "abort" and ``[DONE]``; a request not streamed gets a 503) within ``ABORT_SECONDS`` after it.
    A second Ctrl-C (uvicorn's forced exit) ends the drain: ``abort`` stops the running requests at the next
    step."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], None], abort: Callable[[], None]) -> None:
        super().__init__(config)
        self._drain, self._abort = drain, abort

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._drain()
        watch = asyncio.create_task(self._abort_when_forced())  # on the event loop, not in the signal handler
        try:
            await super().shutdown(sockets)
        finally:
            watch.cancel()

    async def _abort_when_forced(self) -> None:
        while not self.force_exit:
            await asyncio.sleep(0.1)
        self._abort()


class _QuietShutdown:
    """ASGI wrapper: a response cancelled because the drain time ran out ends quietly (its requests are aborted by
    their own cleanup) instead of one "Exception in ASGI application" traceback per stream in the log."""

    def __init__(self, app: Any, shutting_down: Callable[[], bool]) -> None:
        self.app, self.shutting_down = app, shutting_down

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if not self.shutting_down():
                raise


def check_listen(host: str, port: int) -> None:
    """Raise ``PagedWeightError`` if ``host``:``port`` cannot be listened on now (checked before the engine is
    built, which takes minutes on a large model)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        raise PagedWeightError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): give another --port or "
                               "--host") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
