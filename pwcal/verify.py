"""``pwcal verify``: check every file of an artifact against its manifest, or add checksums an old one lacks.

What it does: ``artifact_problems`` lists, one line each, every recorded file that is missing, has another size or
other contents than its checksum, a layer file whose header names another layer or quantize run, and a table of a
complete stage computed for another model or quantize run, and a table file that no stage record lists, each with
the pwcal command that remakes it.
``add_checksums`` records the checksums that an artifact from before them lacks, from the files as they are now
(it cannot tell whether they were damaged before). It imports no model code.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open

from pwformat.checksums import Progress, file_sum, find_problems, remake_command
from pwformat.errors import PagedWeightError
from pwformat.manifest import SCHEMA_VERSION, Manifest, read_manifest, write_manifest
from pwformat.tables import WRITTEN_BY, read_table
from pwformat.writer_lock import check_no_writer, writer_lock


def _layer_problem(art: Path, m: Manifest, layer: str, name: str) -> str | None:
    try:
        with safe_open(str(art / name), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError) as exc:
        return f"{art / name} is unreadable ({exc})"
    if m.run_id is not None and (meta.get("layer"), meta.get("run_id")) != (layer, m.run_id):
        return (f"{art / name} holds layer {meta.get('layer')} of quantize run {meta.get('run_id')}, not layer "
                f"{layer} of run {m.run_id}")
    return None


def artifact_problems(art: Path, on_bytes: Progress | None = None) -> list[str]:
    """Every problem of the artifact ``art`` (module docstring), [] if none. Raises ``PagedWeightError`` if the
    manifest itself is bad, the artifact has no checksums, or a pwcal stage is writing it."""
    check_no_writer(art)
    m = read_manifest(art)
    if m.checksums is None:
        raise PagedWeightError(f"{art} has no content checksums (made before they existed): `pwcal verify {art} "
                               "--update` records them from the files as they are now")
    sums, model = m.checksums, m.model.path
    names = m.checked_files()
    out = list(find_problems(art, sums, names, model, on_bytes=on_bytes))
    bad = {n for n in names if any(p.startswith(f"{art / n} ") for p in out)}
    for layer, name in m.files.items():
        problem = None if name in bad else _layer_problem(art, m, layer, name)
        if problem is not None:
            out.append(f"{problem}: remake it with {remake_command('quantize', model, art)}")
    for name in names:
        table = name.removesuffix(".parquet")
        if name in bad or table not in WRITTEN_BY:
            continue
        try:
            read_table(art / name, table, sums[name].xxh3_128, m.provenance(),
                       f"remake it with {remake_command(WRITTEN_BY[table], model, art)}")
        except PagedWeightError as exc:
            out.append(str(exc))
    listed = {f for rec in m.stages.values() for f in rec.get("files", [])}  # complete or stale
    for table, stage in WRITTEN_BY.items():  # a table no stage record lists: nothing vouches for it
        path = art / f"{table}.parquet"
        if path.name not in listed and path.exists():
            out.append(f"{path} is not recorded in the manifest (copied in?; the runtime ignores it): remove it, or "
                       f"remake it with {remake_command(stage, model, art)}")
    return out


def add_checksums(art: Path) -> int:
    """Record a checksum for every layer file and complete stage's table of ``art`` that has none (under the
    writer lock); returns how many were added."""
    with writer_lock(art):
        m = read_manifest(art)
        sums = dict(m.checksums or {})
        layer_of = {name: int(k) for k, name in m.files.items()}
        stage_of = {f: stage for stage, rec in m.stages.items() for f in rec.get("files", [])}
        added = 0
        for name in m.checked_files():
            if name not in sums:
                path = art / name
                if not path.is_file():
                    raise PagedWeightError(f"{path} is missing: remake it with "
                                           f"{remake_command(stage_of.get(name, 'quantize'), m.model.path, art)}")
                sums[name] = file_sum(path, "quantize" if name in layer_of else stage_of[name], layer_of.get(name))
                added += 1
        if added or m.checksums is None:
            m.checksums, m.schema_version = sums, SCHEMA_VERSION
            write_manifest(art, m)
        return added
