"""``pwrun generate --artifacts`` and ``pwrun eval`` on incomplete artifacts and their messages (the real tiny
MoE, CPU).

- An optional calibration table whose stage never ran: one warning line per table, naming the file,
  what serving loses and the ``pwcal`` command that makes it; a policy that does not read it: none.
  ``pwrun eval run`` gives the same lines as ``generate``; ``pwrun eval sweep`` (every policy) each once.
- The same table gone although the manifest records its stage complete: a one-line error (``--force``).
- Budget messages name the real dtype of the non-expert weights; ``pwrun serve``'s start-up line shows the
  budget's split.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import pweval.cli
from pweval.cli import app as eval_app
from pwformat.errors import PagedWeightError
from pwrun.cli import app

runner = CliRunner()


def _serve(artifacts: Path, *extra: str) -> tuple[int, str]:
    r = runner.invoke(app, ["generate", "--prompt", "The river", "--artifacts", str(artifacts), "--gpu-memory",
                            "64MiB", "--max-new-tokens", "3", "--device", "cpu", *extra])
    return r.exit_code, r.stderr


def _never_ran(calibrated_artifacts: Path, tmp_path: Path) -> Path:
    """A copy of the artifacts whose fit-residual and search-buckets stages never ran."""
    never_ran = tmp_path / "never_ran"
    shutil.copytree(calibrated_artifacts, never_ran)
    manifest = json.loads((never_ran / "manifest.json").read_text())
    for stage in ("fit-residual", "search-buckets"):
        del manifest["stages"][stage]
    (never_ran / "manifest.json").write_text(json.dumps(manifest))
    for name in ("residual_heads.parquet", "buckets.parquet"):
        (never_ran / name).unlink()
    return never_ran


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


def test_missing_optional_tables_warn_once_or_error(calibrated_artifacts: Path, tmp_path: Path) -> None:
    never_ran = _never_ran(calibrated_artifacts, tmp_path)
    code, err = _serve(never_ran, "--policy", "residual")  # the policy that serves the residual heads
    warnings = _warnings(err)
    assert code == 0 and len(warnings) == 2, err
    assert "no residual_heads.parquet" in warnings[0] and "`pwcal fit-residual " in warnings[0]
    assert "no buckets.parquet" in warnings[1] and "`pwcal search-buckets " in warnings[1]
    code, err = _serve(never_ran)  # the default serves without them: nothing to say about their absence
    assert code == 0 and _warnings(err) == warnings[1:], err
    code, err = _serve(never_ran, "--policy", "uniform", "--bits", "4")
    assert code == 0 and "warning:" not in err, err

    # quantize only: the calibration error alone (no advice to run a stage that needs sensitivity first), naming
    # the artifact's own model
    quantized = tmp_path / "quantized"
    shutil.copytree(never_ran, quantized)
    manifest = json.loads((quantized / "manifest.json").read_text())
    del manifest["stages"]["sensitivity"]
    (quantized / "manifest.json").write_text(json.dumps(manifest))
    for name in ("sensitivity.parquet", "routing.parquet"):
        (quantized / name).unlink(missing_ok=True)
    code, err = _serve(quantized)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "has no complete calibration tables" in lines[0], err
    # the stage that makes them, on this artifact (run-all would refuse it: made with other parameters)
    assert f"`pwcal sensitivity {manifest['model']['path']} --artifacts {quantized}`" in lines[0], err
    assert _serve(quantized, "--policy", "uniform", "--bits", "4")[0] == 0

    damaged = tmp_path / "damaged"
    shutil.copytree(calibrated_artifacts, damaged)
    (damaged / "buckets.parquet").unlink()
    code, err = _serve(damaged)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {damaged / 'buckets.parquet'} is missing")
    assert "search-buckets" in lines[0] and "--force" in lines[0]


def test_tables_of_an_incomplete_stage_warn_and_are_not_used(calibrated_artifacts: Path, tmp_path: Path) -> None:
    """sensitivity re-ran (or was interrupted): fit-residual and search-buckets are recorded incomplete, so their
    files are from an older run: one warning each, and serving goes on as without them."""
    from pwrun.ap.artifact import APArtifact
    from pwrun.engine.tables import read_table as _read

    stale = tmp_path / "stale"
    shutil.copytree(calibrated_artifacts, stale)
    manifest = json.loads((stale / "manifest.json").read_text())
    for stage in ("fit-residual", "search-buckets"):
        manifest["stages"][stage]["complete"] = False
        manifest["stages"][stage]["stale_because"] = "sensitivity was re-run"
    (stale / "manifest.json").write_text(json.dumps(manifest))
    code, err = _serve(stale, "--policy", "residual")
    warnings = _warnings(err)
    assert code == 0 and len(warnings) == 2, err
    assert "residual_heads.parquet" in warnings[0] and "out of date (sensitivity was re-run)" in warnings[0]
    assert "buckets.parquet" in warnings[1] and "`pwcal search-buckets " in warnings[1] and "--force" in warnings[1]
    art = APArtifact(stale)
    assert _read(art, "buckets") is None and _read(art, "residual_heads") is None
    assert _read(art, "sensitivity") is not None  # its own stage is complete
    assert _read(APArtifact(calibrated_artifacts), "buckets") is not None


def test_eval_warns_like_generate(calibrated_artifacts: Path, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    never_ran = _never_ran(calibrated_artifacts, tmp_path)
    _, err = _serve(never_ran, "--policy", "residual")
    expected = _warnings(err)
    assert len(expected) == 2, err

    def run(*args: str) -> tuple[int, str]:
        r = runner.invoke(eval_app, ["run", "--out", str(tmp_path / "r.parquet"), "--artifacts", str(never_ran),
                                "--requests", "1", "--prompt-tokens", "16", "--continuation-tokens", "2",
                                "--gpu-memory", "64MiB", *args])
        return r.exit_code, r.stderr

    code, err = run("--policy", "residual")
    assert code == 0 and _warnings(err) == expected, err
    code, err = run()
    assert code == 0 and _warnings(err) == expected[1:], err
    code, err = run("--policy", "uniform", "--bits", "4")
    assert code == 0 and not _warnings(err), err

    def stop(*_args: object, **_kwargs: object) -> None:
        raise PagedWeightError("stopped before serving")

    monkeypatch.setattr(pweval.cli, "run_sweep", stop)  # only the checks before the sweep run
    r = runner.invoke(eval_app, ["sweep", "--quick", "--out", str(tmp_path / "sweep"), "--artifacts",
                            str(never_ran)])
    # the sweep's policies together read both tables: each warning once (in the order its policies come)
    assert r.exit_code == 2 and sorted(_warnings(r.stderr)) == sorted(expected), r.stderr
    assert "stopped before serving" in r.stderr


def test_budget_messages_name_the_dtype_of_non_expert_weights(calibrated_artifacts: Path) -> None:
    code, err = _serve(calibrated_artifacts)
    assert code == 0 and "non-expert weights (fp32)" in err, err
    code, err = _serve(calibrated_artifacts, "--gpu-memory", "1MiB")
    assert code == 2 and "of non-expert weights (fp32)" in err and "16-bit" not in err, err


def test_a_trace_that_cannot_be_written_loses_no_result(calibrated_artifacts: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills while the trace is written: --output and --summary-json are still written, whole, and the
    run ends with one error line that says where the results are."""
    import pwrun.generate

    def full_disk(engine: object, path: Path) -> None:
        raise PagedWeightError(f"cannot write --trace {path}: No space left on device")

    monkeypatch.setattr(pwrun.generate, "write_trace", full_disk)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("The river", "In 1990", "A cat")))
    out, summary = tmp_path / "o.jsonl", tmp_path / "s.json"
    r = runner.invoke(app, ["generate", "--prompts", str(prompts), "--artifacts", str(calibrated_artifacts),
                            "--gpu-memory", "64MiB", "--max-new-tokens", "2", "--device", "cpu", "--output", str(out),
                            "--trace", str(tmp_path / "t.parquet"), "--summary-json", str(summary)])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and lines[-1].startswith("error: cannot write --trace") and str(out) in lines[-1], r.stderr
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == ["The river", "In 1990", "A cat"]
    assert json.loads(summary.read_text())["trace_error"].endswith("No space left on device")
    assert not (tmp_path / "t.parquet").exists()


