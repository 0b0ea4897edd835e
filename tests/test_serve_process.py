"""The engine in its own process (``EngineProcess``, what ``pwrun serve`` runs), beyond the server tests of
``test_serve`` (whose ``tight`` server already runs one under load and disconnects):

- the same greedy and seeded text as the engine on a thread of the server's process;
- a build that fails (a budget too small) raises its own message from ``Server.open`` and leaves no process; one
  past the start-up limit is killed; a builder that cannot reach a child is refused;
- an engine process that dies mid-stream: the stream ends with an error instead of hanging, ``/health`` says why,
  new requests get a 503, and the server still stops;
- the parent's ``/metrics`` follow the child's pool and count the engine's time idle and between steps;
- each output crosses as its new tokens and arrives whole, however requests interleave and end;
- the child stops by itself when the server process goes.
"""

from __future__ import annotations

import functools
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from _serve_state import held_state, never_built, unpicklable

from pwformat.errors import BudgetTooSmall, PagedWeightError
from pwrun.core.request import RequestOutput
from pwrun.data import default_model_dir
from pwrun.engine.build import ServeConfig
from pwrun.generate import eos_ids
from pwrun.model.loader import load_spec, load_tokenizer
from pwrun.serve.builder import build_serving_engine
from pwrun.serve.engine_process import EngineProcess, _delta
from pwrun.serve.generation import ServeLimits
from pwrun.serve.server import Server, free_port

MODEL = default_model_dir()
NAME = "tiny"
CONTEXT = 128
PROMPTS = ["The river flows", "In 1905 the city council", "The album was released", "She was born in"]


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(MODEL)


def _server(engine: Any, tok: Any) -> Server:
    spec, _ = load_spec(MODEL)
    return Server(engine, tok, NAME, ServeLimits(CONTEXT, spec.vocab_size), eos_ids(spec.eos_token_ids, tok),
                  port=free_port(), max_pending=16, drain_seconds=5)


def _texts(server: Server) -> list[str]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    greedy = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=10, temperature=0)
    sampled = client.completions.create(model=NAME, prompt=PROMPTS[:2], max_tokens=10, temperature=0.9, seed=5)
    return [c.text for c in greedy.choices] + [c.text for c in sampled.choices]


def test_process_and_thread_engines_give_the_same_text(calibrated_artifacts: Path, tok: Any) -> None:
    cfg = ServeConfig(2**30)
    texts = {}
    for mode in ("thread", "process"):
        build = functools.partial(build_serving_engine, MODEL, calibrated_artifacts, cfg, CONTEXT, "cpu")
        server = _server(build() if mode == "thread" else build, tok)
        server.start()
        try:
            texts[mode] = _texts(server)
            if mode == "process":
                assert isinstance(server.loop, EngineProcess)
                with pytest.raises(TypeError, match="does not pickle"):  # and the engine goes on
                    server.loop.call(unpicklable).result(timeout=30)
                state = server.loop.call(held_state).result(timeout=30)
                metrics = urllib.request.urlopen(f"{server.url}/metrics", timeout=10).read().decode()
                assert f"pwrun_pool_pages {float(state['pages'])}" in metrics
                assert f"pwrun_free_pages {float(state['free'])}" in metrics
                assert 'pwrun_requests_finished_total{finish="length"} 6.0' in metrics
                assert state["kv"] == 0 and state["requests"] == 0
                assert "pwrun_engine_idle_seconds_total" in metrics  # waited for the requests
                assert "pwrun_engine_between_steps_seconds_total" in metrics
        finally:
            server.stop()
    assert texts["process"] == texts["thread"]
    assert all(texts["thread"])


