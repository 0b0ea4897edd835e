"""``pwrun``: the lean runtime's command line (Typer). Wiring only: each command parses its
options and calls a plain function of the package.

Commands: ``generate`` (text from prompts), ``serve`` (the OpenAI-compatible HTTP server, ``pwrun.cli_serve``),
``ppl`` (perplexity on bundled or local text), ``prompts`` (a workload of real prompts). ``pwrun eval`` is mounted
by ``pweval.cli``, which depends on this module.
"""

from __future__ import annotations

import collections
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeElapsedColumn

from pwformat.atomic import write_atomic
from pwformat.errors import PagedWeightError
from pwrun.ap.dense import dense_model
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
    PplDtypeOpt,
    ReloadReserveOpt,
    ThreadsOpt,
    budget_bytes,
    check_planner_flags,
    check_writable_file,
    default_model,
    make_console,
    open_artifact,
    policy_dtype,
    reload_reserve,
    set_threads,
    user_errors,
    warn_missing_tables,
)
from pwrun.cli_serve import serve
from pwrun.core.config import CPU_MAX_BATCH, CPU_STEP_TOKENS, GPU_MAX_BATCH, GPU_STEP_TOKENS, EngineConfig
from pwrun.core.latency import SLO
from pwrun.core.policy import Policy
from pwrun.core.request import MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingParams
from pwrun.data import document_prompts, read_text
from pwrun.engine.build import ServeConfig
from pwrun.engine.report import format_summary
from pwrun.generate import Generation, GenerationStopped, kept_aside, serve_prompts
from pwrun.model.loader import check_token_ids, load_model, load_spec, load_tokenizer, resolve_device
from pwrun.ppl import perplexity
from pwrun.progress import progress
from pwrun.prompt_file import PromptFile, prompt_arrivals
from pwrun.signals import exit_quietly_on_sigterm

app = typer.Typer(help="PagedWeight runtime: serve an MoE model (generation, perplexity).", no_args_is_help=True,
                  add_completion=False,
                  rich_markup_mode=None)  # plain help: rich's option panels leave the help text ~17 columns at 80
console = make_console(stderr=True)


@contextmanager
def _progress(total: int, show: bool, eta: bool = True) -> Iterator[Callable[[int, int], None] | None]:
    """While serving: a transient bar on stderr (requests finished / ``total``, generated tokens/s) if ``show``;
    when stderr is not a terminal, a line every few seconds instead (``pwrun.progress``)."""
    if not show:
        yield None
        return
    columns = (TextColumn("serving"), BarColumn(), MofNCompleteColumn(), TextColumn("requests"),
               TextColumn("{task.fields[rate]}"), TimeElapsedColumn())
    with progress(console, *columns, transient=True) as bar:
        # the task, its clock and its rate start with the run (after loading, placement and warm-up), as the run
        # summary's clock does, not at process start
        first: list[tuple[TaskID, float, int]] = []

        def update(done: int, tokens: int) -> None:
            now = time.perf_counter()
            if not first:
                first.append((bar.add_task("serving requests", total=total, rate="", eta=eta), now, tokens))
            task, t0, n0 = first[0]
            dt = now - t0
            bar.update(task, completed=done, rate=f"{(tokens - n0) / dt:.1f} generated tokens/s" if dt > 0 else "")

        yield update


def _say_wait(arrival: float, wait: float) -> None:
    """One line when the idle engine waits long for the next arrival (seconds from the start of the run), so that a
    quiet terminal is not taken for a hang."""
    console.print(f"idle: the next request arrives at t={arrival:.0f} s; the engine waits {wait:.0f} s until then",
                  style="dim", highlight=False, soft_wrap=True)


def _write_results(results: list[Generation], output: Path | None) -> None:
    lines = "".join(json.dumps(r.record()) + "\n" for r in results)
    if output is None:
        sys.stdout.write(lines)
        return
    try:
        _write_file("--output", output, lines)
    except PagedWeightError:  # the generations are not lost: they go to stdout (the caller's error line says so)
        sys.stdout.write(lines)
        raise


