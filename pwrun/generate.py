"""Text generation: the one loop over the engine, for the 16-bit model and for AP artifacts under a budget.

What it does: tokenizes prompts (checking each fits the model's context with its generation), builds the
engine (``build_engine``: AP experts in a page pool under ``--gpu-memory`` with the chosen policy;
``build_dense_engine``: the checkpoint's 16-bit experts in that pool, under ``--gpu-memory`` with ``--policy
16-bit`` or, without a budget, with the memory the run needs; ``generate``: the reference twin, a loaded model's
own experts through the reference MoE, every prompt in one prefill step), runs
it to completion, each request arriving at its time of an ``ArrivalSchedule`` (default: all at t=0), streaming
each request's new text through ``on_text``, and returns one ``Generation`` per prompt with its serving times.
Nothing is dropped: every request runs to EOS or ``max_new_tokens``. A stop (Ctrl-C, SIGTERM) raises
``GenerationStopped`` with the requests that had finished, so that a caller can keep them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pwformat.errors import PagedWeightError
from pwrun.core.arrivals import ArrivalSchedule
from pwrun.core.latency import SLO, LatencyStats, RequestTimes, latency_stats
from pwrun.core.request import RequestOutput, SamplingParams
from pwrun.engine.build import ServeConfig, build_engine, dense_engine
from pwrun.engine.build_dense import build_dense_engine
from pwrun.engine.llm_engine import LLMEngine
from pwrun.engine.report import RunSummary, summarize, write_trace
from pwrun.model.lean import LeanMoEModel
from pwrun.model.loader import check_token_ids, load_spec, token_chars


@dataclass
class Generation:
    """One request's result: ``text`` is the continuation only; ``times``: its arrival, first scheduled, first token
    and finish, seconds from the start of the run."""

    prompt: str
    text: str
    prompt_tokens: int
    new_tokens: int
    finish_reason: str  # "eos" or "length"
    times: RequestTimes | None = None

    def record(self) -> dict[str, object]:
        """The JSON line of ``--output``: text, token counts, finish reason and the serving times (seconds; TPOT
        is None below two tokens)."""
        out: dict[str, object] = {"prompt": self.prompt, "text": self.text, "prompt_tokens": self.prompt_tokens,
                                  "new_tokens": self.new_tokens, "finish_reason": self.finish_reason}
        if self.times is not None:
            t = self.times
            out |= {"arrival_s": t.arrival, "scheduled_s": t.scheduled, "first_token_s": t.first_token,
                    "finish_s": t.finish, "queue_s": t.queueing, "ttft_s": t.ttft, "tpot_s": t.tpot}
        return out


class GenerationStopped(KeyboardInterrupt):
    """A run stopped by ``cause`` (Ctrl-C's ``KeyboardInterrupt`` or SIGTERM's ``Terminated``) before every request
    finished: ``generations`` in prompt order, None for a request not run to completion; ``summary``: the run's
    summary so far (``serve_prompts`` only). An interrupt itself, so that a caller that does not keep the finished
    requests still stops."""

    def __init__(self, cause: KeyboardInterrupt, generations: list[Generation | None],
                 summary: RunSummary | None = None) -> None:
        super().__init__()
        self.cause, self.generations, self.summary = cause, generations, summary

    @property
    def finished(self) -> list[Generation]:
        """The generations of the requests that finished, in prompt order."""
        return [g for g in self.generations if g is not None]


@dataclass
class GenerationStats:
    """A run of the 16-bit model: seconds of its prefill and of its decode steps (busy time), decode tokens,
    ``wall_seconds`` from the start of the run to the end of its last step (idle waits for arrivals included)."""

    prefill_seconds: float
    decode_seconds: float
    decode_tokens: int
    latency: LatencyStats | None = None
    request_rate: float = float("inf")
    wall_seconds: float = 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Decode tokens per second of decode steps (busy)."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def wall_decode_tokens_per_second(self) -> float:
        """Decode tokens per second of ``wall_seconds``."""
        return self.decode_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0


def encode_prompts(tokenizer: Any, prompts: list[str], max_context: int, max_new_tokens: int,
                   vocab_size: int) -> list[list[int]]:
    """Token ids of each prompt; raises ``PagedWeightError`` if a prompt (plus generation) exceeds the context
    (``max_context`` tokens) or holds a token the model does not embed (an id >= ``vocab_size``)."""
    out = []
    most = max_context * token_chars(tokenizer)
    for i, p in enumerate(prompts):
        which = "the prompt" if len(prompts) == 1 else f"prompt {i + 1} of {len(prompts)} (its first words: " \
            f"{' '.join(p[:400].split()[:6])!r})"
        if len(p) > most:  # refused before the tokenizer spends seconds and gigabytes on it
            raise PagedWeightError(f"{which} has {len(p)} characters, more than any {max_context} tokens make (the "
                                   "model's context): shorten the prompt")
        ids = tokenizer(p, add_special_tokens=True, verbose=False).input_ids
        if not ids:
            raise PagedWeightError(f"{which} is empty after tokenization: give some text")
        check_token_ids(ids, vocab_size, tokenizer, which)
        if len(ids) + max_new_tokens > max_context:
            raise PagedWeightError(
                f"{which} has {len(ids)} tokens; with --max-new-tokens {max_new_tokens} it needs "
                f"{len(ids) + max_new_tokens} > the model's context of {max_context} tokens: shorten the prompt "
                "or lower --max-new-tokens")
        out.append(ids)
    return out


def eos_ids(spec_eos: tuple[int, ...], tokenizer: Any) -> set[int]:
    """The model's EOS ids and the tokenizer's."""
    eos = set(spec_eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    return eos


def run_generation(engine: LLMEngine, tokenizer: Any, prompts: list[str],
                   on_text: Callable[[int, str], None] | None = None,
                   on_progress: Callable[[int, int], None] | None = None,
                   on_wait: Callable[[float, float], None] | None = None) -> list[Generation]:
    """Run ``engine`` (holding requests 0..n-1 for ``prompts``) to completion; generations in prompt order.

    ``on_text(i, new text)`` streams request i's text (whole characters only); ``on_progress(finished requests,
    generated tokens)`` is called once before the first step and after every sampled token; ``on_wait(arrival,
    seconds to it)`` once per long idle wait for an arrival (``LLMEngine.run_until_done``).
    """
    printed = [""] * len(prompts)
    counts = [0, 0]  # finished requests, generated tokens
    seen = [0] * len(prompts)

    def on_output(o: RequestOutput) -> None:
        if on_text is not None:
            text = tokenizer.decode(list(o.token_ids), skip_special_tokens=True)
            if len(text) > len(printed[o.rid]) and not text.endswith("\ufffd"):
                on_text(o.rid, text[len(printed[o.rid]):])
                printed[o.rid] = text
        if on_progress is not None:
            counts[0] += o.finished
            counts[1] += len(o.token_ids) - seen[o.rid]
            seen[o.rid] = len(o.token_ids)
            on_progress(counts[0], counts[1])

    if on_progress is not None:  # the run starts now (the engine is built and warm): its clock starts here
        on_progress(0, 0)
    try:
        engine.run_until_done(on_output, on_wait)
    except KeyboardInterrupt as exc:
        raise GenerationStopped(exc, [_finished(engine, tokenizer, i, p) for i, p in enumerate(prompts)]) from exc
    return [_generation(engine, tokenizer, i, p) for i, p in enumerate(prompts)]


def _generation(engine: LLMEngine, tokenizer: Any, rid: int, prompt: str) -> Generation:
    """Request ``rid``'s result as the engine holds it."""
    out = engine.outputs[rid]
    return Generation(prompt, tokenizer.decode(list(out.token_ids), skip_special_tokens=True), out.prompt_tokens,
                      len(out.token_ids), out.finish or "length", engine.times.get(rid))


