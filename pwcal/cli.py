"""``pwcal``: the offline calibration command line (Typer). Wiring only.

Pipeline order: quantize -> sensitivity -> [fit-residual, optional] -> search-buckets (``run-all`` runs them
in order; fit-residual only with ``--residual-heads``). ``inspect`` describes a checkpoint; ``eval-uniform`` gives
the uniform-bits quality table.
"""

from __future__ import annotations

import typer
from rich.table import Table

from pwcal import cli_calib, cli_quant, cli_verify
from pwformat.layout import PARENT_BITS
from pwformat.shards import safetensors_files
from pwrun.cli_common import ModelArg, make_console, run_cli, user_errors
from pwrun.engine.budget import format_size
from pwrun.model.checkpoint import TensorReader
from pwrun.model.inventory import expert_blocks, host_memory, parameter_counts
from pwrun.model.loader import load_spec

app = typer.Typer(help="PagedWeight offline calibration. Pipeline, in this order: quantize (AP bit-planes + "
                  "LUTs) -> sensitivity (Hessian s_i^b, bytes M_i^b, routing mass) -> fit-residual (optional: "
                  "prompt-residual heads, served by --policy residual) -> search-buckets (routing buckets, "
                  "multipliers, floors); run-all does them in order (fit-residual with --residual-heads). Each "
                  "stage writes into one artifact directory with a manifest.json and is skipped when complete "
                  "(--force redoes it).", no_args_is_help=True,
                  add_completion=False,
                  rich_markup_mode=None)  # plain help: rich's option panels leave the help text ~17 columns at 80


app.command("quantize")(cli_quant.quantize)
app.command("eval-uniform")(cli_quant.eval_uniform)
app.command("sensitivity")(cli_calib.sensitivity)
app.command("fit-residual")(cli_calib.fit_residual)
app.command("search-buckets")(cli_calib.search_buckets)
app.command("run-all")(cli_calib.run_all)
app.command("verify")(cli_verify.verify)


@app.callback()
def _root() -> None:
    """PagedWeight offline calibration."""


@app.command()
def inspect(model: ModelArg) -> None:
    """Describe a checkpoint: family, MoE layers, expert linear blocks, parameters by kind (16-bit bytes) and the
    peak host memory that calibration and serving are expected to take."""
    with user_errors():
        spec, _ = load_spec(model)
        TensorReader(safetensors_files(model), None, "cpu")  # every shard present and readable (headers only)
        counts = parameter_counts(spec)
        total = sum(counts.values())
        moe = [layer for layer in spec.layers if layer.moe is not None]
        console = make_console()
        console.print(f"[bold]{model}[/bold]: family {spec.family}, {spec.num_layers} layers "
                      f"({len(moe)} MoE), hidden {spec.hidden_size}, vocab {spec.vocab_size}, "
                      f"context {spec.max_position_embeddings}")
        if moe:
            m = moe[0].moe
            assert m is not None
            console.print(f"experts {m.num_experts} x {m.expert_intermediate} (top-{m.top_k}, norm_topk_prob "
                          f"{m.norm_topk_prob}, {m.activation}), shared expert {m.shared_intermediate or 'none'}; "
                          f"{len(expert_blocks(spec))} expert linear blocks")
        beside = sorted({ls.dense_intermediate for ls in moe if ls.dense_intermediate})
        if beside:
            console.print(f"dense MLP beside each MoE block ({', '.join(map(str, beside))} wide): kept at 16 bits "
                          "like attention (only expert blocks become AP bit-planes)")
        windows = sorted({w for w in spec.windows if w is not None})
        if windows:
            sliding = sum(w is not None for w in spec.windows)
            console.print(f"attention: {sliding} sliding-window layers (window {', '.join(map(str, windows))} "
                          f"tokens: their KV pages return to the pool outside it), "
                          f"{spec.num_layers - sliding} global")
        for note in spec.notes:
            console.print(f"note: {note}")
        table = Table("kind", "parameters", "share", "bytes at 16-bit")
        for kind, n in counts.items():
            table.add_row(kind, f"{n:,}", f"{n / total:.1%}", f"{2 * n / 2**20:,.1f} MiB")
        table.add_row("total", f"{total:,}", "100%", f"{2 * total / 2**20:,.1f} MiB")
        console.print(table)
        if moe:
            cal = host_memory(spec, list(range(3, PARENT_BITS + 1)), 4)
            serve = host_memory(spec, list(range(3, PARENT_BITS + 1)), 2)
            console.print(f"host memory beyond the interpreter (3..8-bit artifact of {format_size(cal.artifact)}): "
                          f"calibration {format_size(cal.calibrate(False))} with --device cuda, "
                          f"{format_size(cal.calibrate(True))} on the CPU; serving "
                          f"{format_size(serve.serve(False))} on CUDA (bf16), target at most "
                          f"{format_size(serve.bound())} (artifact + non-expert weights + 10%)")


def console_main() -> None:
    """The ``pwcal`` console script (``pwcal.main``)."""
    run_cli(app, "pwcal")
