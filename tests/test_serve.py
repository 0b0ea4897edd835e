"""``pwrun serve`` through the official ``openai`` client (the real tiny MoE, CPU, servers on 127.0.0.1).

- Completions (a list of prompts, streamed or not) give the same greedy and seeded-sampled text as ``pwrun generate
  --prompts`` with the same budget; the 16-bit server the same as ``pwrun.generate.generate``.
- Chat through a chat template equals a completion of the rendered template; without a template: a 400 saying so.
- A stop string ends the text just before it (``finish_reason`` "stop"), streamed or not.
- Every error case: unsupported parameters named, another model (404), a prompt past the context (400 with the
  limit), bad values, bad JSON, a token id outside the vocabulary, a full queue (503).
- Concurrent clients under a budget that forces demotions and preemptions: every response complete, nothing lost,
  pages conserved and no request record left afterwards.
- A client that disconnects mid-stream: its request is aborted and its KV pages return to the pool.
- Stopping the server: ``test_serve_stop.py``.
The ``big`` server steps its engine on a thread (``EngineLoop``); the ``tight`` one, like ``pwrun serve``, in a
child process (``EngineProcess``).
"""

from __future__ import annotations

import functools
import http.client
import json
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from _serve_state import held_state
from typer.testing import CliRunner

from pwrun.cli import app
from pwrun.core.config import EngineConfig
from pwrun.core.request import SamplingParams
from pwrun.data import default_model_dir, document_prompts, read_text
from pwrun.engine.build import ServeConfig, dense_server_engine
from pwrun.generate import eos_ids, generate
from pwrun.model import loader
from pwrun.model.loader import load_model, load_spec, load_tokenizer, token_chars
from pwrun.serve.builder import build_serving_engine
from pwrun.serve.generation import ServeLimits, body_limit
from pwrun.serve.server import Server, free_port
from pwrun.serve.text import ChoiceText

MODEL = default_model_dir()
NAME = "tiny"
CONTEXT = 256
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(MODEL)


def _server(engine: Any, tok: Any, context: int, max_pending: int = 64) -> Server:
    spec, _ = load_spec(MODEL)
    server = Server(engine, tok, NAME, ServeLimits(context, spec.vocab_size), eos_ids(spec.eos_token_ids, tok),
                    port=free_port(), max_pending=max_pending, drain_seconds=5)
    server.start()
    return server


@pytest.fixture(scope="module")
def big(calibrated_artifacts: Path, tok: Any) -> Iterator[Server]:
    """A budget larger than everything: every expert block at 8 bits, no page moves."""
    engine = build_serving_engine(MODEL, calibrated_artifacts, ServeConfig(2**30), CONTEXT, "cpu")
    server = _server(engine, tok, CONTEXT)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tight(calibrated_artifacts: Path, tok: Any) -> Iterator[Server]:
    """A budget with the experts a little above their floors and KV room for ~10 short requests: running 16 makes
    the planner demote and the scheduler preempt. Page conservation is asserted after every step. The engine is
    built and stepped in a child process, as ``pwrun serve`` does."""
    ecfg = EngineConfig(max_batch=16, max_step_tokens=256, debug_checks=True)
    probe = build_serving_engine(MODEL, calibrated_artifacts, ServeConfig(2**30, engine=ecfg), 96, "cpu").info
    budget = (probe["fixed_bytes"] + probe["workspace_bytes"] + probe["floor_expert_bytes"] + 2 * 10**6
              + 10 * probe["kv_block_bytes"])
    build = functools.partial(build_serving_engine, MODEL, calibrated_artifacts, ServeConfig(budget, engine=ecfg),
                              96, "cpu")
    server = _server(build, tok, 96, max_pending=512)
    yield server
    server.stop()


def _client(server: Server, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=timeout)


def _prompts(n: int) -> list[str]:
    return [" ".join(p.split()[:12]) for p in document_prompts("c4", n, 400, min_chars=100)]