def _finished(engine: LLMEngine, tokenizer: Any, rid: int, prompt: str) -> Generation | None:
    """Request ``rid``'s result if it ran to completion (its output finished and its finish time recorded: a stop
    can fall between the two), else None."""
    out, times = engine.outputs.get(rid), engine.times.get(rid)
    if out is None or not out.finished or times is None or times.finish is None:
        return None
    return _generation(engine, tokenizer, rid, prompt)


def generate(model: LeanMoEModel, tokenizer: Any, prompts: list[str], params: SamplingParams,
             block_size: int = 16, on_text: Callable[[int, str], None] | None = None,
             on_progress: Callable[[int, int], None] | None = None, arrivals: ArrivalSchedule | None = None,
             slo: SLO | None = None,
             on_wait: Callable[[float, float], None] | None = None) -> tuple[list[Generation], GenerationStats]:
    """Generate with ``model``'s own 16-bit experts (``dense_engine``), request i arriving at ``arrivals.times[i]``
    (None: all at t=0); the generations and timing stats (``slo``: what the goodput counts; ``on_wait``: see
    ``run_generation``)."""
    ids = encode_prompts(tokenizer, prompts, model.spec.max_position_embeddings, params.max_new_tokens,
                         model.spec.vocab_size)
    engine = dense_engine(model, params, ids, eos_ids(model.spec.eos_token_ids, tokenizer), block_size, arrivals)
    gens = run_generation(engine, tokenizer, prompts, on_text, on_progress, on_wait)
    prefill = sum(r.seconds for r in engine.trace if r.prefill_tokens)
    decode = sum(r.seconds for r in engine.trace if not r.prefill_tokens)
    return gens, GenerationStats(prefill, decode, engine.core.decode_tokens,
                                 latency_stats(list(engine.times.values()), slo), engine.request_rate,
                                 engine.trace[-1].t_s if engine.trace else 0.0)


