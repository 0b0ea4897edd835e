"""``pwrun eval``: serving-time evaluation commands (Typer). Wiring only: each command parses its options
and calls ``pweval``.

pweval depends on pwrun, never the reverse: this module mounts ``app`` as ``eval`` on the runtime's CLI
(``pwrun.cli.app``), and the ``pwrun`` console script starts in this package (``pweval.main``), so
``pwrun eval ...`` works while ``pwrun.cli`` knows nothing of evaluation.

Commands: ``run`` (one suite under one or more budgets with one policy -> rows appended to a results
table), ``sweep`` (every policy x budget on both suites, then the figures and tables), ``report``
(figures and tables from a results table), ``notebooks`` (execute the analysis notebooks headless).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from pweval.results import append_rows, read_table
from pweval.runs import Evaluator, LongSpec, TextSpec
from pweval.sweep import QUICK, SweepSpec, budgets, is_label, run_sweep
from pwformat.errors import PagedWeightError
from pwrun import cli as runtime_cli
from pwrun.cli_common import (
    DEFAULT_RELOAD_RESERVE,
    DtypeOpt,
    EvalDeviceOpt,
    ModelOpt,
    NoVerifyOpt,
    ReloadReserveOpt,
    ThreadsOpt,
    check_writable_file,
    default_model,
    make_console,
    open_artifact,
    reload_reserve,
    run_cli,
    set_threads,
    user_errors,
    warn_missing_tables,
)
from pwrun.core.policy import POLICIES, Policy
from pwrun.engine.budget import parse_size
from pwrun.engine.report import write_frame
from pwrun.engine.tables import read_damage
from pwrun.model.inventory import expert_blocks

app = typer.Typer(help="Serving-time evaluation: quality of teacher-forced continuations while the runtime serves "
                  "a real-text workload under a memory budget (pwrun eval run / sweep / report).",
                  no_args_is_help=True, add_completion=False,
                  rich_markup_mode=None)  # plain help: rich's option panels leave the help text ~17 columns at 80
console = make_console(stderr=True)

ArtifactsOpt = Annotated[Path, typer.Option(help="Artifact directory from `pwcal run-all`.")]
DEMO_ARTIFACTS = Path("artifacts/runs/tiny-ap")


def _progress(t0: float) -> Any:
    def show(r: dict[str, Any]) -> None:
        q = " ".join(f"{k.removesuffix('_ppl')} ppl {r[k]:.3f}" for k in ("wikitext2_ppl", "c4_ppl", "qmsum_ppl")
                     if r.get(k) is not None)
        if r.get("retrieval_acc") is not None:
            q += f" retrieval {r['retrieval_acc']:.3f}"
        name = r["policy"] + (f" {r['bits']}-bit" if r["policy"] == "uniform" else "")
        console.print(f"[dim]{time.perf_counter() - t0:7.1f} s  suite {r['suite']:5s} {name:18s} budget "
                      f"{r['budget']:6s} {r['gpu_memory'] / 2**20:8.2f} MiB  {q or r.get('note', '')}[/dim]",
                      highlight=False, soft_wrap=True)
    return show


def _check_out(path: Path, suffix: str | None) -> None:
    if suffix is not None and path.suffix != suffix:
        raise PagedWeightError(f"--out {path} must end in {suffix}")
    if suffix is None and path.exists() and not path.is_dir():
        raise PagedWeightError(f"--out {path} is a file: give a directory")
    if suffix is not None:
        check_writable_file("--out", path)


@app.command()
def run(
    out: Annotated[Path, typer.Option(help="Results table (.parquet) to append one row per budget to; each "
                                      "request's scores go beside it, in <name>.scores.parquet.")],
    gpu_memory: Annotated[str | None, typer.Option(help="Budget(s), comma-separated: sizes (48MiB, 1.5GB) or "
                                                   "labels: U<b> (uniform b's static footprint for this workload; "
                                                   "U4.5: midway between U4 and U5), "
                                                   "FP16 (the 16-bit model's), min (the smallest PagedWeight "
                                                   "accepts). Default U4.")] = None,
    policy: Annotated[str, typer.Option(help="pagedweight, uniform (needs --bits), static, residual (with the "
                                        "prompt-residual heads), an ablation (no-routing, no-movement, "
                                        "no-sensitivity), or 16-bit (the reference "
                                        "model, charged its footprint; no --gpu-memory).")] = "pagedweight",
    bits: Annotated[int | None, typer.Option(help="With --policy uniform: every expert at this many bits.")] = None,
    suite: Annotated[str, typer.Option(help="text (WikiText-2 + C4 windows) or long (passage retrieval + QMSum "
                                       "windows).")] = "text",
    requests: Annotated[int | None, typer.Option(min=1, help="text: windows per dataset (48); long: QMSum meetings "
                                                 "(16, 2 windows each).")] = None,
    questions: Annotated[int | None, typer.Option(min=1, help="long: retrieval questions (24).")] = None,
    prompt_tokens: Annotated[int | None, typer.Option(min=1, help="Prompt tokens per window (text 192, QMSum "
                                                      "1984).")] = None,
    continuation_tokens: Annotated[int | None, typer.Option(min=1, help="Scored continuation tokens per window "
                                                            "(64).")] = None,
    concurrency: Annotated[int | None, typer.Option(min=1, help="Requests running at once, max_batch (text 16, "
                                                    "long 32).")] = None,
    max_step_tokens: Annotated[int | None, typer.Option(min=1, help="Tokens per engine step (text 256, long "
                                                        "512).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the window offsets and retrieval questions.")] = 0,
    trace: Annotated[Path | None, typer.Option(help="Write the last run's per-step trace here (.parquet).")] = None,
    damage: Annotated[Path | None, typer.Option(help="Measured per-block damage table (parquet: layer, expert, unit, "
                                                "bits, kl; tools/oracle_allocation.py) in place of the artifact's "
                                                "sensitivities; rows are named 'oracle' (--policy static) or "
                                                "'<policy>+oracle'.")] = None,
    reload_reserve_tokens: ReloadReserveOpt = DEFAULT_RELOAD_RESERVE,
    artifacts: ArtifactsOpt = DEMO_ARTIFACTS,
    model: ModelOpt = None,
    device: EvalDeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
    no_verify: NoVerifyOpt = False,
) -> None:
    """Score one suite under each budget with one policy; append one row per budget to --out."""
    with user_errors(kept=f"each budget that finished is already a row of {out}"):
        _check_out(out, ".parquet")
        if trace is not None:
            _check_out(trace, ".parquet")
        if out.is_file():
            read_table(out)  # refuse a foreign table before spending minutes
        if suite not in ("text", "long"):
            raise PagedWeightError(f"unknown --suite {suite!r}: text or long")
        if policy == "16-bit" and (bits is not None or trace is not None or gpu_memory is not None):
            raise PagedWeightError("--policy 16-bit scores the reference model at its own footprint: no --bits, "
                                   "--gpu-memory or --trace")
        if policy != "16-bit" and policy not in POLICIES:
            raise PagedWeightError(f"unknown --policy {policy!r}: choose one of {', '.join(POLICIES)}")
        if gpu_memory is not None and not gpu_memory.replace(",", "").strip():
            raise PagedWeightError("--gpu-memory needs at least one budget (e.g. U4 or 2GiB)")
        if damage is not None and not damage.is_file():
            raise PagedWeightError(f"--damage {damage}: no such file (measure it with tools/oracle_allocation.py)")
        if damage is not None and (policy in ("16-bit", "uniform") or not POLICIES[policy].use_sensitivity):
            raise PagedWeightError(f"--damage: --policy {policy} does not rank blocks by damage, so it would not "
                                   "read the table (use static, pagedweight or an ablation that ranks)")
        reserve = reload_reserve(reload_reserve_tokens)
        set_threads(threads)
        open_artifact(artifacts, model or default_model(), not no_verify)
        ev = Evaluator(model or default_model(), artifacts, device, dtype)
        if policy != "16-bit":
            Policy.named(policy, bits).check_bits(ev.artifact.bits)
            warn_missing_tables(ev.artifact, [policy], ev.model_dir)
        if damage is not None:
            _check_damage(ev, damage)  # before any run: a table that does not fit wastes nothing
        if suite == "text":
            t = TextSpec()
            s = ev.text_suite(replace(t, per_dataset=requests or t.per_dataset,
                                      prompt_tokens=prompt_tokens or t.prompt_tokens,
                                      continuation_tokens=continuation_tokens or t.continuation_tokens, seed=seed,
                                      max_batch=concurrency or t.max_batch,
                                      max_step_tokens=max_step_tokens or t.max_step_tokens))
        else:
            ls = LongSpec()
            s = ev.long_suite(replace(ls, retrieval=replace(ls.retrieval, questions=questions or ls.retrieval.questions,
                                                            seed=seed),
                                      meetings=requests or ls.meetings, prompt_tokens=prompt_tokens or ls.prompt_tokens,
                                      continuation_tokens=continuation_tokens or ls.continuation_tokens, seed=seed,
                                      max_batch=concurrency or ls.max_batch,
                                      max_step_tokens=max_step_tokens or ls.max_step_tokens))
        tag = ""  # rows served with another reload reserve than the default are named '<policy>+reserve<N|last>'
        if reserve != s.engine.reload_reserve_tokens:
            s = replace(s, engine=replace(s.engine, reload_reserve_tokens=reserve))
            tag = f"+reserve{'last' if reserve is None else reserve}"
        show = _progress(time.perf_counter())
        if policy == "16-bit":
            ev.measure_peak_kv(s)
            row = ev.reference(s)
            append_rows(out, [row], ev.scores(row))
            show(row)
            return
        specs = [x.strip() for x in (gpu_memory if gpu_memory is not None else "U4").split(",") if x.strip()]
        if not specs:
            raise PagedWeightError("--gpu-memory needs at least one budget (e.g. U4 or 2GiB)")
        sizes = {x: parse_size(x) for x in specs if not is_label(x)}
        tiny = [x for x, v in sizes.items() if v < 2**20]
        if tiny:  # refused before any run appends a row (e.g. "U4,5" meant U4.5)
            raise PagedWeightError(f"--gpu-memory {tiny[0]} is {sizes[tiny[0]]} bytes: give a unit (48MiB) or a "
                                   "label (U4, U4.5); a comma separates budgets")
        labels = tuple(x for x in specs if is_label(x))
        budgets(ev, s, tuple(x for x in labels if x != "min"))  # check the labels before the peak-KV run
        if any(x != "min" for x in labels):
            ev.measure_peak_kv(s)
        known = {**budgets(ev, s, labels), **sizes}
        for x in specs:
            budget = known[x]
            name = None if damage is None else "oracle" if policy == "static" else f"{policy}+oracle"
            row = ev.run(s, policy, budget, x if is_label(x) else "custom", bits, damage=damage,
                         name=(name or policy) + tag if tag else name)
            append_rows(out, [row], ev.scores(row))
            show(row)
        if trace is not None and ev.last.trace is not None:
            write_frame(ev.last.trace, trace)


def _check_damage(ev: Evaluator, path: Path) -> None:
    """Refuse (``PagedWeightError``) a damage table that does not cover ``ev``'s artifact block by block."""
    blocks = expert_blocks(ev.model.spec)
    read_damage(path, [(b.layer, b.expert, b.unit) for b in blocks], list(ev.artifact.bits))


