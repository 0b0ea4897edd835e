"""Stopping ``pwrun serve`` (the real tiny MoE, CPU, servers on 127.0.0.1, the official ``openai`` client).

- SIGTERM: the running request finishes (drain) and the process exits 0; a second Ctrl-C ends the drain at once.
- ``--drain-seconds 0``: the running request is aborted, its stream ends with a last "abort" chunk.
- The engine process killed under a stream: the server logs it at once and exits 1 naming the failed request.
- Bad options: one ``error:`` line and exit 2, before the engine is built where it can be.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from typer.testing import CliRunner

from pwrun.cli import app
from pwrun.core.pool import KV
from pwrun.data import default_model_dir
from pwrun.engine.build import ServeConfig
from pwrun.generate import eos_ids
from pwrun.model.loader import load_spec, load_tokenizer
from pwrun.serve.builder import build_serving_engine
from pwrun.serve.generation import ServeLimits
from pwrun.serve.server import Server, free_port

MODEL = default_model_dir()
NAME = "tiny"


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(MODEL)


def _serve_process(artifacts: Path, port: int, drain: float, context: int = 128,
                   group: bool = False) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pwrun", "serve", "--artifacts", str(artifacts), "--gpu-memory",
                             "1GiB", "--max-model-len", str(context), "--port", str(port), "--device", "cpu",
                             "--drain-seconds", str(drain), "--served-model-name", NAME, "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=group)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("pwrun serve did not start")


def _stream_in_thread(url: str, got: list[Any], first: threading.Event, max_tokens: int = 60) -> threading.Thread:
    """Stream a greedy completion on a thread: its choices (or the exception that ended it) go to ``got``."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)

    def read() -> None:
        try:
            for chunk in client.completions.create(model=NAME, prompt="The river", max_tokens=max_tokens,
                                                   temperature=0, stream=True):
                got.append(chunk.choices[0])
                first.set()
        except Exception as exc:  # an aborted stream ends without its last chunk
            got.append(exc)
        first.set()

    reader = threading.Thread(target=read)
    reader.start()
    return reader


@pytest.mark.parametrize("group", [False, True])
def test_sigterm_lets_the_running_request_finish_then_exits(calibrated_artifacts: Path, group: bool) -> None:
    """SIGTERM to the server, or to its whole process group (systemd, `timeout`, `kill -- -PGID`: the engine
    process gets it too and leaves the stop to the server): the running request finishes, exit 0."""
    port = free_port()
    proc = _serve_process(calibrated_artifacts, port, 20, group=group)
    got: list[Any] = []
    first = threading.Event()
    reader = _stream_in_thread(f"http://127.0.0.1:{port}", got, first)
    assert first.wait(60)
    if group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    reader.join(30)
    assert proc.returncode == 0, err
    assert got[-1].finish_reason == "length" and "stopped (SIGTERM): 1 request finished, 0 aborted" in err


def test_a_second_ctrl_c_ends_the_drain(calibrated_artifacts: Path) -> None:
    """Ctrl-C drains (up to 300 s here); a second Ctrl-C aborts the running request at once: its stream ends and
    the server exits long before the drain time, counting it aborted."""
    port = free_port()
    proc = _serve_process(calibrated_artifacts, port, 300, context=1024)
    got: list[Any] = []
    first = threading.Event()
    reader = _stream_in_thread(f"http://127.0.0.1:{port}", got, first, 1000)
    assert first.wait(60)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    reader.join(30)
    assert time.monotonic() - t0 < 60, err
    assert "0 requests finished, 1 aborted" in err, err
    assert isinstance(got[-1], Exception) or got[-1].finish_reason == "abort", got[-1]


