"""The evaluation results table: one row per run, a declared Parquet schema, atomic appends.

What it does: ``SCHEMA`` names every column (bytes, nats, tokens/s: units in the comments);
``append_rows`` validates rows against it and rewrites the file with the new rows appended (zstd,
``.tmp`` then rename, so a crash never leaves a half-written table); ``read_results`` reads and
checks a table, with a one-line error for a missing, corrupted or foreign file. Quality columns of
tasks a run did not include are null. Beside each table, ``<name>.scores.parquet`` (``SCORES``) keeps
every request's summed NLL per run, so two runs of the same workload can be compared request by
request (paired standard errors). It runs no model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from pwformat.atomic import atomic_path
from pwformat.errors import PagedWeightError

SCHEMA = pa.schema([
    ("run_id", pa.string()),  # joins the per-request scores table
    ("suite", pa.string()),  # "text" (WikiText-2 + C4 windows) or "long" (retrieval + QMSum)
    ("policy", pa.string()),  # a runtime policy (pwrun.core.policy), "16-bit" (the reference model) or "oracle"
    # (the static policy ranked by a measured damage table)
    ("bits", pa.int32()),  # uniform bitwidth (16 for the 16-bit model); null for mixed policies
    ("budget", pa.string()),  # budget label: "min", "U<b>" (uniform b's footprint; U4.5 interpolates), "FP16", "custom"
    ("gpu_memory", pa.int64()),  # total memory of the run (bytes): the --gpu-memory budget, or a static footprint
    ("fixed_bytes", pa.int64()),  # non-expert weights (model dtype)
    ("workspace_bytes", pa.int64()),  # step activation bound
    ("pool_bytes", pa.int64()),  # page pool (expert planes + KV); 0 for the reference model
    ("expert_bytes_mean", pa.float64()),  # expert weights in force (planes + LUTs), time-averaged
    ("expert_bytes_scored", pa.float64()),  # the same, averaged over the decode tokens (~ the scored ones)
    ("expert_bytes_16bit", pa.int64()),  # the same experts at 16 bits
    ("kv_bytes_max", pa.int64()),  # KV cache peak
    ("kv_bytes_mean", pa.float64()),  # KV cache, time-averaged
    ("mean_bits", pa.float64()),  # committed bitwidth averaged over blocks and steps
    ("preemptions", pa.int64()),
    ("demoted_blocks", pa.int64()),
    ("promoted_blocks", pa.int64()),
    ("tokens_per_second", pa.float64()),  # (prefill + decode) tokens / serving seconds; null for the reference
    ("seconds", pa.float64()),  # wall time of the scoring
    ("wikitext2_ppl", pa.float64()), ("wikitext2_tokens", pa.int64()),
    ("c4_ppl", pa.float64()), ("c4_tokens", pa.int64()),
    ("qmsum_ppl", pa.float64()), ("qmsum_tokens", pa.int64()),
    ("retrieval_acc", pa.float64()), ("retrieval_questions", pa.int64()),  # top-1 accuracy in [0, 1]
    ("retrieval_candidates", pa.int32()),  # passages per question (chance = 1 / candidates)
    ("requests", pa.int64()), ("max_batch", pa.int32()), ("max_step_tokens", pa.int32()),
    ("prompt_tokens", pa.int32()), ("continuation_tokens", pa.int32()), ("seed", pa.int64()),
    ("device", pa.string()), ("dtype", pa.string()), ("artifact", pa.string()), ("created", pa.string()),
    ("note", pa.string()),  # why a row has no quality (e.g. a budget below the policy's minimum); else null
])

QUALITY = ("wikitext2", "c4", "qmsum")

# one row per (run, request): the request's summed NLL over its continuation tokens
SCORES = pa.schema([
    ("run_id", pa.string()), ("request", pa.int32()), ("task", pa.string()),
    ("nll", pa.float64()),  # nats, summed over the request's scored tokens
    ("tokens", pa.int32()),
])


def scores_path(results: Path) -> Path:
    """The per-request scores table beside ``results`` (``x.parquet`` -> ``x.scores.parquet``)."""
    return results.with_name(results.stem + ".scores.parquet")


def request_scores(run_id: str, tasks: list[str], logprobs: list[Any]) -> pa.Table:
    """``SCORES`` rows of one run: request k of task ``tasks[k]`` with log-probabilities ``logprobs[k]``."""
    return pa.Table.from_pydict({
        "run_id": [run_id] * len(tasks), "request": list(range(len(tasks))), "task": tasks,
        "nll": [-float(sum(lp)) for lp in logprobs], "tokens": [len(lp) for lp in logprobs]}, schema=SCORES)


def _frame(rows: Iterable[dict[str, Any]]) -> pa.Table:
    rows = list(rows)
    for r in rows:
        extra = set(r) - set(SCHEMA.names)
        if extra:
            raise ValueError(f"result row has columns outside the schema: {sorted(extra)}")
    cols = {f.name: [_null(r.get(f.name)) for r in rows] for f in SCHEMA}
    return pa.Table.from_pydict(cols, schema=SCHEMA)


def _null(v: Any) -> Any:
    return None if isinstance(v, float) and math.isnan(v) else v


def _write(table: pa.Table, path: Path) -> None:
    try:
        with atomic_path(path) as tmp:
            pq.write_table(table, tmp, compression="zstd")
    except OSError as exc:
        raise PagedWeightError(f"cannot write the results table {path}: {exc.strerror}") from exc


def append_rows(path: Path, rows: Iterable[dict[str, Any]], scores: pa.Table | None = None) -> None:
    """Append ``rows`` to the table at ``path`` (created if missing) and ``scores`` (``SCORES``) to the table
    beside it; each write is atomic. Raises ``PagedWeightError``."""
    new = _frame(rows)
    _write(pa.concat_tables([read_table(path), new]) if path.is_file() else new, path)
    if scores is not None and scores.num_rows:
        sp = scores_path(path)
        _write(pa.concat_tables([_read(sp, SCORES), scores]) if sp.is_file() else scores, sp)


def rename(src: Path, dst: Path) -> None:
    """Move a results table and its scores table (a finished sweep's partial files to their final names)."""
    src.replace(dst)
    if scores_path(src).is_file():
        scores_path(src).replace(scores_path(dst))


def read_scores(results: Path) -> pd.DataFrame:
    """The per-request scores beside ``results`` (empty if the table was written without them)."""
    sp = scores_path(results)
    return _read(sp, SCORES).to_pandas() if sp.is_file() else pd.DataFrame(columns=SCORES.names)


def read_table(path: Path) -> pa.Table:
    """The table at ``path`` checked against ``SCHEMA``; raises ``PagedWeightError`` with the fix."""
    if not path.is_file():
        raise PagedWeightError(f"results table {path} does not exist: run `pwrun eval run` or `pwrun eval sweep`")
    return _read(path, SCHEMA)


def _read(path: Path, schema: pa.Schema) -> pa.Table:
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise PagedWeightError(f"{path} is not a readable Parquet file ({str(exc).splitlines()[0]})") from exc
    if not table.schema.remove_metadata().equals(schema):
        raise PagedWeightError(f"{path} is not an eval results table of this version (other columns): "
                               "write to a new file")
    return table


def read_results(path: Path) -> pd.DataFrame:
    """The results as a DataFrame (nullable columns as floats/NaN); ``attrs["path"]``: ``path`` (error messages
    name the table to add rows to)."""
    df = read_table(path).to_pandas()
    df.attrs["path"] = str(path)
    return df