def _stopped(stop: GenerationStopped, total: int, output: Path | None, stream: bool,
             failed: list[str], asked: Path | None = None) -> KeyboardInterrupt:
    """The interrupt that ends a stopped run once its finished requests are written, of ``stop.cause``'s kind (its
    exit code) with the stop line: how many of the ``total`` requests were written where (``output``: beside
    ``asked`` when that existed, which is kept), and that the rest were not run to completion (left out of the
    results); ``failed``: outputs that could not be written."""
    if stream:
        line = "the request was not run to completion (its text so far is above)"
    else:
        written = len(stop.finished)
        where = "printed on stdout" if output is None or failed else f"written to {output}"
        if output is not None and asked is not None and output != asked and not failed:
            where += f" (the existing {asked.name} is kept)"
        line = (f"{written} of {total} requests finished and were {where}; the rest ({total - written}) were not run "
                "to completion and are left out")
    return type(stop.cause)("; ".join([line, *failed]))


def _write_file(flag: str, path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (``pwformat.atomic.write_atomic``); ``PagedWeightError`` naming
    ``flag`` on failure."""
    try:
        write_atomic(path, text.encode())
    except OSError as exc:
        raise PagedWeightError(f"cannot write {flag} {path}: {exc.strerror}") from exc


@app.command()
def generate(
    prompt: Annotated[str | None, typer.Option(help="One prompt; it and its continuation are streamed to "
                                               "stdout.")] = None,
    prompts: Annotated[Path | None, typer.Option(help="JSONL file, one {\"prompt\": ...} per line; all arrive "
                                                 "at t=0 unless --request-rate or a line's 'arrival_s' says "
                                                 "otherwise; up to --max-batch run at once.")] = None,
    output: Annotated[Path | None, typer.Option(help="Write results as JSONL here (default: stdout).")] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 = greedy; 0.001..1000 samples (1 = the model's "
                                               "distribution).")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass in (0, 1].")] = 1.0,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    artifacts: Annotated[Path | None, typer.Option(help="Artifact directory from `pwcal run-all` (AP weights + "
                                                   "calibration): serve with the page pool under --gpu-memory. "
                                                   "Without it: the checkpoint's own experts in the same engine, "
                                                   "with the memory the run needs (--policy 16-bit: under "
                                                   "--gpu-memory).")] = None,
    gpu_memory: GpuMemoryOpt = None,
    policy: PolicyOpt = "pagedweight",
    bits: BitsOpt = None,
    trace: Annotated[Path | None, typer.Option(help="Write one row per engine step here (Parquet).")] = None,
    max_batch: Annotated[int | None, typer.Option(min=1, help="Most requests running at once (default 64 on a "
                                                  "GPU, 16 on the CPU). On a GPU the kernels are compiled for "
                                                  "1..max-batch tokens (once per machine, then cached by Triton) and "
                                                  "a CUDA graph is captured per batch size before serving: ~10 s at "
                                                  "64 on an H200 with a warm cache.")] = None,
    max_step_tokens: Annotated[int | None, typer.Option(min=1, help="Most tokens per engine step (longer prompts are "
                                                        "prefilled in chunks; default 2048 on a GPU, 512 on the "
                                                        "CPU).")] = None,
    debug_checks: Annotated[bool, typer.Option(help="Assert page conservation and q <= resident planes after "
                                               "every step.")] = False,
    reload_reserve_tokens: ReloadReserveOpt = DEFAULT_RELOAD_RESERVE,
    max_mean_bits: MaxMeanBitsOpt = None,
    summary_json: Annotated[Path | None, typer.Option(help="Also write the run summary as JSON here.")] = None,
    no_verify: NoVerifyOpt = False,
    threads: ThreadsOpt = None,
    request_rate: Annotated[float, typer.Option(help="Requests per second arriving as a Poisson process (the first "
                                                "at t=0, exponential gaps); inf = every request at t=0. Instead, a "
                                                "prompts file may give each line an 'arrival_s' (seconds, >= 0). "
                                                "Either clock starts with the run, after loading and warm-up.")]
    = math.inf,
    arrival_seed: Annotated[int, typer.Option(help="Seed of the Poisson arrival times of --request-rate.")] = 0,
    slo_ttft_ms: Annotated[float | None, typer.Option(help="Goodput counts only requests whose time to first token "
                                                      "(arrival -> first token) is at most this many milliseconds.")]
    = None,
    slo_tpot_ms: Annotated[float | None, typer.Option(help="Goodput counts only requests whose time per output "
                                                      "token after the first is at most this many milliseconds.")]
    = None,
) -> None:
    """Generate text: the 16-bit model, or (with --artifacts) the PagedWeight runtime under a memory budget."""
    with user_errors("a stop before the engine runs writes nothing: rerun; greedy text is the same"):
        set_threads(threads)
        if (prompt is None) == (prompts is None):
            raise PagedWeightError("give exactly one of --prompt TEXT or --prompts FILE.jsonl")
        if not (math.isfinite(temperature) and (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE)):
            raise PagedWeightError(f"--temperature {temperature} is not allowed: give 0 (greedy) or a number in "
                                   f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] (1 = the model's distribution)")
        if not 0 < top_p <= 1:  # also refuses nan
            raise PagedWeightError(f"--top-p {top_p} is not allowed: give a number in (0, 1] (1 = no nucleus cut)")
        if prompt is not None and not prompt.strip():
            raise PagedWeightError("--prompt is empty: give some text")
        if prompt is not None:
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:  # bytes the shell passed that are not UTF-8 (surrogate escapes)
                raise PagedWeightError("--prompt is not valid UTF-8 text: convert it (e.g. iconv -f latin1 -t utf-8) "
                                       "or pass it in a UTF-8 --prompts file") from exc
        if not 0 <= seed < 2**63:
            raise PagedWeightError(f"--seed {seed} is out of range: give an integer in [0, 2^63)")
        pfile = None if prompts is None else PromptFile.read(prompts)
        texts: list[str] = [prompt or ""] if pfile is None else pfile.prompts
        if pfile is not None and pfile.unread is not None:
            typer.echo(f"warning: {pfile.unread}", err=True)
        arrivals = prompt_arrivals(pfile, len(texts), request_rate, arrival_seed)
        for flag, ms in (("--slo-ttft-ms", slo_ttft_ms), ("--slo-tpot-ms", slo_tpot_ms)):
            if ms is not None and not (math.isfinite(ms) and ms > 0):
                raise PagedWeightError(f"{flag} {ms} is not allowed: give a number of milliseconds > 0")
        slo = SLO(slo_ttft_ms, slo_tpot_ms)
        dense = policy == "16-bit"
        dtype = policy_dtype(dtype, policy)
        if dense and artifacts is not None:
            raise PagedWeightError("--policy 16-bit serves the checkpoint's own experts: drop --artifacts")
        budget = budget_bytes(gpu_memory)  # an empty or unreadable value is refused first
        reserve = reload_reserve(reload_reserve_tokens)
        plain = artifacts is None and not dense  # the 16-bit model with the budget the run needs
        if plain and (gpu_memory is not None or bits is not None or policy != "pagedweight"):
            raise PagedWeightError("--gpu-memory, --policy and --bits need --artifacts DIR (from `pwcal run-all`), or "
                                   "--policy 16-bit for the 16-bit experts under a budget")
        budget = 0 if plain else budget
        if trace is not None and trace.suffix != ".parquet":
            raise PagedWeightError(f"--trace {trace} must end in .parquet")
        named = [(f, p) for f, p in (("--prompts", prompts), ("--output", output), ("--trace", trace),
                                     ("--summary-json", summary_json)) if p is not None]
        for i, (flag, path) in enumerate(named):
            clash = [f for f, p in named[:i] if p.resolve() == path.resolve()]
            if clash and not (path.exists() and not path.is_file()):  # /dev/null twice is fine
                raise PagedWeightError(f"{clash[0]} and {flag} name the same file {path}: give {flag} a path of its "
                                       "own")
            if flag != "--prompts":
                check_writable_file(flag, path)
        model_dir = model or default_model()
        gpu = resolve_device(device).type == "cuda"
        max_batch = max_batch or (GPU_MAX_BATCH if gpu else CPU_MAX_BATCH)
        max_step_tokens = max_step_tokens or (GPU_STEP_TOKENS if gpu else CPU_STEP_TOKENS)
        tok = load_tokenizer(model_dir)
        params = SamplingParams(max_new_tokens, temperature, top_p, seed)
        stream = prompt is not None and output is None  # a prompts file gives JSONL, however many lines

        started = [False]

        def on_text(_i: int, s: str) -> None:
            if not started[0]:  # the prompt is echoed only once the request is known to be valid
                sys.stdout.write(texts[0])
                started[0] = True
            sys.stdout.write(s)
            sys.stdout.flush()

        def end_stream() -> None:
            sys.stdout.write(("" if started[0] else texts[0]) + "\n")

        for note in load_spec(model_dir)[0].notes:  # e.g. a multimodal checkpoint's towers: text model only
            console.print(f"note: {note}", style="dim", highlight=False, soft_wrap=True)
        stop: GenerationStopped | None = None
        serve_policy = Policy.named("16-bit" if plain else policy, bits)
        check_planner_flags(serve_policy, max_mean_bits, reload_reserve_tokens)
        if artifacts is not None:
            art = open_artifact(artifacts, model_dir, not no_verify)
            serve_policy.check_bits(art.bits)
            warn_missing_tables(art, [policy], model_dir)
        cfg = ServeConfig(budget, serve_policy,
                          EngineConfig(max_batch=max_batch, max_step_tokens=max_step_tokens,
                                       debug_checks=debug_checks, reload_reserve_tokens=reserve,
                                       max_mean_bits=max_mean_bits))
        spread = any(t > 0 for t in arrivals.times)  # the pace is the arrivals': no ETA from the rate so far
        with _progress(len(texts), not stream, eta=not spread) as on_progress:
            try:
                results, summary = serve_prompts(model_dir, artifacts, texts, tok, cfg, params, device, dtype,
                                                 on_text=on_text if stream else None, trace=trace,
                                                 on_progress=on_progress, arrivals=arrivals, slo=slo,
                                                 on_wait=_say_wait)
            except GenerationStopped as exc:  # the finished requests are written below, then the stop ends
                assert exc.summary is not None  # serve_prompts sums up a stopped run
                stop, results, summary = exc, exc.finished, exc.summary
        if stream:
            end_stream()
        # every output is attempted; failures are reported together, after (nothing is dropped for one). A stopped
        # run writes beside an existing output instead of replacing it (the trace: serve_prompts)
        asked = output
        if stop is not None:
            output = None if output is None else kept_aside(output)
            summary_json = None if summary_json is None else kept_aside(summary_json)
        failed: list[str] = []
        printed = output is None  # where the results are, for the error line
        if not stream:
            try:
                _write_results(results, output)
            except PagedWeightError as exc:
                failed.append(str(exc))
                printed = True
            reasons = collections.Counter(r.finish_reason for r in results)
            console.print(f"{len(results)} of {len(texts)} requests completed (finish reason "
                          + ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items())) + ")"
                          + (f" -> {output}" if output is not None and not failed else ""),
                          style="dim", highlight=False, soft_wrap=True)
        console.print(format_summary(summary), style="dim", highlight=False, soft_wrap=True)
        if summary_json is not None:
            try:
                _write_file("--summary-json", summary_json,
                            json.dumps(summary.to_dict(), indent=1, default=str) + "\n")
            except PagedWeightError as exc:
                failed.append(str(exc))
        if summary.trace_error:
            failed.append(summary.trace_error)
        if stop is not None:
            raise _stopped(stop, len(texts), output, stream, failed, asked)
        if failed:
            where = "printed on stdout above" if printed else f"in {output}"
            raise PagedWeightError("; ".join(failed) + f" (the results are {where})")
        return


app.command()(serve)


@app.command()
def ppl(
    dataset: Annotated[str, typer.Option(help="Bundled name (wikitext2, wikitext2-val, c4, c4-calib, qmsum) or a "
                                         "local .txt/.json/.jsonl/.json.gz/.parquet file with text.")] = "wikitext2",
    seq_len: Annotated[int, typer.Option(help="Window length in tokens (non-overlapping windows).")] = 512,
    max_windows: Annotated[int | None, typer.Option(help="Score at most this many windows (default: all).")] = None,
    batch: Annotated[int, typer.Option(min=1, help="Windows per forward step.")] = 8,
    model: ModelOpt = None,
    device: DeviceOpt = "auto",
    dtype: PplDtypeOpt = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")] = False,
    artifacts: Annotated[Path | None, typer.Option(help="AP artifact directory (from `pwcal quantize`) to read "
                                                   "expert weights from.")] = None,
    uniform_bits: Annotated[int | None, typer.Option(help="With --artifacts: every expert block at this many "
                                                     "bits (3..8).")] = None,
    no_verify: NoVerifyOpt = False,
    threads: ThreadsOpt = None,
) -> None:
    """Perplexity (teacher-forced, exp of mean NLL per token) on real text, at 16-bit or uniform AP bits."""
    with user_errors():
        set_threads(threads)
        if seq_len < 2 or (max_windows is not None and max_windows < 1):
            raise PagedWeightError("--seq-len must be >= 2 and --max-windows >= 1")
        model_dir = model or default_model()
        if artifacts is not None and uniform_bits is None:
            raise PagedWeightError("--artifacts needs --uniform-bits N: the perplexity of every expert block at N "
                                   "bits (leave both out for the 16-bit model)")
        if artifacts is None and uniform_bits is not None:
            raise PagedWeightError(f"--uniform-bits {uniform_bits} needs --artifacts DIR (from `pwcal run-all`) to "
                                   "read the bit-planes from")
        art = None if artifacts is None else open_artifact(artifacts, model_dir, not no_verify)
        tok = load_tokenizer(model_dir)
        lm = load_model(model_dir, device=device, dtype=dtype)
        if art is not None and uniform_bits is not None:
            lm = dense_model(art, lm, uniform_bits)
        ids = tok(read_text(dataset), add_special_tokens=False, verbose=False).input_ids
        check_token_ids(ids, lm.spec.vocab_size, tok, f"--dataset {dataset}")
        total = min(len(ids) // seq_len, max_windows) if max_windows else len(ids) // seq_len
        with progress(console, transient=True) as bar:
            task = bar.add_task(f"ppl {dataset}", total=total)
            res = perplexity(lm, ids, seq_len=seq_len, max_windows=max_windows, batch=batch,
                             on_window=lambda k: bar.advance(task, k))
        bits = uniform_bits or 16
        compute = str(lm.dtype).removeprefix("torch.")  # the checkpoint's 16-bit experts compute in it
        row = {"dataset": dataset, "model": str(model_dir), "expert_bits": bits, "dtype": compute, "seq_len": seq_len,
               "windows": res.windows, "tokens": res.tokens, "nll": round(res.nll, 5), "ppl": round(res.ppl, 3)}
        if json_out:
            typer.echo(json.dumps(row))
        else:
            typer.echo(f"{dataset} (experts at {bits} bits, computed in {compute}): perplexity {res.ppl:.3f} over "
                       f"{res.tokens} tokens "
                       f"({res.windows} windows of {seq_len})")


@app.command()
def prompts(
    out: Annotated[Path, typer.Option(help="JSONL file to write ({\"prompt\": ...} per line).")],
    dataset: Annotated[str, typer.Option(help="Bundled name (c4, c4-calib, wikitext2, wikitext2-val, or qmsum: "
                                         "meeting transcripts for long prompts with a large --max-chars) or a local "
                                         "text file.")] = "c4",
    count: Annotated[int, typer.Option(min=1, help="Number of prompts (one per document).")] = 24,
    max_chars: Annotated[int, typer.Option(min=16, help="Characters per prompt at most (cut at a word).")] = 1200,
) -> None:
    """Write a workload of real prompts: the beginnings of a dataset's documents."""
    with user_errors():
        check_writable_file("--out", out)
        texts = document_prompts(dataset, count, max_chars, min_chars=min(200, max_chars))

        write_atomic(out, "".join(json.dumps({"prompt": t}) + "\n" for t in texts).encode())
        typer.echo(f"{len(texts)} prompts from {dataset} -> {out}")


def main() -> None:
    exit_quietly_on_sigterm()
    app()