def test_outputs_cross_as_new_tokens_and_arrive_whole() -> None:
    """Random interleaved steps of five requests: the child's messages (``_delta``, through pickle) carry only the
    tokens the parent lacks, and the parent's sinks get every output equal to the engine's."""
    rng = random.Random(3)
    loop = EngineProcess(held_state, 8)  # never started: only its reader side
    got: list[RequestOutput] = []
    sent: dict[int, int] = {}
    tokens: dict[int, list[int]] = {rid: [] for rid in range(5)}
    for rid in tokens:
        loop._sinks[rid] = got.append  # type: ignore[assignment]
    expected, carried = [], 0
    while tokens:
        rid = rng.choice(sorted(tokens))
        tokens[rid] += [rng.randrange(262_144) for _ in range(rng.randrange(3))]
        finish = "length" if rng.random() < 0.05 else None
        out = RequestOutput(rid, tuple(tokens[rid]), 11 + rid, finish, (-0.5,) * (rid % 2), rid % 3)
        expected.append(out)
        msg = pickle.loads(pickle.dumps(_delta(out, sent)))
        carried += len(msg[3])
        loop._dispatch(msg)
        if finish is not None:
            del tokens[rid]
    assert got == expected
    assert carried == sum(len(o.token_ids) for o in expected if o.finish is not None)  # each token crossed once
    assert not sent and not loop._tokens and not loop._sinks


def test_a_draining_engine_process_still_takes_aborts(calibrated_artifacts: Path) -> None:
    """A request aborted while the server drains (its client went away) ends as aborted at the next step, not when
    it would have finished; the engine process then exits with the drain time mostly unused. The pool's state
    reaches the parent's metrics before any request."""
    from pwrun.core.request import Request, SamplingParams
    from pwrun.serve.metrics import ServerMetrics

    build = functools.partial(build_serving_engine, MODEL, calibrated_artifacts, ServeConfig(2**30), CONTEXT, "cpu")
    metrics = ServerMetrics()
    loop = EngineProcess(build, 4, metrics)
    loop.start()
    assert metrics.pool_pages._value.get() > 0 and metrics.free_pages._value.get() > 0
    outs: list[Any] = []
    loop.submit([Request(loop.next_rid(), (5, 6, 7), SamplingParams(max_new_tokens=CONTEXT - 8))], outs.append)
    while not outs:
        time.sleep(0.01)
    t0 = time.monotonic()
    loop.drain(120.0)
    loop.abort(0)
    loop.stop(120.0)
    assert time.monotonic() - t0 < 60
    assert loop.finished["abort"] == 1 and loop.finished["length"] == 0, loop.finished
    assert outs[-1].finish == "abort" and len(outs[-1].token_ids) < CONTEXT - 8


def test_a_failed_build_raises_its_message_and_leaves_no_process(calibrated_artifacts: Path, tok: Any) -> None:
    build = functools.partial(build_serving_engine, MODEL, calibrated_artifacts, ServeConfig(2**20), CONTEXT, "cpu")
    server = _server(build, tok)
    with pytest.raises(BudgetTooSmall, match="--gpu-memory") as err:
        server.open()
    assert err.value.minimum > 2**20
    assert isinstance(server.loop, EngineProcess) and not server.loop.alive


def test_a_build_past_the_limit_is_killed_and_a_local_builder_refused() -> None:
    loop = EngineProcess(never_built, 4)
    t0 = time.monotonic()
    with pytest.raises(PagedWeightError, match="not ready within 3 s"):
        loop.start(timeout=3)
    assert time.monotonic() - t0 < 40 and loop._proc is None and not loop.alive
    with pytest.raises(TypeError, match="must pickle"):
        EngineProcess(lambda: None, 4).start()  # type: ignore[arg-type,return-value]


def _outcome(client: openai.OpenAI) -> int:
    """The HTTP status of a whole (non-streamed) completion of 120 tokens."""
    try:
        client.completions.create(model=NAME, prompt="In 1905 the city council", max_tokens=120, temperature=0)
        return 200
    except openai.APIStatusError as err:
        return err.status_code


