"""Pipeline stages recorded in an artifact's manifest: skip a completed stage, require earlier ones.

What it does: ``locked_stage`` makes a stage function hold the artifact's writer lock
(``pwformat.writer_lock``) for its whole run; ``begin_stage`` decides whether a stage must run (not done, or
``force``), refuses to silently redo a completed stage with other parameters, and checks that the previous stage
is complete, that the artifact belongs to the given model and that the files the stage reads match their
checksums; ``start_writing`` marks the stage and later ones incomplete just before the stage writes (so bad input
found while it computes changes nothing); ``finish_stage`` records the stage (config, outputs, timing, warnings)
and the checksums of its files in ``manifest.json`` atomically. It imports no torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

from pwformat.checksums import file_sum, verify_files
from pwformat.errors import PagedWeightError
from pwformat.manifest import Manifest, check_same_model, read_manifest, stages_after, stages_before, write_manifest
from pwformat.writer_lock import writer_lock
from pwrun.signals import deferred_signals

P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C")


def locked_stage(fn: Callable[Concatenate[Path, Path, P], R]) -> Callable[Concatenate[Path, Path, P], R]:
    """``fn(model_dir, artifact_dir, ...)`` run while holding ``artifact_dir``'s writer lock (a second writer gets a
    one-line error naming the holder). A directory without a manifest is refused first, without a lock file."""
    @functools.wraps(fn)
    def run(model_dir: Path, artifact_dir: Path, *args: P.args, **kwargs: P.kwargs) -> R:
        read_manifest(artifact_dir)
        with writer_lock(artifact_dir):
            return fn(model_dir, artifact_dir, *args, **kwargs)
    return run


def recorded_config(artifact_dir: Path, stage: str, cls: type[C], optional: tuple[str, ...] = ()) -> C:
    """The parameters ``stage`` ran with (its manifest record) as the dataclass ``cls``; ``optional``: fields a
    manifest from before them lacks (their defaults apply). Raises ``PagedWeightError`` naming a missing, mistyped
    or invalid field and the command that redoes the stage."""
    rec = read_manifest(artifact_dir).stage(stage).get("config", {})
    where = f"{artifact_dir / 'manifest.json'}: stages.{stage}.config"
    fix = f"redo the stage: `pwcal {stage} MODEL --artifacts {artifact_dir} --force`"
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in rec:
            if f.name in optional:
                continue
            raise PagedWeightError(f"{where}.{f.name} is missing: {fix}")
        v, kind = rec[f.name], hints[f.name]
        number = isinstance(v, int | float) and not isinstance(v, bool)
        ok = (number and isinstance(v, int) if kind is int else number and math.isfinite(v) if kind is float
              else isinstance(v, kind))
        if not ok:
            raise PagedWeightError(f"{where}.{f.name} is {v!r:.40}, not {getattr(kind, '__name__', kind)}: {fix}")
        values[f.name] = v
    try:
        return cls(**values)
    except PagedWeightError as exc:
        raise PagedWeightError(f"{where} is not valid ({exc}): {fix}") from None


def begin_stage(artifact_dir: Path, model_dir: Path, stage: str, config: dict[str, Any], force: bool,
                defaults: dict[str, Any] | None = None) -> bool:
    """True if ``stage`` must run; False if it is complete with the same ``config`` (skip). ``defaults``: the
    values of parameters that a manifest from before they existed did not record.

    Raises ``PagedWeightError`` if a stage it reads is missing (``stages_before``: not the optional side stages),
    the artifact is another model's, or the stage is complete with other parameters and ``force`` is not set.
    """
    manifest = read_manifest(artifact_dir)
    check_same_model(manifest, model_dir, artifact_dir, full=True)
    for prev in stages_before(stage):
        if not manifest.complete(prev):
            raise PagedWeightError(f"{artifact_dir}: stage '{prev}' has not completed; run `pwcal {prev}` before "
                                   f"`pwcal {stage}`")
    if manifest.checksums is not None:  # what this stage reads: the layer files and the earlier stages' tables
        verify_files(artifact_dir, manifest.checksums, manifest.checked_files(stage), manifest.model.path)
    done = manifest.stage(stage)
    if done.get("complete") and not force:
        recorded, wanted = {**(defaults or {}), **done.get("config", {})}, json.loads(json.dumps(config))  # lists
        if recorded == wanted:
            if manifest.checksums is not None:  # a skip vouches for the stage's own files: nothing later reads them
                verify_files(artifact_dir, manifest.checksums, done.get("files", []), manifest.model.path)
            return False
        diff = ", ".join(f"{k}: {recorded.get(k)!r} -> {wanted.get(k)!r}" for k in sorted(set(recorded) | set(wanted))
                         if recorded.get(k) != wanted.get(k))
        raise PagedWeightError(f"{artifact_dir}: '{stage}' already ran with other parameters ({diff}); redo it with "
                               f"`pwcal {stage} MODEL --artifacts {artifact_dir} --force` and these parameters, or "
                               "keep it by passing the recorded ones")
    return True  # the manifest is untouched until ``start_writing``: a run refused or stopped before it loses nothing


@contextlib.contextmanager
def committing(artifact_dir: Path, stage: str) -> Iterator[None]:
    """``start_writing`` then the block (the stage writes its tables and calls ``finish_stage``) with Ctrl-C and
    SIGTERM deferred to its end: an interrupt once the writing began would leave the stage recorded as incomplete
    (a completed one lost) or its new tables under the old record."""
    with deferred_signals():
        start_writing(artifact_dir, stage)
        yield


def start_writing(artifact_dir: Path, stage: str) -> None:
    """Call right before ``stage`` (one of ``STAGES``) writes its first table: until ``finish_stage``, it and later
    stages are recorded as not complete (their tables may mix this run's and the previous run's), with a
    ``stale_because`` reason the runtime's warnings quote. Raises ``PagedWeightError`` if the manifest is missing or
    corrupt."""
    manifest = read_manifest(artifact_dir)
    stages = manifest.stages
    for name in (stage, *stages_after(stage)):
        if name in stages:
            stages[name]["complete"] = False
            stages[name]["stale_because"] = f"{stage} was being re-run and did not finish"
    write_manifest(artifact_dir, manifest)


def finish_stage(artifact_dir: Path, stage: str, info: dict[str, Any]) -> Manifest:
    """Record ``stage`` as complete with ``info`` and the checksums of ``info["files"]`` (hashed now, under the
    writer lock); later stages are marked stale (incomplete)."""
    manifest = read_manifest(artifact_dir)
    if manifest.checksums is not None:  # an artifact from before checksums gets them from `pwcal verify --update`
        for name in info.get("files", []):
            manifest.checksums[name] = file_sum(artifact_dir / name, stage)
    stages = manifest.stages
    for later in stages_after(stage):
        if later in stages:
            stages[later]["complete"] = False
            stages[later]["stale_because"] = f"{stage} was re-run"
    stages[stage] = {"complete": True, **info}
    write_manifest(artifact_dir, manifest)
    return manifest