def _spawned_children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` and that multiprocessing spawned (the engine; not its resource tracker)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) if d.name.isdigit() else -1
            spawned = ppid == pid and b"spawn_main" in (d / "cmdline").read_bytes()
        except OSError:
            continue
        if spawned:
            out.append(int(d.name))
    return out


def test_a_dead_engine_makes_the_server_exit_1_naming_the_failed_requests(calibrated_artifacts: Path) -> None:
    """The engine process killed under a running stream: the server says so in its log at once, and on SIGTERM
    exits 1 with the failed request counted."""
    port = free_port()
    proc = _serve_process(calibrated_artifacts, port, 5)
    got: list[Any] = []
    first = threading.Event()
    reader = _stream_in_thread(f"http://127.0.0.1:{port}", got, first, 120)
    assert first.wait(60)
    pids = _spawned_children(proc.pid)
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    reader.join(30)
    assert isinstance(got[-1], Exception) or got[-1].finish_reason is None
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert "ERROR:    the engine process exited (killed by SIGKILL): 1 request failed; restart the server" in err
    assert err.strip().splitlines()[-1] == ("error: stopped (SIGTERM): 0 requests finished, 0 aborted, 1 failed: the "
                                            "engine process exited (killed by SIGKILL); see the server's log, then "
                                            "restart it"), err


def test_stopping_without_drain_aborts_the_running_request(calibrated_artifacts: Path, tok: Any) -> None:
    """What SIGTERM does with ``--drain-seconds 0`` (uvicorn's ``should_exit``, in-process): the request is aborted,
    its stream ends properly (a last chunk with finish_reason "abort"), the engine thread stops."""
    engine = build_serving_engine(MODEL, calibrated_artifacts, ServeConfig(2**30), 128, "cpu")
    spec, _ = load_spec(MODEL)
    server = Server(engine, tok, NAME, ServeLimits(128, spec.vocab_size), eos_ids(spec.eos_token_ids, tok),
                    port=free_port(), drain_seconds=0)
    server.start()
    got: list[Any] = []
    first = threading.Event()
    reader = _stream_in_thread(server.url, got, first, 120)
    assert first.wait(60)
    whole: list[Any] = []  # a request not streamed, running too: its partial text is no answer, a 503 is

    def _whole() -> None:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        try:
            whole.append(client.completions.create(model=NAME, prompt="The river", max_tokens=120, temperature=0))
        except openai.APIStatusError as exc:
            whole.append(exc)

    waiting = threading.Thread(target=_whole)
    waiting.start()
    end = time.monotonic() + 30
    while server.loop.pending < 2 and time.monotonic() < end:
        time.sleep(0.01)
    assert server.loop.pending == 2
    server.stop()
    reader.join(30)
    waiting.join(30)
    assert got[-1].finish_reason == "abort" and not isinstance(got[-1], Exception), got[-1]
    assert isinstance(whole[0], openai.APIStatusError) and whole[0].status_code == 503, whole
    assert "stopped before this request finished" in str(whole[0].body)
    assert server.loop.finished == {"eos": 0, "length": 0, "stop": 0, "abort": 2, "failed": 0}
    assert not server.loop.alive and server.loop.failure is None
    assert engine.core.idle and engine.core.pool.count(KV) == 0




def test_serve_command_refuses_bad_options(calibrated_artifacts: Path, tmp_path: Path) -> None:
    """One ``error:`` line and exit 2, before the engine is built where it can be."""
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.role ")
    latin = tmp_path / "latin.jinja"
    latin.write_bytes("{{ 'caf\u00e9' }}".encode("latin-1"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        cases = [
            (["--port", port], f"cannot listen on 127.0.0.1:{port}"),
            (["--max-model-len", "4096"], "above the model's context of 2048"),
            (["--log-level", "loud"], "--log-level 'loud' is not one of critical, error, warning, info, debug"),
            (["--gpu-memory", "1GiB"], "need --artifacts"),
            (["--chat-template", str(tmp_path / "none.jinja")], "is not a file"),
            (["--chat-template", str(broken)], "does not render one user message (TemplateSyntaxError"),
            (["--chat-template", str(latin)], "is not UTF-8 text: re-encode it as UTF-8"),
            (["--artifacts", str(calibrated_artifacts), "--gpu-memory", "20MiB"],
             "(or lower --max-model-len, now 2048, or --max-batch, now 16)"),
        ]
        for args, words in cases:
            r = CliRunner().invoke(app, ["serve", "--device", "cpu", *args])
            lines = r.stderr.strip().splitlines()
            assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], (
                args, r.stderr)


def test_a_page_pool_larger_than_the_machine_is_one_line() -> None:
    """The 16-bit server sizes its pool for --max-batch requests of the whole context: far more than the memory
    there is (here more than a 47-bit address space, so no overcommit setting lets it through) fails in the engine
    process, which says so in one line (no traceback on the shared stderr)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "pwrun", "serve", "--device", "cpu", "--max-batch", "100000000",
                        "--port", str(free_port())], capture_output=True, text=True, env=env, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "not enough memory to build the engine" in lines[0], r.stderr
    assert "--max-batch, now 100000000" in lines[0]
