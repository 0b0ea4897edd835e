"""``pwrun serve``: the OpenAI-compatible HTTP server (Typer command; ``pwrun.cli`` registers it). Wiring only:
it checks the options and runs ``pwrun.serve.server.Server``, whose engine process builds the engine as ``pwrun
generate`` does.
"""

from __future__ import annotations

import functools
import math
import signal
from pathlib import Path
from typing import Annotated, Any

import typer

from pwformat.errors import BudgetTooSmall, PagedWeightError
from pwformat.jsonl import not_utf8
from pwrun.cli_common import (
    DEFAULT_RELOAD_RESERVE,
    BitsOpt,
    DeviceOpt,
    DtypeOpt,
    GpuMemoryOpt,
    MaxMeanBitsOpt,
    ModelOpt,
    NoVerifyOpt,
    PolicyOpt,
    ReloadReserveOpt,
    ThreadsOpt,
    budget_bytes,
    check_planner_flags,
    default_model,
    make_console,
    open_artifact,
    policy_dtype,
    reload_reserve,
    set_threads,
    user_errors,
    warn_missing_tables,
)
from pwrun.core.config import CPU_MAX_BATCH, CPU_STEP_TOKENS, GPU_MAX_BATCH, GPU_STEP_TOKENS, EngineConfig
from pwrun.core.policy import Policy
from pwrun.engine.budget import format_budget
from pwrun.engine.build import ServeConfig
from pwrun.generate import eos_ids
from pwrun.model.loader import load_spec, load_tokenizer, resolve_device
from pwrun.serve.builder import build_serving_engine

console = make_console(stderr=True)


def _start_line(info: dict[str, Any], name: str, url: str, context: int, max_batch: int, max_queue: int) -> str:
    """The start-up line: where the model is served, its policy and device, the request limits and, when the
    engine runs under a budget (``info`` from the build), the budget's split as ``pwrun generate`` prints it."""
    line = (f"serving {name} on {url}/v1 ({info.get('policy')}, {info.get('device')}, context {context} tokens, "
            f"{max_batch} running + {max_queue} queued at most)")
    if "gpu_memory" not in info:
        return line
    return line + "; " + format_budget(info["gpu_memory"], info["dtype"], info["fixed_bytes"],
                                       info["workspace_bytes"], info["pool_bytes"])