def test_a_dead_engine_process_fails_its_requests_instead_of_hanging(calibrated_artifacts: Path, tok: Any) -> None:
    build = functools.partial(build_serving_engine, MODEL, calibrated_artifacts, ServeConfig(2**30), CONTEXT, "cpu")
    server = _server(build, tok)
    server.start()
    try:
        assert isinstance(server.loop, EngineProcess)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        stream = client.completions.create(model=NAME, prompt="The river", max_tokens=120, temperature=0,
                                           stream=True)
        it = iter(stream)
        next(it)
        whole: list[Any] = []  # a non-streamed request in flight too: it fails, and is not counted as refused
        waiting = threading.Thread(target=lambda: whole.append(_outcome(client)))
        waiting.start()
        end = time.monotonic() + 30
        while server.loop.pending < 2 and time.monotonic() < end:
            time.sleep(0.01)
        assert server.loop.pending == 2
        os.kill(server.loop._proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - the stream is cut (an error event, or the connection)
            for _ in it:
                pass
        assert time.monotonic() - t0 < 30
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{server.url}/health", timeout=10)
        assert health.value.code == 503 and b"engine process exited" in health.value.read()
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=NAME, prompt="The river", max_tokens=4)
        assert refused.value.status_code == 503
        waiting.join(30)
        assert whole == [503]
        assert server.loop.pending == 0
        assert server.loop.finished["failed"] == 2 and "killed by SIGKILL" in (server.loop.failure or "")
        metrics = urllib.request.urlopen(f"{server.url}/metrics", timeout=10).read().decode()
        for line in ("pwrun_engine_up 0.0", "pwrun_requests_running 0.0", "pwrun_kv_pages 0.0",
                     'pwrun_requests_finished_total{finish="failed"} 2.0',
                     'pwrun_requests_refused_total{status="503"} 1.0'):  # only the request after the death
            assert line in metrics, line
    finally:
        t0 = time.monotonic()
        server.stop()
        assert time.monotonic() - t0 < 30


def test_an_idle_engine_that_dies_is_reported_down(calibrated_artifacts: Path, tok: Any) -> None:
    """No request in flight: /health and /metrics still say the engine is gone."""
    build = functools.partial(build_serving_engine, MODEL, calibrated_artifacts, ServeConfig(2**30), CONTEXT, "cpu")
    server = _server(build, tok)
    server.start()
    try:
        assert isinstance(server.loop, EngineProcess) and server.loop._proc is not None
        up = urllib.request.urlopen(f"{server.url}/metrics", timeout=10).read().decode()
        assert "pwrun_engine_up 1.0" in up
        os.kill(server.loop._proc.pid, signal.SIGKILL)
        end = time.monotonic() + 30
        while server.loop.error is None and time.monotonic() < end:  # the reader thread has seen the pipe close
            time.sleep(0.05)
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{server.url}/health", timeout=10)
        assert health.value.code == 503
        metrics = urllib.request.urlopen(f"{server.url}/metrics", timeout=10).read().decode()
        assert "pwrun_engine_up 0.0" in metrics and 'pwrun_requests_finished_total{finish="failed"}' not in metrics
    finally:
        server.stop()


def test_the_engine_process_stops_when_the_server_process_goes(calibrated_artifacts: Path) -> None:
    """The command pipe closing (the server process killed) ends the child quietly and at once."""
    build = functools.partial(build_serving_engine, MODEL, calibrated_artifacts, ServeConfig(2**30), CONTEXT, "cpu")
    loop = EngineProcess(build, 4)
    loop.start()
    proc = loop._proc
    assert proc is not None and proc.is_alive() and loop._commands is not None
    loop._commands.close()  # what the kernel does to the pipe when the server process dies
    proc.join(30)
    assert proc.exitcode == 0
    assert loop._reader is not None
    loop._reader.join(10)
    assert not loop.alive and loop.error is not None


def test_the_engine_process_runs_workers_and_ends_with_the_server(calibrated_artifacts: Path, tmp_path: Path) -> None:
    """On a GPU the build's kernel warm-up runs a pool of worker processes inside the engine process (which a daemon
    process may not have); a server process that exits without stopping its engine neither hangs nor leaves it."""
    script = tmp_path / "exits.py"
    script.write_text(
        "import functools, sys\n"
        "from pathlib import Path\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from _serve_state import built_after_workers\n"
        "from pwrun.engine.build import ServeConfig\n"
        "from pwrun.serve.engine_process import EngineProcess\n"
        "from pwrun.serve.builder import build_serving_engine\n"
        f"build = functools.partial(build_serving_engine, Path({str(MODEL)!r}), Path({str(calibrated_artifacts)!r}),\n"
        f"                          ServeConfig(2**30), {CONTEXT}, 'cpu')\n"
        "if __name__ == '__main__':\n"
        "    loop = EngineProcess(functools.partial(built_after_workers, build), 4)\n"
        "    loop.start(timeout=240)\n"
        "    print(loop._proc.pid, loop.alive, flush=True)\n")
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    pid, alive = run.stdout.split()
    assert alive == "True"
    assert time.monotonic() - t0 < 280
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)
