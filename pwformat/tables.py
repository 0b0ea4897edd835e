"""Parquet tables of the calibration pipeline: declared schemas, atomic zstd writes, validated reads.

What it does: one ``pyarrow`` schema per table (``sensitivity``, ``routing``, ``block_features``,
``residual_heads``,
``buckets``, ``bucket_search``), ``write_table`` (validate against the schema, zstd, ``.tmp`` then
rename; the table's provenance, the model's fingerprint and the quantize run's id, goes into the Parquet schema
metadata) and ``read_table`` (clear error for a missing, truncated or corrupted file, a schema mismatch, contents
that differ from the manifest's checksum, or a table of another model or quantize run). The pandas DataFrames
that go in and out are what notebooks and the planner read. It imports no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from pwformat.atomic import atomic_path
from pwformat.checksums import digest_bytes
from pwformat.errors import PagedWeightError

PROVENANCE_KEY = b"pagedweight.provenance"  # schema metadata: JSON {"model": fingerprint, "run": quantize run id}

SCHEMAS: dict[str, pa.Schema] = {
    # one row per linear block i = (layer, expert, unit) and bitwidth b (SPEC Eq. 2, 3)
    "sensitivity": pa.schema([
        ("layer", pa.int32()), ("expert", pa.int32()), ("unit", pa.string()), ("bits", pa.int32()),
        ("sensitivity", pa.float64()),  # s_i^b = sum_j h_ij (W_ij - W_ij^b)^2
        ("bytes", pa.int64()),  # M_i^b
        ("tokens", pa.int64()),  # calibration tokens routed to the expert
        ("fallback", pa.bool_()),  # True: too few tokens, h is the layer's typical per-token Hessian
    ]),
    # one row per (layer, expert): routing mass m (Eq. 1) and routed (token, slot) count
    "routing": pa.schema([
        ("layer", pa.int32()), ("expert", pa.int32()), ("mass", pa.float64()), ("tokens", pa.int64()),
    ]),
    # reference input-norm features of each block on the sensitivity calibration set (Eq. 5 normaliser)
    "block_features": pa.schema([
        ("layer", pa.int32()), ("expert", pa.int32()), ("unit", pa.string()),
        ("mean_norm", pa.float64()), ("rms_norm", pa.float64()), ("max_norm", pa.float64()),
    ]),
    # one linear head per (unit, transition b -> b'): rho_hat = w . phi + a (Eq. 5), confidence c (Eq. 6)
    "residual_heads": pa.schema([
        ("unit", pa.string()), ("bits_from", pa.int32()), ("bits_to", pa.int32()),
        ("w_mean_norm", pa.float64()), ("w_rms_norm", pa.float64()), ("w_max_norm", pa.float64()),
        ("intercept", pa.float64()), ("r2_heldout", pa.float64()), ("confidence", pa.float64()),
        ("rho_min", pa.float64()), ("rho_max", pa.float64()), ("n_train", pa.int64()), ("n_heldout", pa.int64()),
    ]),
    # the chosen routing buckets: mass-quantile upper bound, multiplier mu, floor per stage, depth cap; and the
    # uniform-equivalent bits at and above which the neutral policy applies instead (same in every row; NaN: never)
    "buckets": pa.schema([
        ("bucket", pa.int32()), ("mass_quantile_hi", pa.float64()), ("mu", pa.float64()),
        ("floor_stage0", pa.int32()), ("floor_stage1", pa.int32()), ("depth_cap", pa.int32()),
        ("neutral_from_bits", pa.float64()),
    ]),
    # every candidate the bucket search scored; split: "select" (every candidate, ppl and score on the first
    # ``windows`` selection windows: those it saw before the race left it behind) or "confirm" (winner and neutral
    # on the later held-out windows)
    "bucket_search": pa.schema([
        ("candidate", pa.int32()), ("setting", pa.string()), ("split", pa.string()), ("budget_bytes", pa.int64()),
        ("expert_bytes", pa.int64()), ("windows", pa.int32()), ("ppl", pa.float64()), ("score", pa.float64()),
    ]),
}

# table -> the pwcal stage that writes it
WRITTEN_BY = {"sensitivity": "sensitivity", "routing": "sensitivity", "block_features": "sensitivity",
              "residual_heads": "fit-residual", "buckets": "search-buckets", "bucket_search": "search-buckets"}


def write_table(df: pd.DataFrame, path: Path, name: str, provenance: dict[str, str] | None = None) -> None:
    """Write ``df`` as ``SCHEMAS[name]`` to ``path`` (zstd, atomic), recording ``provenance``
    (``Manifest.provenance()``). Raises ``ValueError`` on schema mismatch."""
    schema = SCHEMAS[name]
    if provenance is not None:
        schema = schema.with_metadata({PROVENANCE_KEY: json.dumps(provenance, sort_keys=True).encode()})
    missing = [f for f in schema.names if f not in df.columns]
    if missing:
        raise ValueError(f"table {name} lacks columns {missing}")
    table = pa.Table.from_pandas(df[schema.names], schema=schema, preserve_index=False)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def read_table(path: Path, name: str, digest: str | None = None, provenance: dict[str, str] | None = None,
               remake: str = "re-run its pwcal stage with --force") -> pd.DataFrame:
    """Read ``path`` and check it against ``SCHEMAS[name]``, its XXH3-128 ``digest`` and its ``provenance`` (each if
    given); raises ``PagedWeightError`` ending in ``remake`` (what to do)."""
    if not path.is_file():
        raise PagedWeightError(f"{path} is missing: run the pwcal stage that writes {name} first")
    data = path.read_bytes()  # once: the bytes hashed are the bytes parsed
    if digest is not None and digest_bytes(data) != digest:
        raise PagedWeightError(f"{path} is corrupt (its contents differ from the checksum in the manifest): {remake}")
    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowInvalid, OSError) as exc:
        raise PagedWeightError(f"{path} is truncated or corrupted ({str(exc).splitlines()[0]}): {remake}") from exc
    want = SCHEMAS[name]
    if not table.schema.remove_metadata().equals(want):
        raise PagedWeightError(f"{path} does not have the {name} schema of this version: {remake}")
    if provenance is not None:
        raw = (table.schema.metadata or {}).get(PROVENANCE_KEY)
        try:
            got = json.loads(raw) if raw else {}
        except ValueError:
            got = None
        if not isinstance(got, dict):
            raise PagedWeightError(f"{path} has unreadable provenance metadata (not the JSON object pwcal writes): "
                                   f"{remake}")
        if got.get("model") != provenance["model"]:
            raise PagedWeightError(f"{path} was computed for another model (fingerprint {got.get('model')}, this "
                                   f"artifact's is {provenance['model']}): {remake}")
        if got.get("run") != provenance["run"]:
            raise PagedWeightError(f"{path} was computed from another quantize run ({got.get('run')}, this "
                                   f"artifact's is {provenance['run']}): {remake}")
    return table.to_pandas()
