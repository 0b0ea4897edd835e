"""The artifact's calibration tables as serving reads them: which optional tables a policy would use but lacks
(one warning line each), the block table of M_i^b and sensitivities, the bucket policy and the calibration input
norms. A table whose pwcal stage is recorded as incomplete (an upstream stage re-ran with --force, or the stage was
interrupted) is not read: it is from an earlier, inconsistent run.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from pwformat.errors import PagedWeightError
from pwformat.tables import WRITTEN_BY
from pwrun.ap.artifact import APArtifact
from pwrun.core.planner.buckets import BucketPolicy
from pwrun.core.planner.online import FEATURES
from pwrun.core.planner.tables import UNITS, BlockTable
from pwrun.core.policy import Policy
from pwrun.model.inventory import expert_blocks
from pwrun.model.lean import LeanMoEModel

# Tables a policy can serve without, with the pwcal stage that writes each and what serving loses without it.
OPTIONAL_TABLES = {
    "residual_heads": ("fit-residual", "without prompt-residual heads (the planner's prompt factor eta is 1)"),
    "buckets": ("search-buckets", "with one neutral routing bucket (mu 1, floors at the seed bits)"),
    "block_features": ("sensitivity", "without the calibration input norms of the prompt-residual heads"),
}


TABLE_STAGE = WRITTEN_BY  # table -> the pwcal stage writing it


def _stale(art: APArtifact, name: str) -> str | None:
    """Why the table ``name`` of ``art`` must not be used although its file exists, or None: its pwcal stage is
    recorded in the manifest as not complete (an upstream stage re-ran with --force, or the stage itself was
    interrupted), so the file is from an earlier, inconsistent run; or (an artifact with checksums) no complete
    stage record lists it, so nothing vouches for it (e.g. a file copied in from another artifact)."""
    stage, checked = TABLE_STAGE[name], art.manifest.checksums is not None
    st = art.manifest.stages.get(stage)
    if st is None:  # before checksums a manifest may not record every stage; since, it records every table
        return f"the manifest records no '{stage}' run that wrote it" if checked else None
    if not st.get("complete", True):
        return str(st.get("stale_because") or f"stage '{stage}' did not complete")
    if checked and f"{name}.parquet" not in st.get("files", []):
        return f"the manifest's '{stage}' record does not list it"
    return None


def missing_tables(art: APArtifact, policy: Policy, model_dir: Path | str = "MODEL") -> list[str]:
    """One warning line per optional table that ``policy`` would use but whose pwcal stage has not run.

    Raises ``PagedWeightError`` if the manifest records that stage complete but the file is gone (a damaged
    artifact: serving without it would silently change the method).
    """
    stages = art.manifest.stages
    out = []
    for name, (stage, loss) in OPTIONAL_TABLES.items():
        path = art.path / f"{name}.parquet"
        if not policy.reads(name):
            continue
        fix = f"`pwcal {stage} {model_dir} --artifacts {art.path}"
        if path.is_file():
            why = _stale(art, name)
            if why is not None:
                out.append(f"{path.name} in {art.path} is out of date ({why}): serving {loss}; remake it with "
                           f"{fix} --force`")
            continue
        done = stages.get(stage, {})
        if done.get("complete") and path.name in done.get("files", []):
            raise PagedWeightError(f"{path} is missing, though the manifest records stage '{stage}' as complete: "
                                   f"remake it with {fix} --force`")
        out.append(f"{art.path} has no {path.name}: serving {loss}; make it with {fix}`")
    return out


def _current(art: APArtifact, name: str) -> bool:
    """Table ``name`` of ``art`` exists and its stage's record vouches for it."""
    return (art.path / f"{name}.parquet").is_file() and _stale(art, name) is None


def read_table(art: APArtifact, name: str) -> pd.DataFrame | None:
    """Table ``name`` of ``art``, or None if it is missing or stale."""
    return art.table(name) if _current(art, name) else None


def has_calibration(art: APArtifact) -> bool:
    """Whether ``art`` has current sensitivity and routing tables (what a ``Policy.calibrated`` policy needs)."""
    return _current(art, "sensitivity") and _current(art, "routing")


def no_calibration(art: APArtifact) -> PagedWeightError:
    model = art.manifest.model.path
    return PagedWeightError(f"{art.path} has no complete calibration tables (sensitivity/routing): run "
                            f"`pwcal sensitivity {model} --artifacts {art.path}` (then `pwcal search-buckets {model} "
                            f"--artifacts {art.path}`) first, or use --policy uniform --bits B")


