"""Options and error handling shared by the ``pwrun`` and ``pwcal`` command lines.

What it does: the ``Annotated`` option aliases used by several commands (defined once),
``user_errors``, which turns a ``PagedWeightError`` into ``error: <one line>`` on stderr with
exit code 2, ``check_writable_file``, which checks an output path before any work is done,
``warn_missing_tables``, the warnings of every command that serves with an artifact, ``open_artifact``,
which opens and verifies an artifact for a command (with progress), and ``make_console``, the rich console of
every command.
It does no work of its own.
"""

from __future__ import annotations

import errno
import math
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn
from safetensors import SafetensorError

from pwformat.errors import PagedWeightError
from pwrun.ap.artifact import APArtifact
from pwrun.core.config import EngineConfig
from pwrun.core.policy import POLICIES, Policy
from pwrun.data import default_model_dir
from pwrun.engine.budget import parse_size
from pwrun.engine.tables import has_calibration, missing_tables, no_calibration
from pwrun.progress import progress
from pwrun.signals import Terminated, raise_terminated, reset_terminated, terminated

ModelOpt = Annotated[Path | None, typer.Option("--model", "-m", help="Local Hugging Face checkpoint directory "
                                        "(config.json, *.safetensors, tokenizer). Default: the bundled tiny MoE.")]
ModelArg = Annotated[Path, typer.Argument(metavar="MODEL", help="Local Hugging Face checkpoint directory.")]
GpuMemoryOpt = Annotated[str | None, typer.Option(help="With --artifacts or --policy 16-bit: the device memory "
                                                 "budget of the whole process, e.g. 10GiB, 48MiB (binary units), "
                                                 "1.5GB (decimal), or a bare number of bytes (default 4GiB; "
                                                 "without either, what the 16-bit run needs).")]
PolicyOpt = Annotated[str, typer.Option(help="pagedweight (default), uniform (needs --bits), static, residual "
                                        "(pagedweight with the prompt-residual heads of `pwcal fit-residual`), or "
                                        "an ablation: no-routing, no-movement, no-sensitivity; 16-bit: the "
                                        "checkpoint's own experts in the page pool under --gpu-memory (no "
                                        "--artifacts).")]
BitsOpt = Annotated[int | None, typer.Option(help="With --policy uniform: every expert block at this many bits "
                                             "(one of the artifact's bitwidths: 3..8 from `pwcal run-all`'s "
                                             "defaults).")]
DeviceOpt = Annotated[str, typer.Option(help="auto (cuda if present, else cpu), cpu, cuda or cuda:N.")]
DtypeOpt = Annotated[str, typer.Option(help="Activation and 16-bit weight dtype: auto (bf16 on CUDA, and on the "
                                       "CPU with --policy 16-bit; otherwise fp32 on the CPU, so the checkpoint's own "
                                       "experts served without --artifacts and without --policy 16-bit are held at "
                                       "32 bits), float32, bfloat16 or float16.")]
PplDtypeOpt = Annotated[str, typer.Option(help="Activation and 16-bit weight dtype: auto (bf16 on CUDA, fp32 on the "
                                          "CPU), float32, bfloat16 or float16.")]
EvalDeviceOpt = Annotated[str, typer.Option(help="cpu (the default: the evaluation's published numbers are CPU "
                                            "runs), cuda, cuda:N, or auto (cuda if present, else cpu).")]


DEFAULT_RELOAD_RESERVE = str(EngineConfig.reload_reserve_tokens)  # the engine's default, as the CLI writes it


