"""Layers point one way (docs/architecture.md), read from the sources with ``ast``: pwformat at the bottom, kernels as
leaves, pwcal and pweval above pwrun, matplotlib only in pweval."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]


def imported_packages(package: str) -> dict[str, set[str]]:
    """{file: top-level packages it imports} for every .py file under ``package`` (any depth, any scope)."""
    out = {}
    for f in sorted((ROOT / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        out[str(f.relative_to(ROOT))] = names
    return out


def offenders(packages: tuple[str, ...], forbidden: set[str]) -> list[str]:
    return [f"{f} imports {sorted(names & forbidden)}" for p in packages
            for f, names in imported_packages(p).items() if names & forbidden]


def test_pwformat_is_the_bottom_layer() -> None:
    assert offenders(("pwformat",), {"pwrun", "pwcal", "pweval", "pwkernels"}) == []


def test_pwrun_imports_neither_pwcal_nor_pweval() -> None:
    assert offenders(("pwrun",), {"pwcal", "pweval"}) == []


def test_pwcal_does_not_import_pweval() -> None:
    assert offenders(("pwcal",), {"pweval"}) == []


def test_kernels_are_leaves() -> None:
    assert offenders(("pwkernels",), {"pwrun", "pwcal", "pweval", "bench"}) == []


def test_matplotlib_only_in_pweval() -> None:
    assert offenders(("pwformat", "pwrun", "pwcal", "pwkernels", "tools", "bench"), {"matplotlib"}) == []


def test_http_stack_only_in_the_server() -> None:
    """FastAPI, uvicorn and prometheus_client stay in ``pwrun/serve`` (and its command, ``pwrun/cli_serve.py``)."""
    http = {"fastapi", "uvicorn", "starlette", "prometheus_client"}
    found = [f for p in ("pwformat", "pwrun", "pwcal", "pweval", "pwkernels")
             for f, names in imported_packages(p).items() if names & http]
    assert found and all(f.startswith("pwrun/serve/") for f in found), found
    # the engine builder of the server does not need it (the GPU machine's 16-bit serving tests import it alone)
    assert "pwrun/serve/builder.py" not in found


def test_pwformat_loads_without_torch() -> None:
    """Everything in pwformat but the codec (``pwformat.ap``) imports without torch or pwrun."""
    mods = [p.stem for p in (ROOT / "pwformat").glob("*.py") if p.stem not in ("__init__", "ap")]
    code = (f"import sys; import {', '.join('pwformat.' + m for m in mods)}; "
            "print(sorted(m for m in ('torch', 'pwrun', 'pwcal') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


# imports inside functions: optional dependencies, matplotlib for the commands that draw, the console scripts'
# CLI, imported after their SIGTERM handler is in place, scikit-learn, which only fit-residual's heads use, and
# the HTTP stack (FastAPI, pydantic, uvicorn), which only `pwrun serve` loads
DEFERRED = {"datasets", "nbformat", "nbclient", "pweval.figures", "pweval.notebooks", "pweval.cli", "pwcal.cli",
            "sklearn", "pwrun.serve.generation", "pwrun.serve.server"}


def test_imports_are_at_module_top() -> None:
    inside = []
    for package in ("pwformat", "pwrun", "pwcal", "pweval"):
        for f in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(f.read_text(), str(f))
            for fn in ast.walk(tree):
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, ast.Import):
                        mods = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom):
                        mods = [node.module or ""]
                    else:
                        continue
                    core_pandas = package == "pwrun" and "core" in f.parts and mods == ["pandas"]  # core: no pandas
                    inside += [f"{f.relative_to(ROOT)}:{node.lineno} {m}" for m in mods
                               if m not in DEFERRED and m.split(".")[0] not in DEFERRED and not core_pandas]
    assert inside == []


def test_console_scripts_start_without_torch() -> None:
    """The entry points install their SIGTERM handler before anything slow is imported."""
    code = ("import sys; import pweval.main, pwcal.main; "
            "print(sorted(m for m in ('torch', 'pwrun.cli', 'pwcal.cli') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_pwrun_generate_does_not_load_the_http_stack() -> None:
    """``pwrun serve``'s FastAPI / pydantic / uvicorn load when it runs, not for every ``pwrun`` command."""
    code = ("import sys; import pwrun.cli; "
            "print(sorted(m for m in ('fastapi', 'pydantic', 'uvicorn', 'pwrun.serve.server') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_pwrun_eval_is_mounted_by_pweval() -> None:
    from pweval.cli import app as eval_app  # mounts `eval` on the runtime's CLI
    from pwrun.cli import app

    r = CliRunner().invoke(app, ["eval", "--help"])
    assert r.exit_code == 0 and "sweep" in r.stdout and eval_app.registered_commands
