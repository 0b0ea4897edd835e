"""The serving suite's HTTP mode (``python -m bench.serving --http``): W1 through the ``pwrun serve`` server against
the same engine in-process; one record per way the server runs its engine.

W1 is ``bench.workloads.w1``: ``--workload-requests`` C4 documents (default 256) at their natural length capped at
1,024 tokens, ``--workload-gen`` greedy tokens each with no stop token, all arriving at once (a saturating rate: the
queue never runs dry), on the random-weight model and synthetic AP planes of ``--workload``. An engine built for
requests that arrive later (``w1_engine``: ``assemble_engine`` with ``max_request_tokens``, what ``pwrun serve``
builds, under ``--workload-gpu-memory``, ``--workload-max-batch`` and ``--workload-step-tokens``) serves them, each
time after a 3-token run of the same prompts (JIT and graphs out of the timing): in this process (every request
added, then stepped to the end), and through HTTP (``pwrun.serve.server.Server``, on a background thread) with the
engine in a child process (``engine`` "process": what ``pwrun serve`` runs) and on a thread of the server's process
("thread"). The client is a separate process (this module's ``main``) with one streaming ``openai.AsyncOpenAI``
request per prompt (``--http-whole``: whole responses). Both clocks start before the first request is added.
Generated tokens/s of both and their ratio (the target: HTTP at least 95% of in-process), client-side time to first
token and per output token (p50 / p99), when the last request reached the engine and the first token came back
(the share of the run outside the engine's steps that the request ramp explains), the server's
demotions and preemptions, the engine steps and their summed seconds on both sides (HTTP slower with as many
steps: the steps themselves slowed, e.g. by the event loop's share of the interpreter; more steps: requests arrived
spread out), and the server engine's seconds idle (waiting for requests) and between steps (taking requests in,
handing outputs out).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import openai
import torch

from bench.common import BENCH_PLANNER, BENCH_POLICY, SyntheticAP, random_model, synthetic_table
from bench.serving_runs import reset_peak
from bench.workloads import w1
from pwrun.core.config import EngineConfig
from pwrun.core.policy import Policy
from pwrun.core.request import Request, SamplingParams
from pwrun.data import default_model_dir
from pwrun.engine.budget import parse_size
from pwrun.engine.build import ServeConfig, assemble_engine, strip_experts
from pwrun.engine.llm_engine import LLMEngine
from pwrun.model.loader import load_spec, load_tokenizer
from pwrun.serve.generation import ServeLimits
from pwrun.serve.server import Server, free_port

HTTP = "W1 over HTTP"  # the system name of these records (bench.render shows them in a table of their own)


class _Folded:
    """The bundled tokenizer for a model of a larger vocabulary: ids folded into its own, so that every generated
    token decodes to text (as with the model's own tokenizer: the stream carries a chunk per token)."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.size = tok, len(tok)

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return str(self.tok.decode([i % self.size for i in ids], **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)


def in_process(engine: LLMEngine, prompts: list[list[int]], gen: int) -> dict[str, Any]:
    """Every prompt added at once, stepped to the end (after a 3-token run of the same prompts)."""
    rid = 0
    for n in (3, gen):
        rids = range(rid, rid + len(prompts))
        t, steps, busy = time.perf_counter(), len(engine.trace), engine.seconds  # adding is part of the run
        for r, ids in zip(rids, prompts, strict=True):
            engine.add_request(Request(r, tuple(ids), SamplingParams(max_new_tokens=n)))
        rid += len(prompts)
        outs = engine.run_until_done()
        seconds = time.perf_counter() - t
    tokens = sum(len(outs[r].token_ids) for r in rids)
    return {"in_process_s": seconds, "in_process_tokens": tokens, "in_process_tps": tokens / seconds,
            "in_process_steps": len(engine.trace) - steps, "in_process_step_s": engine.seconds - busy}


def _metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


def _client(url: str, prompts: Path, gen: int, stream: bool) -> dict[str, Any]:
    """This module's ``main`` in a subprocess (its own interpreter: the client does not share the server's): a
    3-token burst, ``/metrics``, the timed burst, ``/metrics`` again."""
    done = subprocess.run([sys.executable, "-m", "bench.serving_http", url, str(prompts), str(gen),
                           "stream" if stream else "whole"], check=True, capture_output=True, text=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def w1_engine(config_dir: Path, device: str, cfg: ServeConfig, context: int) -> LLMEngine:
    """The served engine: the random-weight model of ``config_dir`` with synthetic AP planes, for requests of up to
    ``context`` tokens that arrive later (module level: an engine process builds it)."""
    model = strip_experts(random_model(config_dir, torch.bfloat16, device), torch.device(device))
    src, table = SyntheticAP(model.spec, torch.bfloat16, device), synthetic_table(model.spec)
    return assemble_engine(model, src, table, BENCH_POLICY, None, None, cfg, SamplingParams(), [], set(),
                           max_request_tokens=context)


def over_http(engine: LLMEngine | functools.partial[LLMEngine], vocab: int, context: int, prompts: list[list[int]],
              gen: int, stream: bool) -> dict[str, Any]:
    """``engine`` (built, on a thread; or its builder, in a process) behind ``Server`` on 127.0.0.1, driven by the
    client process (``_client``)."""
    server = Server(engine, _Folded(load_tokenizer(default_model_dir())), "w1", ServeLimits(context, vocab), set(),
                    port=free_port(), max_pending=2 * len(prompts), drain_seconds=0)
    server.start()
    try:
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "prompts.json"
            path.write_text(json.dumps(prompts))
            res = _client(server.url, path, gen, stream)
    finally:
        server.stop()
    ttft, tpot, toks, accepted = (np.array(x) for x in zip(*res["per"], strict=True))

    def delta(name: str) -> float:
        return float(res["after"].get(name, 0.0) - res["before"].get(name, 0.0))

    return {"http_s": res["seconds"], "http_tokens": int(toks.sum()), "http_tps": float(toks.sum()) / res["seconds"],
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tpot_p50_ms": 1e3 * float(np.percentile(tpot, 50)) if stream else None,
            "tpot_p99_ms": 1e3 * float(np.percentile(tpot, 99)) if stream else None,
            # where time outside the engine's steps can go: the last request reaching the engine (the ramp) and
            # the first token back at the client, both from the burst's start
            "all_accepted_s": float(np.max(accepted)) if stream else None,
            "first_token_s": float(np.min(ttft)),
            "demoted_blocks": delta("pwrun_demoted_blocks_total"),
            "promoted_blocks": delta("pwrun_promoted_blocks_total"),
            "preemptions": delta("pwrun_preemptions_total"),
            "http_steps": delta("pwrun_engine_step_seconds_count"),
            "http_step_s": delta("pwrun_engine_step_seconds_sum"),
            # the engine's time besides its steps: waiting for requests, and between steps with requests to run
            "http_idle_s": delta("pwrun_engine_idle_seconds_total"),
            "http_between_s": delta("pwrun_engine_between_steps_seconds_total")}


def http_vs_in_process(args: argparse.Namespace, emit: Any) -> None:
    """Two records: W1 in-process, then over HTTP with the engine in a process and on a thread (fresh builds)."""
    dev = args.device
    spec, _ = load_spec(args.config_dir)
    vocab = spec.vocab_size  # the bundled tokenizer's ids, folded into a smaller test vocabulary
    prompts = [[i % vocab for i in r] for r in w1(args.workload_requests or 256)]
    gen = args.workload_gen
    context = min(max(map(len, prompts)) + gen, spec.max_position_embeddings)
    bits = 4 if args.http_policy == "uniform" else None
    cfg = ServeConfig(parse_size(args.workload_gpu_memory), Policy.named(args.http_policy, bits),
                      EngineConfig(max_batch=args.workload_max_batch, max_step_tokens=args.workload_step_tokens),
                      BENCH_PLANNER)
    build = functools.partial(w1_engine, args.config_dir, dev, cfg, context)
    rec: dict[str, Any] = {"model": args.config_dir.name, "system": HTTP, "policy": args.http_policy, "bits": bits,
                           "gpu_memory": args.workload_gpu_memory, "requests": len(prompts),
                           "prompt_tokens": sum(map(len, prompts)), "gen": gen, "max_batch": args.workload_max_batch,
                           "max_step_tokens": args.workload_step_tokens, "context": context,
                           "stream": not args.http_whole, "client_prompt": "extra_body"}
    rec |= in_process(build(), prompts, gen)
    reset_peak(dev)
    for mode in args.http_engines.split(","):
        run = rec | {"engine": mode}
        run |= over_http(build if mode == "process" else build(), vocab, context, prompts, gen, not args.http_whole)
        reset_peak(dev)
        run["http_over_in_process"] = run["http_tps"] / run["in_process_tps"]
        emit(run)


async def _burst(url: str, prompts: list[list[int]], gen: int, stream: bool = True) -> dict[str, Any]:
    """All prompts at once as streaming completions: wall seconds, and per request (TTFT s, mean TPOT s, tokens,
    seconds from the burst's start to the server's response headers). Without ``stream``: whole responses (TTFT and
    TPOT then span the whole request; no header time)."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)

    async def one(ids: list[int]) -> tuple[float, float, int, float]:
        t0 = time.perf_counter()
        # the token ids go in the body as they are: the client's type transform of a ``prompt`` argument visits
        # every id in Python (8 ms per 700-token prompt; 256 prompts took 3.7 s to leave the client, and the server
        # waited for them), a cost of this load generator that a server cannot change
        prompt: dict[str, Any] = {"prompt": "", "extra_body": {"prompt": ids}}
        if not stream:
            whole = await client.completions.create(model="w1", max_tokens=gen, temperature=0, **prompt)
            assert whole.usage is not None
            return time.perf_counter() - t0, math.nan, whole.usage.completion_tokens, math.nan
        first = last = t0
        tokens = 0
        chunks = await client.completions.create(model="w1", max_tokens=gen, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}, **prompt)
        accepted = time.perf_counter() - t  # the server answered with its headers: the request is in the engine
        async for chunk in chunks:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                first = now if first == t0 else first
                last = now
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return first - t0, (last - first) / max(tokens - 1, 1), tokens, accepted

    t = time.perf_counter()
    per = await asyncio.gather(*(one(ids) for ids in prompts))
    seconds = time.perf_counter() - t
    await client.close()
    return {"seconds": seconds, "per": per}


def main() -> None:
    """The client: ``python -m bench.serving_http URL PROMPTS.json GEN stream|whole`` prints one JSON line: the timed
    burst (``_burst``) and the server's metrics before and after it."""
    url, path, gen, stream = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "stream"
    prompts = json.loads(path.read_text())
    asyncio.run(_burst(url, prompts, 3, stream))
    before = _metrics(url)
    res = asyncio.run(_burst(url, prompts, gen, stream))
    print(json.dumps({**res, "before": before, "after": _metrics(url)}))


if __name__ == "__main__":
    main()