def _parse_bits(text: str) -> float:
    """``--max-mean-bits``: a number of bits from 1 to 16; a word, nan or inf gets the range in its error (click's
    own checks say "should be a valid number", or "should be less than or equal to 16" of nan)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 1.0 <= value <= 16.0:
        raise typer.BadParameter(f"{text!r}: give a number of bits from 1 to 16, e.g. 4.25")
    return value


MaxMeanBitsOpt = Annotated[float | None, typer.Option(
    "--max-mean-bits", metavar="BITS", parser=_parse_bits,
    help="With --policy pagedweight: hold at most the expert bytes of every block at this many bits (1 to 16, "
         "e.g. 4.25; placement and reloads stay within it). Each decode step reads the experts in force: a cap "
         "near the uniform bitwidth bounds what the planner's raises cost in throughput; the bits still go where the "
         "predicted damage is largest. Default: no cap (as many bits as the free pages allow).")]
ReloadReserveOpt = Annotated[str, typer.Option(
    "--reload-reserve",
    help="With --policy pagedweight: tokens ahead of each running request whose KV blocks reloaded expert planes "
         "must leave free (an integer >= 0); 'last' keeps room up to each request's last token (fewer copies back "
         "to the GPU, lower bits while the KV cache is large). Larger: less movement; smaller: planes come back "
         "sooner as the KV cache shrinks.")]


def reload_reserve(value: str) -> int | None:
    """``--reload-reserve`` as ``EngineConfig.reload_reserve_tokens``: a token count (ASCII digits), or None for
    'last' (any case, spaces around ignored). Raises ``PagedWeightError`` for anything else."""
    text = value.strip().lower()
    if text == "last":
        return None
    if not text.isdigit() or not text.isascii():
        raise PagedWeightError(f"--reload-reserve {value!r} is not allowed: give a number of tokens >= 0 (default "
                               f"{DEFAULT_RELOAD_RESERVE}) or 'last' (up to each request's last token)")
    return int(text)


def check_planner_flags(policy: Policy, max_mean_bits: float | None, reload_reserve_tokens: str) -> None:
    """``--max-mean-bits`` and ``--reload-reserve`` steer the planner's bits: refused (``PagedWeightError``) with a
    policy whose bits do not move, where they would do nothing."""
    if policy.dynamic:
        return
    flag = ("--max-mean-bits" if max_mean_bits is not None
            else "--reload-reserve" if reload_reserve_tokens.strip().lower() != DEFAULT_RELOAD_RESERVE else None)
    if flag is not None:
        held = ("the 16-bit experts (what a run without --artifacts serves) keep their bits" if policy.dense
                else f"the experts of --policy {policy.name} keep their bits")
        raise PagedWeightError(f"{flag} only goes with --policy pagedweight or its ablations: {held}")


DEFAULT_GPU_MEMORY = "4GiB"


def budget_bytes(gpu_memory: str | None) -> int:
    """Bytes of ``--gpu-memory`` (None: the option left out, ``DEFAULT_GPU_MEMORY``). Raises ``PagedWeightError`` for
    an empty value (e.g. an unset shell variable), which must not fall back to the default, or an unreadable one."""
    if gpu_memory is None:
        return parse_size(DEFAULT_GPU_MEMORY)
    if not gpu_memory.strip():
        raise PagedWeightError(f"--gpu-memory is empty: give a size, e.g. 10GiB or 512MiB, or leave the option out "
                               f"for the default {DEFAULT_GPU_MEMORY}")
    return parse_size(gpu_memory)


def policy_dtype(dtype: str, policy: str) -> str:
    """``--dtype`` as served: ``auto`` under ``--policy 16-bit`` is bfloat16 on every device, so the experts in
    the pool are 16-bit (on the CPU ``auto`` would otherwise be float32, twice the bytes the budget counts)."""
    return "bfloat16" if dtype == "auto" and policy == "16-bit" else dtype
NoVerifyOpt = Annotated[bool, typer.Option("--no-verify", help="Do not re-hash the artifact's files against the "
                                           "manifest's checksums (a read of every byte; sizes, layer ids and "
                                           "tables' provenance are still checked).")]
LARGE_ARTIFACT = 256 * 2**20  # bytes to verify above which a progress bar is shown


# Width of a console whose stream is not a terminal (a file, a pipe, CI logs): rich would wrap at 80 columns,
# breaking table rows and summary lines in the middle; a terminal's own width is kept.
PIPE_WIDTH = 4096


def make_console(stderr: bool = False) -> Console:
    """A rich console on stdout or stderr that does not wrap lines at 80 columns when it is not a terminal
    (``COLUMNS`` in the environment still wins)."""
    console = Console(stderr=stderr)
    if console.is_terminal or "COLUMNS" in os.environ:
        return console
    return Console(stderr=stderr, width=PIPE_WIDTH)


def default_model() -> Path:
    return default_model_dir()


@contextmanager
def user_errors(kept: str = "completed pwcal stages are; rerun to resume") -> Iterator[None]:
    """Print ``PagedWeightError`` and failures of the file system (disk full, read-only, no permission: OSError and
    safetensors' write errors) as one ``error:`` line and exit 2, Ctrl-C as one line and exit 130, SIGTERM as one
    line and exit 143 (``kept``: what survives a stop, for that line; an interrupt raised with a message, e.g.
    ``KeyboardInterrupt("3 of 5 requests written")``, says that instead), instead of a traceback. Every writer here
    writes ``.tmp`` then renames, so none of these leaves a half-written file; SIGTERM is turned into an exception
    first so that cleanup code runs."""
    previous = None
    reset_terminated()
    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    except PagedWeightError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        hint = "; free some space or write elsewhere" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        typer.echo(f"error: {exc.strerror or exc}{where}{hint}", err=True)
        sys.exit(2)
    except SafetensorError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except Terminated as exc:
        previous = None  # keep ignoring SIGTERM until the process has exited with 143
        typer.echo(f"terminated (SIGTERM): {str(exc) or f'nothing half-written was kept ({kept})'}", err=True)
        sys.exit(143)
    except KeyboardInterrupt as exc:
        typer.echo(f"interrupted: {str(exc) or f'nothing half-written was kept ({kept})'}", err=True)
        sys.exit(130)
    except Exception:
        if not terminated():  # a real failure: its traceback
            raise
        previous = None  # SIGTERM arrived inside native code, which raised its own error instead of Terminated
        typer.echo(f"terminated (SIGTERM): nothing half-written was kept ({kept})", err=True)
        sys.exit(143)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def run_cli(app: typer.Typer, name: str) -> None:
    """Run console script ``name``'s ``app``; a bad option or argument (click's usage errors, e.g. ``--count 0``) is one
    ``error:`` line naming the command's ``--help``, exit 2, like every other bad input. Click's exceptions are
    told by their shape (``format_message``, ``exit_code``) and name: typer raises those of the click it vendors,
    older typer those of click itself."""
    try:
        code = app(prog_name=name, standalone_mode=False)
    except Exception as exc:
        if type(exc).__name__ == "Abort":  # click's Ctrl-C at a prompt
            typer.echo("interrupted", err=True)
            sys.exit(130)
        if not (hasattr(exc, "format_message") and hasattr(exc, "exit_code")):
            raise
        ctx = getattr(exc, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        typer.echo(f"error: {exc.format_message()}{where}", err=True)
        sys.exit(exc.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


def check_writable_file(flag: str, path: Path) -> None:
    """Raise ``PagedWeightError`` saying exactly why ``flag path`` cannot be written as a file (checked before
    the run, so no work is lost to a bad path)."""
    what = f"cannot write {flag} {path}"
    parent = path.parent
    if path.is_dir():
        name = {"--summary-json": "summary.json", "--trace": "trace.parquet"}.get(flag, "out.jsonl")
        raise PagedWeightError(f"{what}: it is a directory; give a file path, e.g. {flag} {path / name}")
    if not parent.exists():
        raise PagedWeightError(f"{what}: the directory {parent} does not exist; create it (mkdir -p {parent}) or "
                               "give a path in an existing directory")
    if not parent.is_dir():
        raise PagedWeightError(f"{what}: {parent} is a file, not a directory")
    target = path.resolve() if path.is_symlink() else path
    if target.exists() and not target.is_file():  # a device or FIFO (/dev/null) is written in place
        ok = os.access(target, os.W_OK)
    else:  # a regular file is written beside it (.tmp) and renamed over it
        ok = (not target.exists() or os.access(target, os.W_OK)) and os.access(target.parent, os.W_OK) \
            and _can_create(target.parent)
    if not ok:
        raise PagedWeightError(f"{what}: {path if path.exists() else parent} is not writable; give a path you can "
                               "write")


def _can_create(directory: Path) -> bool:
    """Whether a file can be created in ``directory`` (tried, then removed: ``os.access`` says yes to root even
    where the file system refuses, e.g. /proc)."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".pw-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def open_artifact(path: Path, model_dir: Path, verify: bool = True) -> APArtifact:
    """The artifact at ``path`` for ``model_dir``'s checkpoint, its files' contents checked against the manifest's
    checksums unless not ``verify`` (a progress bar on stderr above ``LARGE_ARTIFACT`` bytes); an artifact from
    before checksums gets a one-line warning saying how to add them. Raises ``PagedWeightError`` (one line, the
    bad file and the command that remakes it)."""
    art = APArtifact(path)
    art.check_model(model_dir)
    if art.no_checksums_warning is not None:
        typer.echo(f"warning: {art.no_checksums_warning}", err=True)
    elif verify:
        total = art.checked_bytes()
        if total < LARGE_ARTIFACT:
            art.verify()
        else:
            cols = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn())
            with progress(make_console(stderr=True), *cols, transient=True) as bar:
                task = bar.add_task(f"verifying {path}, MiB", total=total / 2**20)
                art.verify(lambda n: bar.advance(task, n / 2**20))
    return art