def test_an_output_that_cannot_be_written_prints_the_results(calibrated_artifacts: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """--output on a full disk: the results go to stdout instead, --summary-json is still written, one error line."""
    import pwrun.cli

    real = pwrun.cli._write_file

    def full_disk(flag: str, path: Path, text: str) -> None:
        if flag == "--output":
            raise PagedWeightError(f"cannot write {flag} {path}: No space left on device")
        real(flag, path, text)

    monkeypatch.setattr(pwrun.cli, "_write_file", full_disk)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("The river", "A cat")))
    summary = tmp_path / "s.json"
    r = runner.invoke(app, ["generate", "--prompts", str(prompts), "--artifacts", str(calibrated_artifacts),
                            "--gpu-memory", "64MiB", "--max-new-tokens", "2", "--device", "cpu", "--output",
                            str(tmp_path / "o.jsonl"), "--summary-json", str(summary)])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and lines[-1].startswith("error: cannot write --output"), r.stderr
    assert lines[-1].endswith("No space left on device (the results are printed on stdout above)"), lines[-1]
    assert [json.loads(x)["prompt"] for x in r.stdout.splitlines() if x.startswith("{")] == ["The river", "A cat"]
    assert summary.is_file() and not (tmp_path / "o.jsonl").exists()


def test_serve_start_line_shows_the_budget_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pwrun serve`` under a budget says how it splits, as ``generate`` does (each budget its own numbers); the
    16-bit model without a budget says none; an empty --gpu-memory is refused, not served at the default."""
    from pwrun.serve.server import Server

    monkeypatch.setattr(Server, "run", lambda self: self.loop.stop(0.0))  # the start-up only
    base = ["serve", "--device", "cpu", "--port", "0", "--max-model-len", "128", "--max-batch", "2"]
    lines = {}
    for budget in ("96MiB", "128MiB"):
        r = runner.invoke(app, [*base, "--policy", "16-bit", "--gpu-memory", budget])
        assert r.exit_code == 0, r.stderr
        lines[budget] = next(x for x in r.stderr.splitlines() if x.startswith("serving "))
        assert re.search(rf"; budget {budget[:-3]}\.00 MiB = non-expert weights \(bf16\) [\d.]+ [KM]iB \+ workspace "
                         r"[\d.]+ [KM]iB \+ page pool [\d.]+ MiB$", lines[budget]), lines[budget]
    assert lines["96MiB"].split("page pool")[1] != lines["128MiB"].split("page pool")[1]
    r = runner.invoke(app, base)
    assert r.exit_code == 0, r.stderr
    assert "budget" not in next(x for x in r.stderr.splitlines() if x.startswith("serving ")), r.stderr
    r = runner.invoke(app, [*base, "--policy", "16-bit", "--gpu-memory", ""])  # not the 4 GiB default
    assert r.exit_code == 2 and r.stderr.strip().splitlines() == [
        "error: --gpu-memory is empty: give a size, e.g. 10GiB or 512MiB, or leave the option out for the default "
        "4GiB"], r.stderr
