"""Execute the analysis notebooks headless (nbclient), pointing them at artifacts through environment variables.

What it does: ``NOTEBOOKS`` lists ``notebooks/*.ipynb``; ``execute`` runs one in a fresh Python kernel
with ``PW_ARTIFACTS`` (calibration artifact directory), ``PW_RESULTS`` (eval results table),
``PW_TRACE`` (a runtime trace) and ``PW_FIGURES`` (where the notebooks save their PNGs) set, and
raises ``nbclient``'s ``CellExecutionError`` if a cell fails. Notebooks are not rewritten (their
committed form has no outputs; the figures they render are files). Needs the ``dev`` extra
(nbformat, nbclient, ipykernel).
"""

from __future__ import annotations

import os
from pathlib import Path

NOTEBOOKS_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = ("calibration.ipynb", "quality_memory.ipynb", "runtime_timeline.ipynb")


def execute(notebook: Path, env: dict[str, str], timeout: int = 600) -> None:
    """Run every cell of ``notebook`` with ``env`` added to the kernel's environment (seconds ``timeout`` per cell)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(notebook, as_version=4)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(notebook.parent)}}).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def execute_all(artifacts: Path, results: Path, trace: Path, figures: Path) -> list[Path]:
    """Run every notebook of ``NOTEBOOKS`` on these inputs; returns the PNGs now in ``figures``."""
    figures.mkdir(parents=True, exist_ok=True)
    env = {"PW_ARTIFACTS": str(artifacts.resolve()), "PW_RESULTS": str(results.resolve()),
           "PW_TRACE": str(trace.resolve()), "PW_FIGURES": str(figures.resolve())}
    for name in NOTEBOOKS:
        execute(NOTEBOOKS_DIR / name, env)
    return sorted(figures.glob("*.png"))