def block_table(art: APArtifact, model: LeanMoEModel, need_calibration: bool) -> BlockTable:
    """Calibration tables as a ``BlockTable``; for a uniform policy without calibration, a neutral one."""
    sens, routing = read_table(art, "sensitivity"), read_table(art, "routing")
    if sens is not None and routing is not None:
        return BlockTable.from_frames(sens, routing)
    if need_calibration:
        raise no_calibration(art)
    blocks = sorted(expert_blocks(model.spec), key=lambda b: (b.layer, b.expert, b.unit))
    bits = np.asarray(art.bits)
    return BlockTable(bits=bits, layer=np.array([b.layer for b in blocks]), expert=np.array([b.expert for b in blocks]),
                      unit=np.array([UNITS.index(b.unit) for b in blocks]),
                      sens=np.zeros((len(blocks), bits.size)), bytes=np.zeros((len(blocks), bits.size), np.int64),
                      tokens=np.zeros(len(blocks), np.int64), mass=np.ones(len(blocks)))


DAMAGE_COLUMNS = ["layer", "expert", "unit", "bits", "kl"]


KL_ROUNDING = 1e-8  # nats: a KL measured between near-equal distributions may round this far below 0 (read as 0)


def read_damage(path: Path, keys: list[tuple[int, int, str]], bits: list[int]) -> pd.Series:
    """The ``kl`` column of the damage table at ``path`` (parquet: layer, expert, unit, bits, kl; one row per block
    and bitwidth, e.g. ``tools/oracle_allocation.py``'s measured per-block output KL), indexed by (layer, expert,
    unit, bits). Raises ``PagedWeightError`` (one line) for an unreadable file, missing columns, duplicate rows,
    a kl that is not finite or negative beyond rounding (``KL_ROUNDING``; within it, read as 0), or a (block,
    bits) pair of ``keys`` x ``bits`` it lacks."""
    try:
        names = pq.read_schema(path).names
        missing = [c for c in DAMAGE_COLUMNS if c not in names]
        if missing:
            raise PagedWeightError(f"the damage table {path} lacks the columns {', '.join(missing)} (it needs "
                                   f"{', '.join(DAMAGE_COLUMNS)}; it has {', '.join(names[:10])})")
        df = pd.read_parquet(path, columns=DAMAGE_COLUMNS)
    except PagedWeightError:
        raise
    except Exception as exc:  # pyarrow raises several types for a missing, foreign or corrupt file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PagedWeightError(f"cannot read the damage table {path}: {first[:200]}") from exc
    key = ["layer", "expert", "unit", "bits"]
    dup = df.duplicated(key)
    if dup.any():
        r = df[dup].iloc[0]
        raise PagedWeightError(f"the damage table {path} has {int(dup.sum())} duplicate (layer, expert, unit, bits) "
                               f"rows, e.g. {tuple(r[key])}: keep one row per block and bitwidth")
    kl = pd.to_numeric(df.kl, errors="coerce").to_numpy(np.float64)
    bad = ~np.isfinite(kl) | (kl < -KL_ROUNDING)
    if bad.any():
        raise PagedWeightError(f"the damage table {path} has {int(bad.sum())} kl values that are not finite and >= 0 "
                               f"(e.g. {df.kl[bad].iloc[0]!r}): a damage is a KL divergence, measure it again")
    out = pd.Series(np.maximum(kl, 0.0), index=pd.MultiIndex.from_frame(df[key]))
    want = [(la, e, u, b) for la, e, u in keys for b in bits]
    lacking = [k for k in want if k not in out.index]
    if lacking:
        raise PagedWeightError(f"the damage table {path} has no row for {len(lacking)} (block, bits) pairs of this "
                               f"artifact, e.g. layer/expert/unit/bits {lacking[0]}: measure it on this artifact")
    return out


def with_damage(table: BlockTable, path: Path) -> BlockTable:
    """``table`` with s_i^b replaced by the ``kl`` of the damage table at ``path`` (``read_damage``, which raises
    ``PagedWeightError`` for a table that does not fit)."""
    keys = [(int(la), int(e), UNITS[u]) for la, e, u in zip(table.layer, table.expert, table.unit, strict=True)]
    kl = read_damage(path, keys, [int(b) for b in table.bits])
    sens = kl.loc[[(*k, int(b)) for k in keys for b in table.bits]].to_numpy(np.float64)
    return replace(table, sens=sens.reshape(table.n, table.bits.size))


def bucket_policy(art: APArtifact) -> BucketPolicy:
    """The artifact's routing-bucket policy, or one neutral bucket without a complete buckets table."""
    df = read_table(art, "buckets")
    if df is None:
        return BucketPolicy.neutral(art.seed_bits)
    return BucketPolicy.from_frame(df)


def calib_features(art: APArtifact, table: BlockTable) -> np.ndarray | None:
    """[n, 3] calibration input-norm features; a down block takes its expert's gate_up ones (see online.py)."""
    df = read_table(art, "block_features")
    if df is None:
        return None
    gu = df[df.unit == "gate_up"].set_index(["layer", "expert"])
    out = np.zeros((table.n, 3))
    for i, (la, e) in enumerate(zip(table.layer.tolist(), table.expert.tolist(), strict=True)):
        if (la, e) in gu.index:
            out[i] = gu.loc[(la, e), list(FEATURES)].to_numpy(np.float64)
    return out