def _metrics(server: Server) -> dict[str, float]:
    text = urllib.request.urlopen(f"{server.url}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


def _engine_state(server: Server) -> dict[str, int]:
    """``held_state`` at a step boundary, where the engine runs (its thread or its process)."""
    return server.loop.call(held_state).result(timeout=30)


def _generate_cli(tmp_path: Path, artifacts: Path, prompts: list[str], *extra: str) -> list[dict[str, Any]]:
    f, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    r = CliRunner().invoke(app, ["generate", "--prompts", str(f), "--artifacts", str(artifacts), "--gpu-memory",
                                 "1GiB", "--device", "cpu", "--output", str(out), *extra])
    assert r.exit_code == 0, r.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def _stream_texts(stream: Any, n: int) -> tuple[list[str], list[str | None]]:
    texts, finish = [""] * n, [None] * n
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    return texts, finish


def test_completions_equal_pwrun_generate(big: Server, calibrated_artifacts: Path, tmp_path: Path, tok: Any) -> None:
    prompts = _prompts(4)
    client = _client(big)
    for extra, sampling in (([], {"temperature": 0}), (["--temperature", "0.9", "--top-p", "0.9", "--seed", "5"],
                                                      {"temperature": 0.9, "top_p": 0.9, "seed": 5})):
        want = _generate_cli(tmp_path, calibrated_artifacts, prompts, "--max-new-tokens", "12", *extra)
        got = client.completions.create(model=NAME, prompt=prompts, max_tokens=12, **sampling)  # type: ignore[call-overload]
        assert [c.text for c in got.choices] == [w["text"] for w in want]
        assert [c.finish_reason for c in got.choices] == [{"eos": "stop"}.get(w["finish_reason"], w["finish_reason"])
                                                           for w in want]
        assert got.usage.prompt_tokens == sum(w["prompt_tokens"] for w in want)
        assert got.usage.completion_tokens == sum(w["new_tokens"] for w in want)
        stream = client.completions.create(model=NAME, prompt=prompts, max_tokens=12, stream=True, **sampling)  # type: ignore[call-overload]
        texts, finish = _stream_texts(stream, len(prompts))
        assert texts == [w["text"] for w in want] and finish == [c.finish_reason for c in got.choices]
    ids = client.completions.create(model=NAME, prompt=tok(prompts[0]).input_ids, max_tokens=12, temperature=0)
    assert ids.choices[0].text == _greedy(big, prompts[0])  # token ids as the prompt: as its text


def _greedy(server: Server, prompt: str, max_tokens: int = 12) -> str:
    return str(_client(server).completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens,
                                                  temperature=0).choices[0].text)


def test_the_16_bit_server_equals_generate(tok: Any) -> None:
    prompts = _prompts(3)
    model = load_model(MODEL, device="cpu")
    want, _ = generate(model, tok, prompts, SamplingParams(max_new_tokens=10))
    server = _server(dense_server_engine(load_model(MODEL, device="cpu"), EngineConfig(), CONTEXT), tok, CONTEXT)
    try:
        got = _client(server).completions.create(model=NAME, prompt=prompts, max_tokens=10, temperature=0)
    finally:
        server.stop()
    assert [c.text for c in got.choices] == [g.text for g in want]


def test_chat_uses_the_template_or_says_there_is_none(big: Server, tok: Any) -> None:
    client = _client(big)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The river"}]
    with pytest.raises(openai.BadRequestError, match=r"has no chat template.*--chat-template"):
        client.chat.completions.create(model=NAME, messages=messages)  # type: ignore[arg-type]
    tok.chat_template = TEMPLATE
    try:
        got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10,  # type: ignore[arg-type]
                                             temperature=0)
        stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10,  # type: ignore[arg-type]
                                                temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
    finally:
        tok.chat_template = None
    rendered = "<|system|> Be brief.\n<|user|> The river\n<|assistant|>"
    ids = tok(rendered, add_special_tokens=False).input_ids
    want = client.completions.create(model=NAME, prompt=ids, max_tokens=10, temperature=0).choices[0]
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason and got.usage.prompt_tokens == len(ids)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == got.usage.completion_tokens


def test_stop_strings_end_the_text_before_them(big: Server) -> None:
    prompt = _prompts(1)[0]
    full = _greedy(big, prompt, 16)
    stop = full[len(full) // 3:len(full) // 3 + 3]
    want = full[:full.index(stop)]
    client = _client(big)
    key = 'pwrun_requests_finished_total{finish="%s"}'
    before = _metrics(big)
    got = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "\x00"])
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stop=stop, stream=True)
    assert _stream_texts(stream, 1) == ([want], ["stop"])
    end = time.monotonic() + 10  # the engine's abort of a stopped request reaches the metrics after its response
    while _metrics(big).get(key % "stop", 0) < before.get(key % "stop", 0) + 2 and time.monotonic() < end:
        time.sleep(0.05)
    after = _metrics(big)
    for finish, more in (("stop", 2), ("abort", 0)):  # counted as stop strings, not as aborts
        assert after.get(key % finish, 0) - before.get(key % finish, 0) == more, finish