def serve(
    model: ModelOpt = None,
    artifacts: Annotated[Path | None, typer.Option(help="Artifact directory from `pwcal run-all`: serve with the page "
                                                   "pool under --gpu-memory. Without it: the 16-bit model (under "
                                                   "--gpu-memory with --policy 16-bit).")] = None,
    gpu_memory: GpuMemoryOpt = None,
    policy: PolicyOpt = "pagedweight",
    bits: BitsOpt = None,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port.")] = 8000,
    max_model_len: Annotated[int | None, typer.Option(min=2, help="Prompt + generated tokens of one request at most "
                                                      "(default: the model's context). The budget provisions "
                                                      "--max-batch requests of this length; longer ones get a "
                                                      "400.")] = None,
    max_batch: Annotated[int | None, typer.Option(min=1, help="Most requests running at once (default 64 on a "
                                                  "GPU, 16 on the CPU; as `pwrun generate`).")] = None,
    max_step_tokens: Annotated[int | None, typer.Option(min=1, help="Most tokens per engine step (longer prompts are "
                                                        "prefilled in chunks; default 2048 on a GPU, 512 on the "
                                                        "CPU).")] = None,
    max_queue: Annotated[int, typer.Option(min=0, help="Requests that may wait beyond the --max-batch running ones; "
                                           "past that the server answers 503.")] = 256,
    served_model_name: Annotated[str | None, typer.Option(help="The model name clients give (default: the model "
                                                          "directory's name).")] = None,
    chat_template: Annotated[Path | None, typer.Option(help="A Jinja chat template file for /v1/chat/completions "
                                                       "(default: the tokenizer's own, if it has one).")] = None,
    drain_seconds: Annotated[float, typer.Option(min=0, help="On SIGTERM or Ctrl-C: seconds the running requests "
                                                 "may take to finish before they are aborted.")] = 30.0,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    debug_checks: Annotated[bool, typer.Option(help="Assert page conservation and q <= resident planes after "
                                               "every step.")] = False,
    reload_reserve_tokens: ReloadReserveOpt = DEFAULT_RELOAD_RESERVE,
    max_mean_bits: MaxMeanBitsOpt = None,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level: warning, info (one line per request), "
                                           "debug.")] = "info",
    no_verify: NoVerifyOpt = False,
    threads: ThreadsOpt = None,
) -> None:
    """Serve the model over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics (Prometheus)."""
    # the HTTP stack (FastAPI, pydantic, uvicorn) loads only here: `pwrun generate` neither needs nor waits for it
    from pwrun.serve.generation import ServeLimits
    from pwrun.serve.server import LOG_LEVELS, Server, check_listen

    with user_errors():
        set_threads(threads)
        model_dir = model or default_model()
        spec, _ = load_spec(model_dir)
        context = max_model_len or spec.max_position_embeddings
        if context > spec.max_position_embeddings:
            raise PagedWeightError(f"--max-model-len {context} is above the model's context of "
                                   f"{spec.max_position_embeddings} tokens")
        dense = policy == "16-bit"
        dtype = policy_dtype(dtype, policy)
        if dense and artifacts is not None:
            raise PagedWeightError("--policy 16-bit serves the checkpoint's own experts: drop --artifacts")
        budget = budget_bytes(gpu_memory)
        reserve = reload_reserve(reload_reserve_tokens)
        if artifacts is None and not dense and (gpu_memory is not None or bits is not None
                                                 or policy != "pagedweight"):
            raise PagedWeightError("--gpu-memory, --policy and --bits need --artifacts DIR (from `pwcal run-all`), or "
                                   "--policy 16-bit for the 16-bit experts under a budget")
        if not math.isfinite(drain_seconds):
            raise PagedWeightError(f"--drain-seconds {drain_seconds} is not allowed: give a number of seconds >= 0")
        if log_level not in LOG_LEVELS:
            raise PagedWeightError(f"--log-level {log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        check_listen(host, port)
        gpu = resolve_device(device).type == "cuda"
        max_batch = max_batch or (GPU_MAX_BATCH if gpu else CPU_MAX_BATCH)
        max_step_tokens = max_step_tokens or (GPU_STEP_TOKENS if gpu else CPU_STEP_TOKENS)
        tok = load_tokenizer(model_dir)
        if chat_template is not None:
            if not chat_template.is_file():
                raise PagedWeightError(f"--chat-template {chat_template} is not a file: give a Jinja template file")
            try:
                tok.chat_template = chat_template.read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise not_utf8(chat_template) from exc
            try:
                tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                        add_generation_prompt=True)
            except Exception as exc:  # jinja2's syntax and render errors
                raise PagedWeightError(f"--chat-template {chat_template} does not render one user message "
                                       f"({type(exc).__name__}: {exc}): fix the template") from None
        serve_policy = Policy.named(policy, bits)
        check_planner_flags(serve_policy, max_mean_bits, reload_reserve_tokens)
        if artifacts is not None:
            art = open_artifact(artifacts, model_dir, not no_verify)
            serve_policy.check_bits(art.bits)
            warn_missing_tables(art, [policy], model_dir)
        cfg = ServeConfig(budget, serve_policy,
                          EngineConfig(max_batch=max_batch, max_step_tokens=max_step_tokens, debug_checks=debug_checks,
                                       reload_reserve_tokens=reserve, max_mean_bits=max_mean_bits))
        name = served_model_name or Path(model_dir).resolve().name
        build = functools.partial(build_serving_engine, model_dir, artifacts, cfg, context, device, dtype)
        server = Server(build, tok, name, ServeLimits(context, spec.vocab_size), eos_ids(spec.eos_token_ids, tok),
                        host, port, max_batch + max_queue, drain_seconds, log_level)
        try:
            # a spinner on a terminal while the engine builds (tens of seconds at real size); nothing in a log
            with console.status(f"building the engine for {name}: weights, page pool, kernel warm-up"):
                server.open()
        except BudgetTooSmall as exc:
            raise PagedWeightError(f"{exc} (or lower --max-model-len, now {context}, or --max-batch, now "
                                   f"{max_batch})") from exc
        console.print(_start_line(server.loop.info, name, server.url, context, max_batch, max_queue), style="dim",
                      highlight=False, soft_wrap=True)
        caught: list[int] = []
        previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum))
                    for s in (signal.SIGTERM, signal.SIGINT)}  # uvicorn re-raises the signal it stopped on
        try:
            server.run()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        done, failure = server.loop.finished, server.loop.failure
        finished = done["eos"] + done["length"] + done["stop"]
        line = (f"stopped{' (' + signal.Signals(caught[0]).name + ')' if caught else ''}: "
                f"{_requests(finished)} finished, {done['abort']} aborted")
        if failure is not None:
            console.print(f"error: {line}, {done['failed']} failed: {failure}", highlight=False, soft_wrap=True)
            raise typer.Exit(1)
        console.print(line, style="dim", highlight=False, soft_wrap=True)


def _requests(n: int) -> str:
    return f"{n} request{'' if n == 1 else 's'}"