@app.command()
def sweep(
    out: Annotated[Path, typer.Option(help="Folder for results.parquet, the figures (PNG) and tables (markdown).")
                   ] = Path("docs/eval"),
    quick: Annotated[bool, typer.Option(help="A seconds-long sweep on tiny workloads (for tests).")] = False,
    long: Annotated[bool, typer.Option(help="Include the long-context suite.")] = True,
    oracle: Annotated[Path | None, typer.Option(help="Measured per-block damage table (parquet: layer, expert, unit, "
                                                "bits, kl; tools/oracle_allocation.py) of this artifact: also serve "
                                                "the static allocation it ranks at every text budget (policy "
                                                "oracle), the yardstick of target (a).")] = None,
    artifacts: ArtifactsOpt = DEMO_ARTIFACTS,
    model: ModelOpt = None,
    device: EvalDeviceOpt = "cpu",
    dtype: DtypeOpt = "auto",
    threads: ThreadsOpt = None,
    no_verify: NoVerifyOpt = False,
) -> None:
    """Every policy x budget on both suites -> results.parquet, then every figure and table (one command)."""
    from pweval.figures import write_report  # matplotlib: only the commands that draw load it

    with user_errors(kept=f"the runs that finished are in {out / 'results.partial.parquet'}; a rerun starts over"):
        _check_out(out, None)
        set_threads(threads)
        open_artifact(artifacts, model or default_model(), not no_verify)
        ev = Evaluator(model or default_model(), artifacts, device, dtype)
        warn_missing_tables(ev.artifact, POLICIES, ev.model_dir)  # the sweep serves with every policy
        spec = QUICK if quick else SweepSpec()
        if not long:
            spec = replace(spec, long=None)
        if oracle is not None:
            if not oracle.is_file():
                raise PagedWeightError(f"--oracle {oracle}: no such file (measure it with tools/oracle_allocation.py)")
            _check_damage(ev, oracle)  # before the first run, not after the text grid
            spec = replace(spec, oracle=oracle)
        t0 = time.perf_counter()
        results = run_sweep(ev, spec, out, on_row=_progress(t0))
        files = write_report(results, out)
        console.print(f"sweep done in {time.perf_counter() - t0:.0f} s: {results} and "
                      f"{', '.join(f.name for f in files)}", highlight=False, soft_wrap=True)