def test_choice_text_equals_a_full_decode_cut_at_the_stop(tok: Any) -> None:
    """Deltas fed one token at a time, against decoding everything at once and cutting at the first stop string."""
    ids = tok(read_text("wikitext2")[:20_000], add_special_tokens=False, verbose=False).input_ids
    rng = np.random.default_rng(0)
    for trial in range(30):
        start = int(rng.integers(0, len(ids) - 64))
        seq = ids[start:start + int(rng.integers(1, 64))]
        if trial % 3 == 0:  # ragged bytes: tokens that split characters
            seq = [int(t) for t in rng.integers(0, tok.vocab_size, len(seq))]
        full = tok.decode(seq, skip_special_tokens=True)
        stops = [] if trial % 2 else [full[k:k + int(rng.integers(1, 5))] for k in rng.integers(0, len(full) + 1, 2)]
        stops = [s for s in stops if s]
        cuts = [full.find(s) for s in stops if full.find(s) != -1]
        want = full[:min(cuts)] if cuts else full
        text, got = ChoiceText(tok, stops), ""
        for n in range(1, len(seq) + 1):
            got += text.feed(seq[:n], final=n == len(seq))
            if text.stopped:
                break
        assert got == want and text.stopped == bool(cuts), (seq, stops)


def _status(err: openai.APIStatusError) -> tuple[int, str]:
    return err.status_code, str(err.body)