def kept_aside(path: Path) -> Path:
    """Where a stopped run writes an output meant for ``path``: beside it if it is an existing file (``out.jsonl`` ->
    ``out.stopped.jsonl``, or ``out.stopped.1.jsonl``, ``.2``, ... where an earlier stopped run's is there), so that
    a stopped run never replaces an earlier output, complete or not; else ``path`` itself (a new file, or a device
    such as /dev/stdout)."""
    if not path.is_file():
        return path
    n = 0
    while (aside := path.with_name(f"{path.stem}.stopped{f'.{n}' if n else ''}{path.suffix}")).exists():
        n += 1
    return aside


def serve_prompts(model_dir: Path, artifact_dir: Path | None, prompts: list[str], tokenizer: Any, cfg: ServeConfig,
                  params: SamplingParams, device: str = "auto", dtype: str = "auto",
                  on_text: Callable[[int, str], None] | None = None, trace: Path | None = None,
                  on_progress: Callable[[int, int], None] | None = None, arrivals: ArrivalSchedule | None = None,
                  slo: SLO | None = None,
                  on_wait: Callable[[float, float], None] | None = None) -> tuple[list[Generation], RunSummary]:
    """Serve ``prompts`` under ``cfg``: AP experts from ``artifact_dir``, or the 16-bit experts of ``model_dir``
    with ``cfg.policy`` 16-bit (``artifact_dir`` is then not read), request i arriving at ``arrivals.times[i]``
    seconds from the start of the run (None: all at t=0); generations (in prompt order) and the run summary
    (``slo``: what its goodput counts; ``on_wait``: see ``run_generation``). A ``trace`` that cannot be written
    does not lose the generations: the summary's ``trace_error`` says why. Raises ``PagedWeightError`` for an AP
    policy without ``artifact_dir``, and ``GenerationStopped`` with the summary so far (the trace written, beside an
    existing one: ``kept_aside``) on a stop.
    """
    spec, _ = load_spec(Path(model_dir))
    ids = encode_prompts(tokenizer, prompts, spec.max_position_embeddings, params.max_new_tokens, spec.vocab_size)
    eos = eos_ids(spec.eos_token_ids, tokenizer)
    if cfg.policy.dense:
        engine = build_dense_engine(Path(model_dir), cfg, params, ids, eos, device, dtype, arrivals=arrivals)
    elif artifact_dir is None:
        raise PagedWeightError(f"--policy {cfg.policy.name} needs --artifacts DIR (from `pwcal run-all`)")
    else:
        engine = build_engine(Path(model_dir), Path(artifact_dir), cfg, params, ids, eos, device, dtype,
                              arrivals=arrivals)
    try:
        gens = run_generation(engine, tokenizer, prompts, on_text, on_progress, on_wait)
    except GenerationStopped as stop:
        stop.summary = _summary(engine, slo, None if trace is None else kept_aside(trace))
        stop.summary.requests_unfinished = len(prompts) - len(stop.finished)
        raise
    return gens, _summary(engine, slo, trace)


def _summary(engine: LLMEngine, slo: SLO | None, trace: Path | None) -> RunSummary:
    """``engine``'s run summary, its trace written to ``trace`` if given. A trace that cannot be written does not
    lose the generations: the summary's ``trace_error`` says why, for the caller to report after writing them."""
    summary = summarize(engine, slo)
    if trace is not None:
        try:
            write_trace(engine, trace)
        except PagedWeightError as exc:
            summary.trace_error = str(exc)
    return summary
