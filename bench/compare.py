"""Run the serving suite of another build (a git revision, or a directory holding its tree) in a fresh process
with the same decode-table options, and record its rows beside ours (``python -m bench.serving --compare-commit``).
Older trees without ``bench/serving.py`` run their ``bench/serve_speed.py``, whose rows are converted to the
suite's field names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import environment, write_records

EQUAL_MEMORY = ", PagedWeight's budget"  # suffix of the equal-memory rows' system name (as bench.serving names them)

OURS_ONLY = ("--skip-table", "--user-path", "--skip-dense16")  # flags the older serve_speed.py does not take
OURS_ONLY_VALUES = ("--label", "--compare-commit", "--compare-rounds", "--out", "--out-md", "--user-samples",
                    "--user-seq-len", "--user-requests", "--user-max-batch", "--user-gpu-memory", "--user-policy",
                    "--workdir")


def compare_commit(rev: str, argv: list[str], out: Path) -> None:
    """Run the serving benchmark of REV (a git revision, extracted with ``git archive``, or a directory holding
    that tree's pwrun, pwcal, kernels, bench and tests/fixtures/configs) with the decode-table options of ``argv``
    in a fresh process, and append its rows to ``out``: ``python -m bench.serving`` where the tree has it, else its
    ``bench/serve_speed.py``. Rows are labelled REV (a directory: its name without a leading dot); their commit is
    $COMPARE_COMMIT for a directory."""
    is_dir = Path(rev).is_dir()
    label = Path(rev).name.lstrip(".") if is_dir else rev
    with tempfile.TemporaryDirectory() as d:
        if is_dir:
            tree, commit = Path(rev).resolve(), os.environ.get("COMPARE_COMMIT", label)
        else:
            tree = Path(d) / "tree"
            tree.mkdir()
            archive = subprocess.run(["git", "archive", rev], check=True, capture_output=True).stdout
            subprocess.run(["tar", "x", "-C", str(tree)], input=archive, check=True)
            commit = subprocess.run(["git", "rev-parse", "--short", rev], check=True, capture_output=True,
                                    text=True).stdout.strip()
        env = {**os.environ, "PYTHONPATH": str(tree), "COMMIT": commit, "BENCH_BASELINE": "1"}
        argv = [a for a in _drop_options(argv, OURS_ONLY_VALUES) if a not in OURS_ONLY]
        if (tree / "bench" / "serving.py").is_file():
            subprocess.run([sys.executable, "-m", "bench.serving", *argv, "--label", label, "--out",
                            str(out.resolve())], cwd=tree, env=env, check=True)
            return
        md = Path(d) / "old.md"
        subprocess.run([sys.executable, "bench/serve_speed.py", *argv, "--out-md", str(md)], cwd=tree, env=env,
                       check=True)
        old = json.loads(md.with_suffix(".json").read_text())
        meta = old["meta"]
        envrec = {"commit": commit, "label": label, "baseline": True, "gpu": meta.get("gpu"),
                  "torch": meta.get("torch"), "triton": meta.get("triton"), "transformers": meta.get("transformers"),
                  "date": environment()["date"], "command": meta.get("command")}
        base = {"model": Path(meta.get("config", "")).name, "prompt_len": meta.get("prompt_len"),
                "gen": meta.get("gen"), "copy_bandwidth_TBps": meta.get("copy_bandwidth_TBps")}
        write_records("serving", ({**base, "rep": 0, **from_serve_speed(r)} for r in old["rows"]), envrec, out)


def from_serve_speed(row: dict[str, Any]) -> dict[str, Any]:
    """A row of the older ``bench/serve_speed.py`` as this suite records it: equal-memory rows named alike at every
    bitwidth (the bits in ``bits``), ``policy`` and ``bits`` set, fields named as the run summary names them now
    (``device_peak_bytes``, ``mean_bits``)."""
    r = {k: v for k, v in row.items() if k not in ("triton_first_uses_in_run", "triton_specializations_compiled_in_run",
                                                     "slowest_steps")}
    system = r["system"]
    if system.endswith(EQUAL_MEMORY) and "error" not in r:
        r |= {"system": f"uniform{EQUAL_MEMORY}", "policy": "uniform", "bits": int(system.split()[1].split("-")[0])}
    elif system.startswith("ours uniform") and "eager" not in system:
        r |= {"policy": "uniform", "bits": int(system.split()[2].split("-")[0])}
    elif system == "PagedWeight under pressure":
        r["policy"] = "pagedweight"
    for old, new in (("peak_device_bytes", "device_peak_bytes"), ("mean_bits_time_avg", "mean_bits")):
        if old in r:
            r[new] = r.pop(old)
    return r


def _drop_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the options ``names`` and their values (``--x v`` or ``--x=v``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif a.split("=", 1)[0] not in names:
            out.append(a)
    return out