@pytest.mark.parametrize(("kwargs", "status", "words"), [
    ({"n": 2}, 400, ["unsupported", "n"]),
    ({"logprobs": 2}, 400, ["unsupported", "logprobs"]),
    ({"extra_body": {"frequency_penalty": 0.5, "mirostat": 1}}, 400, ["frequency_penalty", "mirostat"]),
    ({"model": "gpt-4"}, 404, ["'gpt-4' does not exist", NAME]),
    ({"prompt": "word " * 300}, 400, [f"maximum context length is {CONTEXT} tokens", "prompt has"]),
    ({"max_tokens": CONTEXT}, 400, [f"maximum context length is {CONTEXT}", "max_tokens"]),
    ({"temperature": -1}, 400, ["temperature"]),
    ({"temperature": 1e-300}, 400, ["temperature", "0.001"]),
    ({"top_p": 0}, 400, ["top_p"]),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, ["stop", "at most 4"]),
    ({"prompt": [1, 2, 10**6]}, 400, ["token id 1000000", "vocabulary"]),
    ({"prompt": []}, 400, ["prompt"]),
    ({"max_tokens": "8"}, 400, ["max_tokens"]),  # a string is not a number, as for OpenAI's API
    ({"extra_body": {"stream": "yes"}}, 400, ["stream"]),
])
def test_bad_requests_say_what_is_wrong(big: Server, kwargs: dict[str, Any], status: int, words: list[str]) -> None:
    args: dict[str, Any] = {"model": NAME, "prompt": "The river", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        _client(big).completions.create(**args)
    code, body = _status(info.value)
    assert code == status and all(w in body for w in words), body


def test_bad_json_and_a_full_queue(big: Server) -> None:
    req = urllib.request.Request(f"{big.url}/v1/completions", data=b"{not json", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 400 and "not valid JSON" in info.value.read().decode()
    before, big.loop._pending = big.loop._pending, big.loop.max_pending  # a full queue
    try:
        with pytest.raises(openai.InternalServerError) as full:
            _client(big).completions.create(model=NAME, prompt="The river", max_tokens=4)
    finally:
        big.loop._pending = before
    assert full.value.status_code == 503 and "busy" in str(full.value.body)
    assert full.value.response.headers["Retry-After"] == "1"
    for method, path, status in (("GET", "/v1/nope", 404), ("GET", "/v1/completions", 405)):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(urllib.request.Request(f"{big.url}{path}", method=method), timeout=10)
        err = json.loads(info.value.read())["error"]
        assert info.value.code == status and path in err["message"] and err["type"], err
    assert _metrics(big)['pwrun_requests_refused_total{status="503"}'] >= 1


def _declared(server: Server, length: int, sent: bytes, close: bool) -> bytes:
    """A POST whose headers declare ``length`` body bytes, of which only ``sent`` are sent; the raw answer (none
    when ``close``: the client closes at once)."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {length}\r\n\r\n".encode() + sent)
        if close:
            return b""
        data = b""
        while True:  # the head, then as many body bytes as its content-length says (they may come in pieces)
            head, _, body = data.partition(b"\r\n\r\n")
            size = re.search(rb"content-length: (\d+)", head, re.I)
            if size is not None and len(body) >= int(size.group(1)):
                return data
            part = sock.recv(65536)
            if not part:
                return data
            data += part


def test_a_huge_declared_body_is_refused_unread_and_a_client_leaving_mid_body_is_no_error(big: Server) -> None:
    refused = _metrics(big).get('pwrun_requests_refused_total{status="400"}', 0)
    answer = _declared(big, 10**12, b'{"model": ', close=False)  # the 413 comes without waiting for a TB
    assert answer.startswith(b"HTTP/1.1 413") and b"declares 1000000000000 bytes" in answer, answer[:300]
    _declared(big, 1000, b'{"model": "x", "prompt": "The', close=True)
    end = time.monotonic() + 30
    while _metrics(big).get('pwrun_requests_refused_total{status="400"}', 0) == refused and time.monotonic() < end:
        time.sleep(0.05)
    assert _metrics(big).get('pwrun_requests_refused_total{status="400"}', 0) == refused + 1  # an answered error
    assert _metrics(big).get('pwrun_requests_refused_total{status="500"}', 0) == 0


def _post_raw(server: Server, data: bytes) -> tuple[int, str]:
    req = urllib.request.Request(f"{server.url}/v1/completions", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_bodies_that_cannot_be_served_are_refused_with_a_4xx(big: Server, tok: Any) -> None:
    """Each answered with its own 4xx, none with a 500; the long ones before the tokenizer sees them."""
    spec, _ = load_spec(MODEL)
    limit = body_limit(ServeLimits(CONTEXT, spec.vocab_size), big.loop.max_pending, tok)
    head = b'{"model": "' + NAME.encode() + b'", "max_tokens": 3, "prompt": '
    code, body = _post_raw(big, head + b"[" * 100_000 + b"]" * 100_000 + b"}")  # nested past the JSON parser
    assert code == 400 and "not valid JSON" in body, body
    code, body = _post_raw(big, head + b'"\\ud800 x"}')  # an unpaired surrogate: valid JSON, no text
    assert code == 400 and "not valid Unicode" in body and "lone surrogate" in body, body
    code, body = _post_raw(big, head + b'"' + b"a" * limit + b'"}')
    assert code == 413 and f"more than this server takes ({limit}" in body, body
    most = CONTEXT * token_chars(tok)
    code, body = _post_raw(big, head + json.dumps("a" * (most + 1)).encode() + b"}")
    assert code == 400 and f"the prompt has {most + 1} characters" in body, body
    code, body = _post_raw(big, head + json.dumps(["a"] * (big.loop.max_pending + 1)).encode() + b"}")
    assert code == 400 and f"holds at most {big.loop.max_pending} requests" in body, body
    assert _metrics(big).get('pwrun_requests_refused_total{status="500"}', 0) == 0


def test_models_health_and_metrics(big: Server) -> None:
    assert [m.id for m in _client(big).models.list().data] == [NAME]
    assert json.loads(urllib.request.urlopen(f"{big.url}/health", timeout=10).read()) == {"status": "ok"}
    m = _metrics(big)
    pages = _engine_state(big)
    assert m["pwrun_pool_pages"] == pages["pages"] and m["pwrun_weight_pages"] == pages["weight"]
    assert m["pwrun_mean_committed_bits"] == 8.0  # the budget holds every block at 8 bits
    for name in ("pwrun_time_to_first_token_seconds_count", "pwrun_time_per_output_token_seconds_count",
                 "pwrun_demoted_blocks_total", "pwrun_promoted_blocks_total", "pwrun_preemptions_total",
                 "pwrun_requests_running", "pwrun_requests_waiting", "pwrun_kv_pages"):
        assert name in m
    idle = m["pwrun_engine_idle_seconds_total"]  # counted while the engine waits, not only when the wait ends
    time.sleep(2.5)
    assert _metrics(big)["pwrun_engine_idle_seconds_total"] >= idle + 1.0


# Concurrent load: CLIENTS threads, each with its own openai client, send REQUESTS requests between them
CLIENTS, REQUESTS, NEW = 32, 96, 6


def test_concurrent_clients_under_pressure_lose_nothing(tight: Server, tok: Any) -> None:
    text = read_text("wikitext2")[:60_000].split()
    rng = np.random.default_rng(1)
    jobs = []
    for i in range(REQUESTS):
        start = int(rng.integers(0, len(text) - 50))
        jobs.append((i, " ".join(text[start:start + int(rng.integers(5, 40))])))
    before = _metrics(tight)

    def run(job: tuple[int, str]) -> tuple[str, str | None, int]:
        i, prompt = job
        client = _client(tight, timeout=120)
        sampling: dict[str, Any] = {"temperature": 0} if i % 2 else {"temperature": 0.8, "seed": i}
        if i % 4 == 3:
            texts, finish = _stream_texts(client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW,
                                                                   stream=True, **sampling), 1)
            return texts[0], finish[0], -1
        c = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, **sampling)
        return c.choices[0].text, c.choices[0].finish_reason, c.usage.completion_tokens  # type: ignore[union-attr]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(run, jobs))
    seconds = time.perf_counter() - t0
    assert len(results) == REQUESTS
    assert all(finish in ("length", "stop") for _, finish, _ in results)
    assert all(n == NEW for _, finish, n in results if finish == "length" and n >= 0)
    after = _metrics(tight)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    finished = delta('pwrun_requests_finished_total{finish="length"}') + delta(
        'pwrun_requests_finished_total{finish="eos"}')
    assert finished == REQUESTS and delta('pwrun_requests_finished_total{finish="abort"}') == 0
    assert delta("pwrun_demoted_blocks_total") > 0 and delta("pwrun_preemptions_total") > 0, after
    state = _engine_state(tight)
    assert state["kv"] == 0 and state["requests"] == state["outputs"] == state["running"] == 0
    assert state["weight"] + state["free"] == state["pages"]
    print(f"{REQUESTS} requests from {CLIENTS} clients in {seconds:.1f} s")


def test_a_client_gone_mid_stream_is_aborted_and_its_pages_freed(tight: Server) -> None:
    before = _metrics(tight)
    stream = _client(tight).completions.create(model=NAME, prompt=_prompts(1)[0], max_tokens=60, temperature=0,
                                               stream=True)
    next(iter(stream))  # the request runs: its KV blocks are mapped
    assert _engine_state(tight)["kv"] > 0
    stream.close()
    end = time.monotonic() + 30
    while time.monotonic() < end:
        m = _metrics(tight)
        if m.get('pwrun_requests_finished_total{finish="abort"}', 0) > before.get(
                'pwrun_requests_finished_total{finish="abort"}', 0):
            break
        time.sleep(0.05)
    assert m['pwrun_requests_finished_total{finish="abort"}'] == before.get(
        'pwrun_requests_finished_total{finish="abort"}', 0) + 1
    assert m["pwrun_kv_pages"] == 0
    state = _engine_state(tight)
    assert state["kv"] == 0 and state["requests"] == 0 and state["weight"] + state["free"] == state["pages"]


def test_a_client_gone_while_waiting_for_a_whole_response_is_aborted(big: Server) -> None:
    """Without streaming the server notices the closed connection by polling (every 0.5 s). The client hangs up
    once its request runs (a client timing out before the server has read its request has asked for nothing)."""
    aborts = 'pwrun_requests_finished_total{finish="abort"}'
    before = _metrics(big).get(aborts, 0)
    conn = http.client.HTTPConnection(big.host, big.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": NAME, "prompt": "The river", "max_tokens": 240,
                                                        "temperature": 0}), {"Content-Type": "application/json"})
    end = time.monotonic() + 30
    while _metrics(big).get("pwrun_requests_running", 0) < 1 and time.monotonic() < end:
        time.sleep(0.01)
    conn.close()
    while _metrics(big).get(aborts, 0) == before and time.monotonic() < end:
        time.sleep(0.05)
    assert _metrics(big)[aborts] == before + 1
    state = _engine_state(big)
    assert state["kv"] == 0 and state["requests"] == 0


def test_token_chars_is_measured_per_tokenizer_and_forgotten_with_it() -> None:
    class Vocab:
        def __init__(self, tokens: list[str]) -> None:
            self.tokens = tokens

        def __len__(self) -> int:
            return len(self.tokens)

        def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
            return [self.tokens[i] for i in ids]

    import gc

    a, b = Vocab(["ab", "abcdef"]), Vocab(["x"])
    assert token_chars(a) == 6 and token_chars(b) == 1 and token_chars(object()) == 64
    gc.collect()  # other tests' tokenizers that are garbage go now, not between the two counts
    held = len(loader._TOKEN_CHARS)
    del a
    gc.collect()
    c = Vocab(["abcdefghij"])  # may reuse the freed object's id: it gets its own figure
    assert len(loader._TOKEN_CHARS) == held - 1
    assert token_chars(c) == 10 and len(loader._TOKEN_CHARS) == held
