"""``pwcal verify``: thin wrapper over ``pwcal.verify``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

from pwcal.verify import add_checksums, artifact_problems
from pwformat.manifest import read_manifest
from pwrun.cli_common import make_console, user_errors
from pwrun.progress import progress

console = make_console(stderr=True)


def verify(
    artifacts: Annotated[Path, typer.Argument(help="Artifact directory (from `pwcal quantize` / `run-all`).")],
    update: Annotated[bool, typer.Option(help="Only for an artifact made before checksums: record them from its "
                                         "files as they are now (cannot tell whether they were damaged "
                                         "before). Existing checksums are never changed.")] = False,
) -> None:
    """Check every file of an artifact: size and content checksum (XXH3-128), the layer and quantize run in each
    layer file's header, and each table's model fingerprint and run. Prints one line per bad file with the
    command that remakes it; exit code 2 if any."""
    with user_errors():
        if update:
            added = add_checksums(artifacts)
            console.print(f"{artifacts}: recorded the checksums of {added} files as they are now" if added else
                          f"{artifacts}: every file already has a checksum, nothing to add", highlight=False)
        cols = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn())
        m = read_manifest(artifacts)
        total = sum(m.checksums[f].size for f in m.checked_files() if f in m.checksums) if m.checksums else 0
        with progress(console, *cols, transient=True) as bar:
            task = bar.add_task(f"verifying {artifacts}, MiB", total=total / 2**20)
            problems = artifact_problems(artifacts, lambda n: bar.advance(task, n / 2**20))
        for p in problems:
            typer.echo(f"error: {p}", err=True)
        if problems:
            sys.exit(2)
        console.print(f"{artifacts}: every file matches its manifest", highlight=False)