@app.command()
def report(
    results: Annotated[Path, typer.Option(help="Results table from `pwrun eval run` or `sweep`.")] = Path(
        "docs/eval/results.parquet"),
    out: Annotated[Path | None, typer.Option(help="Folder for the figures and tables (default: beside --results).")
                   ] = None,
) -> None:
    """Figures (PNG) and markdown tables from a results table."""
    from pweval.figures import write_report  # matplotlib: only the commands that draw load it

    with user_errors():
        folder = out or results.parent
        _check_out(folder, None)
        try:
            files = write_report(results, folder)
        except ValueError as exc:
            raise PagedWeightError(f"{results}: {exc}") from exc
        console.print("wrote " + ", ".join(str(f) for f in files), highlight=False, soft_wrap=True)


@app.command()
def notebooks(
    results: Annotated[Path, typer.Option(help="Results table the quality notebook reads.")] = Path(
        "docs/eval/results.parquet"),
    trace: Annotated[Path, typer.Option(help="Runtime trace the timeline notebook reads.")] = Path(
        "docs/eval/trace_text.parquet"),
    figures: Annotated[Path, typer.Option(help="Folder the notebooks save their PNGs to.")] = Path("docs/eval"),
    artifacts: ArtifactsOpt = DEMO_ARTIFACTS,
) -> None:
    """Execute the analysis notebooks in notebooks/ headless on these inputs (needs the dev extra)."""
    with user_errors():
        for p in (results, trace):
            if not p.is_file():
                raise PagedWeightError(f"{p} does not exist: run `pwrun eval sweep` first")
        if not (artifacts / "manifest.json").is_file():
            raise PagedWeightError(f"{artifacts} is not an artifact directory: run `pwcal run-all` first")
        _check_out(figures, None)
        try:
            from pweval.notebooks import execute_all
        except ImportError as exc:
            raise PagedWeightError(f"executing notebooks needs the dev extra (pip install -e '.[dev]'): {exc}") from exc
        pngs = execute_all(artifacts, results, trace, figures)
        console.print(f"notebooks ran; {len(pngs)} PNGs in {figures}", highlight=False, soft_wrap=True)


runtime_cli.app.add_typer(app, name="eval")


def console_main() -> None:
    """The ``pwrun`` console script: the runtime's commands and ``eval`` (``pweval.main``)."""
    run_cli(runtime_cli.app, "pwrun")