def warn_missing_tables(art: APArtifact, policies: Iterable[str], model_dir: Path) -> None:
    """Print ``warning: <line>`` on stderr once per optional calibration table that one of ``policies`` would
    read but whose pwcal stage has not run (``pwrun.engine.build.missing_tables``). ``policies``: names of
    ``pwrun.core.policy.POLICIES``. Raises ``PagedWeightError`` for a damaged artifact (a table its manifest
    records), or for an artifact without the sensitivity and routing tables that a policy but uniform needs (the
    optional tables would not help it)."""
    if any(POLICIES[p].calibrated for p in policies) and not has_calibration(art):
        raise no_calibration(art)
    shown: list[str] = []
    for policy in policies:
        for warning in missing_tables(art, POLICIES[policy], model_dir):
            if warning not in shown:
                shown.append(warning)
                typer.echo(f"warning: {warning}", err=True)


ThreadsOpt = Annotated[int | None, typer.Option(min=1, help="CPU threads for torch (default: the cores that other "
                                                "jobs leave idle, by the 1-minute load average, at least 1; "
                                                "oversubscribed, torch's threads wait on each other).")]


def idle_cores(cores: int | None = None, load: float | None = None) -> int:
    """The cores other jobs leave idle: ``cores`` (default: those this process may run on) minus the 1-minute load
    average (default: the system's), at least 1."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, min(cores, cores - round(load)))


TORCH_THREADS = torch.get_num_threads()  # torch's default, before any command changes it


MAX_THREADS_PER_CORE = 4  # more only oversubscribes (and tens of thousands exhaust the thread pools' memory)


def set_threads(threads: int | None) -> None:
    """Use ``threads`` CPU threads for torch (None: ``idle_cores()``, at most torch's default). Fewer threads than
    cores keep a run steady when other jobs share the cores: oversubscribed, every parallel op waits for a thread
    the scheduler has put aside, and a small model's steps slow down tens of times."""
    if threads is None:
        idle = idle_cores()
        if idle < TORCH_THREADS:  # else torch's own default stays untouched
            torch.set_num_threads(idle)
        return
    if threads < 1:
        raise PagedWeightError("--threads must be >= 1")
    cores = os.cpu_count() or 1
    if threads > MAX_THREADS_PER_CORE * cores:
        raise PagedWeightError(f"--threads {threads} is more than {MAX_THREADS_PER_CORE} per core of this machine's "
                               f"{cores}: give at most {MAX_THREADS_PER_CORE * cores} (or leave it out: the idle "
                               "cores)")
    torch.set_num_threads(threads)
