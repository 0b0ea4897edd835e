"""Every data file inside the packages ships in the wheel: ``pwkernels`` reads its launch configs
(``pwkernels/configs/*.json``) at import, so a non-editable ``pip install .`` without them failed on import."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (the project supports 3.10, where this test skips)

ROOT = Path(__file__).resolve().parents[1]


def test_package_data_covers_every_non_python_file() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = cfg.get("package-data", {})
    missing = []
    for pkg in ("pwformat", "pwcal", "pwrun", "pweval", "pwkernels"):
        for f in (ROOT / pkg).rglob("*"):
            if not f.is_file() or f.suffix in (".py", ".pyc") or "__pycache__" in f.parts:
                continue
            rel = f.relative_to(ROOT / pkg).as_posix()
            if not any(fnmatch.fnmatch(rel, g) for g in globs.get(pkg, [])):
                missing.append(f"{pkg}/{rel}")
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
    assert (ROOT / "pwkernels" / "configs" / "ap_moe.json").exists()  # the walk above saw real files
