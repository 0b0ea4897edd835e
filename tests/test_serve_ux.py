"""``pwrun generate --artifacts`` on incomplete artifacts and its messages (the real tiny MoE, CPU).

- An optional calibration table whose stage never ran: one warning line per table, naming the file,
  what serving loses and the ``pwcal`` command that makes it; a policy that does not read it: none.
- The same table gone although the manifest records its stage complete: a one-line error (``--force``).
- Budget messages name the real dtype of the non-expert weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from pwrun.cli import app

runner = CliRunner()


def _serve(artifacts: Path, *extra: str) -> tuple[int, str]:
    r = runner.invoke(app, ["generate", "--prompt", "The river", "--artifacts", str(artifacts), "--gpu-memory",
                            "64MiB", "--max-new-tokens", "3", "--device", "cpu", *extra])
    return r.exit_code, r.stderr


def test_missing_optional_tables_warn_once_or_error(calibrated_artifacts: Path, tmp_path: Path) -> None:
    never_ran = tmp_path / "never_ran"
    shutil.copytree(calibrated_artifacts, never_ran)
    manifest = json.loads((never_ran / "manifest.json").read_text())
    for stage in ("fit-residual", "search-buckets"):
        del manifest["stages"][stage]
    (never_ran / "manifest.json").write_text(json.dumps(manifest))
    for name in ("residual_heads.parquet", "buckets.parquet"):
        (never_ran / name).unlink()
    code, err = _serve(never_ran)
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert code == 0 and len(warnings) == 2, err
    assert "no residual_heads.parquet" in warnings[0] and "`pwcal fit-residual " in warnings[0]
    assert "no buckets.parquet" in warnings[1] and "`pwcal search-buckets " in warnings[1]
    code, err = _serve(never_ran, "--policy", "no-residual")
    assert code == 0 and [w for w in err.splitlines() if w.startswith("warning:")] == warnings[1:], err
    code, err = _serve(never_ran, "--policy", "uniform", "--bits", "4")
    assert code == 0 and "warning:" not in err, err

    damaged = tmp_path / "damaged"
    shutil.copytree(calibrated_artifacts, damaged)
    (damaged / "buckets.parquet").unlink()
    code, err = _serve(damaged)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {damaged / 'buckets.parquet'} is missing")
    assert "search-buckets" in lines[0] and "--force" in lines[0]


def test_budget_messages_name_the_dtype_of_non_expert_weights(calibrated_artifacts: Path) -> None:
    code, err = _serve(calibrated_artifacts)
    assert code == 0 and "non-expert weights (fp32)" in err, err
    code, err = _serve(calibrated_artifacts, "--gpu-memory", "1MiB")
    assert code == 2 and "of non-expert weights (fp32)" in err and "16-bit" not in err, err
