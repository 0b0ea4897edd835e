"""``pwcal quantize`` and ``pwcal eval-uniform``: thin wrappers over ``pwcal.quant``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeElapsedColumn

from pwcal.quant.eval_uniform import eval_uniform as run_eval_uniform
from pwcal.quant.eval_uniform import markdown_table
from pwcal.quant.quantize import QuantizeConfig
from pwcal.quant.quantize import quantize as run_quantize
from pwformat.atomic import write_atomic
from pwrun.cli_common import (
    DeviceOpt,
    ModelArg,
    NoVerifyOpt,
    check_writable_file,
    make_console,
    open_artifact,
    user_errors,
)
from pwrun.progress import progress as progress_bars

console = make_console(stderr=True)


def quantize(
    model: ModelArg,
    out: Annotated[Path, typer.Option(help="Artifact directory to write (created; atomic).")],
    calib: Annotated[str, typer.Option(help="Calibration text: bundled c4-calib, a local .json/.jsonl/.json.gz/"
                                       ".parquet/.txt file, or allenai/c4 (online, needs `datasets`).")] = "c4-calib",
    samples: Annotated[int, typer.Option(help="Calibration windows (sequences).")] = 64,
    seq_len: Annotated[int, typer.Option(help="Tokens per calibration window.")] = 512,
    seed_bits: Annotated[int, typer.Option(help="Seed bitwidth of the nested k-means (3 as in AP; 2 lets cold "
                                           "experts drop to 2 bits).")] = 3,
    min_tokens: Annotated[int, typer.Option(help="Experts seeing fewer calibration tokens use uniform k-means "
                                            "weights.")] = 16,
    calib_seed: Annotated[int, typer.Option(help="Seed of the calibration document order.")] = 0,
    method: Annotated[str, typer.Option(help="kmeans: nested k-means on the Hessian diagonal (SqueezeLLM + "
                                        "Any-Precision). gptq: that, then GPTQ-style error feedback on each block's "
                                        "full input Hessian and least-squares LUTs per bitwidth: much better at the "
                                        "seed bitwidth (3 bits), level or slightly worse at 4-7 "
                                        "(docs/quantizer.md); needs enough calibration tokens per expert.")
                      ] = "kmeans",
    damp: Annotated[float, typer.Option(help="gptq: ridge added to the Hessian, as a fraction of its mean "
                                        "diagonal.")] = 0.01,
    feedback_bits: Annotated[int, typer.Option(help="gptq: highest bitwidth quantized with error feedback; higher "
                                               "ones take plain nested splits (faster).")] = 6,
    hessian_memory: Annotated[float, typer.Option(help="gptq: GiB of full Hessians (float64, on --device) held at "
                                                  "once; layers that do not fit take further calibration "
                                                  "passes.")] = 8.0,
    device: DeviceOpt = "auto",
    force: Annotated[bool, typer.Option(help="Overwrite an existing artifact.")] = False,
) -> None:
    """Quantize every expert linear block to Any-Precision bit-planes + per-row LUTs (seed..8 bits)."""
    with user_errors():
        cfg = QuantizeConfig(seed_bits=seed_bits, calib=calib, samples=samples, seq_len=seq_len,
                             calib_seed=calib_seed, min_tokens=min_tokens, method=method, damp=damp,
                             feedback_bits=feedback_bits, hessian_memory_gib=hessian_memory)
        cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with progress_bars(console, *cols) as bar:
            tasks: dict[str, TaskID] = {}

            def progress(stage: str, done: int, total: int) -> None:
                if stage not in tasks:
                    label = "calibration windows" if stage == "calibrate" else "layers quantized"
                    tasks[stage] = bar.add_task(label, total=total)
                bar.update(tasks[stage], completed=done)

            m = run_quantize(model, out, cfg, device=device, force=force, progress=progress,
                             notice=lambda line: console.print(line, highlight=False, markup=False))
        if m.get("skipped"):
            console.print(f"quantize: {out} is already quantized from this model with these parameters, nothing to "
                          "do (--force to redo)")
            return
        q = m["stages"]["quantize"]
        console.print(f"wrote {out}: {q['blocks']} expert blocks at {m['bits'][0]}..8 bits from "
                      f"{q['calibration_tokens']} calibration tokens in {q['seconds']:.1f} s")
        if q["fallback_blocks"]:
            console.print(f"[yellow]warning:[/yellow] {len(q['fallback_blocks'])} blocks saw fewer than "
                          f"{min_tokens} calibration tokens and used uniform k-means weights")


def eval_uniform(
    model: ModelArg,
    artifacts: Annotated[Path, typer.Option(help="AP artifact directory from `pwcal quantize`.")],
    dataset: Annotated[list[str] | None, typer.Option(help="Datasets (repeatable): bundled names or files "
                                                        "(default: wikitext2 and c4).")] = None,
    seq_len: Annotated[int, typer.Option(help="Perplexity window in tokens.")] = 512,
    max_windows: Annotated[int | None, typer.Option(help="At most this many windows per dataset "
                                                  "(default: all).")] = None,
    out: Annotated[Path | None, typer.Option(help="Write the table as markdown (+ .json beside it).")] = None,
    bits: Annotated[list[int] | None, typer.Option(help="Only these bitwidths (repeatable; default: all).")] = None,
    device: DeviceOpt = "auto",
    no_verify: NoVerifyOpt = False,
) -> None:
    """Perplexity with ALL expert blocks at each bitwidth (and 16-bit), with expert-weight memory."""
    with user_errors():
        if out is not None:  # refused before the evaluation, not after it
            check_writable_file("--out", out)
            check_writable_file("--out (its .json)", out.with_suffix(".json"))
        open_artifact(artifacts, model, not no_verify)
        datasets = tuple(dataset or ["wikitext2", "c4"])
        t0 = time.time()
        rows = run_eval_uniform(model, artifacts, datasets, seq_len, max_windows, device, bits,
                   on_row=lambda r: console.print(f"{r['bits']:>2} bits: " + ", ".join(
                       f"{d} {r[f'ppl_{d}']:.3f}" for d in datasets)))
        table = markdown_table(rows, datasets)
        sys.stdout.write(table)
        if out is not None:
            cmd = "pwcal " + " ".join(sys.argv[1:])
            write_atomic(out, f"Command: `{cmd}` ({time.strftime('%Y-%m-%d')}, {time.time() - t0:.0f} s)\n\n"
                         f"{table}".encode())
            write_atomic(out.with_suffix(".json"), json.dumps({"command": cmd, "rows": rows}, indent=1).encode())
