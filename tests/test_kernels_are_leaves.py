"""Kernels are leaves of the import graph: no module under kernels/ imports the runtime, calibration or bench code,
and importing every kernel module loads none of them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
FORBIDDEN = ("pwrun", "pwcal", "bench", "pweval")


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_kernel_module_imports_the_runtime() -> None:
    files = sorted(KERNELS.rglob("*.py"))
    assert len(files) > 10
    bad = {str(f.relative_to(KERNELS)): sorted(_imported(f) & set(FORBIDDEN)) for f in files}
    assert {k: v for k, v in bad.items() if v} == {}


def test_importing_every_kernel_module_loads_no_runtime() -> None:
    mods = sorted(".".join(f.relative_to(KERNELS.parent).with_suffix("").parts) for f in KERNELS.rglob("*.py"))
    code = (f"import importlib, sys\nfor m in {mods!r}: importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=KERNELS.parent).stdout
    assert out.strip() == "[]"
