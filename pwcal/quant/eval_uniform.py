"""Quality table of uniform precision: perplexity with every expert block at b bits, and its memory.

What it does: for 16-bit and every bitwidth of an AP artifact, dequantizes all expert blocks
at that bitwidth (reference path), measures perplexity on each dataset (``pwrun.ppl``) and the
bytes of the expert weights (``pwformat.cost.block_bytes``, SPEC Eq. 3; 16-bit = 2 bytes per
weight). It does not pick per-block precision (the planner does).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pwformat.cost import block_bytes
from pwformat.errors import PagedWeightError
from pwrun.ap.artifact import APArtifact
from pwrun.ap.dense import dense_model
from pwrun.data import read_text
from pwrun.model.inventory import expert_blocks
from pwrun.model.loader import load_model, load_tokenizer
from pwrun.ppl import perplexity


def eval_uniform(model_dir: Path, artifact_dir: Path, datasets: tuple[str, ...] = ("wikitext2", "c4"),
                 seq_len: int = 512, max_windows: int | None = None, device: str = "auto",
                 bits_list: list[int] | None = None, on_row: Callable[[dict[str, Any]], None] | None = None
                 ) -> list[dict[str, Any]]:
    """One row per precision: {bits, expert_bytes, expert_bytes_per_weight, ppl_<dataset>...}.

    Raises ``PagedWeightError`` if the artifact belongs to another model.
    """
    art = APArtifact(artifact_dir)
    art.check_model(model_dir)
    tok = load_tokenizer(model_dir)
    base = load_model(model_dir, device=device)
    ids = {d: tok(read_text(d), add_special_tokens=False, verbose=False).input_ids for d in datasets}
    blocks = expert_blocks(base.spec)
    weights = sum(b.n * b.k for b in blocks)
    rows = []
    chosen = sorted(bits_list or art.bits, reverse=True)
    unknown = [b for b in chosen if b not in art.bits]
    if unknown:
        raise PagedWeightError(f"bits {unknown} are not in this artifact ({art.bits})")
    for bits in [16, *chosen]:
        model = base if bits == 16 else dense_model(art, base, bits)
        nbytes = 2 * weights if bits == 16 else sum(block_bytes(b.n, b.k, bits, art.seed_bits) for b in blocks)
        row: dict[str, Any] = {"bits": bits, "expert_bytes": nbytes, "expert_bits_per_weight": 8 * nbytes / weights}
        for d, toks in ids.items():
            row[f"ppl_{d}"] = perplexity(model, toks, seq_len=seq_len, max_windows=max_windows).ppl
        rows.append(row)
        if on_row:
            on_row(row)
    return rows


def markdown_table(rows: list[dict[str, Any]], datasets: tuple[str, ...]) -> str:
    """The rows as a markdown table, with perplexity change against the 16-bit row."""
    base = rows[0]
    head = "| expert bits | expert weights (MiB) | bits/weight incl. LUT | " + " | ".join(
        f"{d} ppl (vs 16-bit)" for d in datasets) + " |"
    lines = [head, "|" + "---|" * (3 + len(datasets))]
    for r in rows:
        cells = [f"{r[f'ppl_{d}']:.3f} ({100 * (r[f'ppl_{d}'] / base[f'ppl_{d}'] - 1):+.2f}%)" for d in datasets]
        lines.append(f"| {r['bits']} | {r['expert_bytes'] / 2**20:.2f} | {r['expert_bits_per_weight']:.3f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
