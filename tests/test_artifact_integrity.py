"""Artifacts that cannot lie: every fault class of a hostile trial, through the command line, ends in exit code 2
and one ``error:`` line naming the bad file or field and the fix (never a traceback, never silently served).

Classes: bytes flipped inside a Parquet table (footer intact) and inside a layer file's bit-planes (header intact),
layers swapped in the manifest's file map or on disk, a table from another quantize run or another model, manifest
fields of the wrong type or value, a second writer while a stage writes, NaN weights, absurd sampling options and
budgets, and the leftovers of a quantize run killed between its final renames.

The two artifacts of the module come from ``tests._artifacts.make_artifact`` (the real stages, a fast k-means).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file, save_file

from pwcal.cli import app as pwcal_app
from pwformat.checksums import file_digest
from pwformat.manifest import read_manifest
from pwformat.tables import PROVENANCE_KEY, SCHEMAS, write_table
from pwrun.cli import app as pwrun_app
from pwrun.core.request import SamplingParams
from tests._artifacts import MODEL, QUANT, SERVE, edit_manifest, flip, make_artifact, one_error, runner, serve


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two artifacts of the bundled model from two quantize runs (calibration seeds 0 and 1)."""
    root = tmp_path_factory.mktemp("integrity")
    return make_artifact(root / "a", 0), make_artifact(root / "b", 1)


@pytest.fixture
def art(artifacts: tuple[Path, Path], tmp_path: Path) -> Path:
    """A fresh copy of the first artifact to damage."""
    return Path(shutil.copytree(artifacts[0], tmp_path / "ap"))


def test_artifact_files_get_the_permissions_of_any_new_file(artifacts: tuple[Path, Path]) -> None:
    """Every file as ``open`` would create it (safetensors' writer alone makes layer files private: 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    modes = {f.name: f.stat().st_mode & 0o777 for f in artifacts[0].iterdir()}
    assert any(n.startswith("layer_") for n in modes)
    assert modes == dict.fromkeys(modes, 0o666 & ~mask)


def test_intact_artifact_verifies_and_serves(art: Path) -> None:
    r = runner.invoke(pwcal_app, ["verify", str(art)])
    assert r.exit_code == 0 and "every file matches" in r.stderr, r.stderr
    for policy in (["--policy", "uniform", "--bits", "4"], []):
        r = serve(art, *policy)
        assert r.exit_code == 0, r.stderr
        assert "above their 16-bit bytes" not in r.stderr
    # a budget that holds every block at 8 bits: planes + 256-entry LUTs of these 256-wide rows exceed 16 bits
    r = serve(art, "--policy", "uniform", "--bits", "8", "--gpu-memory", "1GiB")
    assert r.exit_code == 0 and "% of their 16-bit" in r.stderr and "above their 16-bit bytes" in r.stderr, r.stderr


def test_bytes_flipped_inside_a_parquet_table_are_refused(art: Path) -> None:
    table = art / "sensitivity.parquet"
    assert table.read_bytes()[-4:] == b"PAR1"
    flip(table, 64)  # inside the first column chunk; the footer is untouched
    assert table.read_bytes()[-4:] == b"PAR1"
    fix = f"pwcal sensitivity {MODEL} --artifacts {art} --force"
    one_error(serve(art), "sensitivity.parquet", "corrupt", fix)
    one_error(serve(art, "--no-verify"), "sensitivity.parquet", "corrupt", fix)  # checked as it is read
    r = runner.invoke(pwcal_app, ["verify", str(art)])
    one_error(r, "sensitivity.parquet", fix)


def test_bytes_flipped_inside_bit_planes_are_refused(art: Path) -> None:
    layer = art / "layer_001.safetensors"
    header = 8 + int.from_bytes(layer.read_bytes()[:8], "little")
    flip(layer, header + 4096)
    fix = f"pwcal quantize {MODEL} --out {art} --force"
    for cmd in (serve(art, "--policy", "uniform", "--bits", "4"),
                runner.invoke(pwrun_app, ["ppl", "--artifacts", str(art), "--uniform-bits", "4", "--max-windows", "1",
                                          "--seq-len", "64", "--device", "cpu"]),
                runner.invoke(pwcal_app, ["verify", str(art)]),
                runner.invoke(pwcal_app, ["fit-residual", str(MODEL), "--artifacts", str(art), "--device", "cpu"])):
        one_error(cmd, "layer_001.safetensors", "corrupt", fix)


def test_a_truncated_file_is_refused_even_without_verification(art: Path) -> None:
    layer = art / "layer_002.safetensors"
    layer.write_bytes(layer.read_bytes()[:-100])
    one_error(serve(art, "--no-verify", "--policy", "uniform", "--bits", "4"), "layer_002.safetensors", "bytes")


def test_swapped_layers_are_refused(art: Path) -> None:
    def swap(m: dict[str, Any]) -> None:
        m["files"]["0"], m["files"]["1"] = m["files"]["1"], m["files"]["0"]

    edit_manifest(art, swap)
    one_error(serve(art, "--no-verify"), "field 'files.0'", "swaps layers")
    edit_manifest(art, swap)
    # the files themselves swapped on disk: the checksums catch it, and unverified, the layer id in each header
    (art / "layer_000.safetensors").rename(art / "tmp")
    (art / "layer_001.safetensors").rename(art / "layer_000.safetensors")
    (art / "tmp").rename(art / "layer_001.safetensors")
    one_error(serve(art, "--policy", "uniform", "--bits", "4"), "layer_000.safetensors", "corrupt")
    one_error(serve(art, "--no-verify", "--policy", "uniform", "--bits", "4"), "layer_000.safetensors",
              "holds layer 1", "not layer 0")


def test_a_table_from_another_run_or_model_is_refused(art: Path, artifacts: tuple[Path, Path]) -> None:
    shutil.copy(artifacts[1] / "sensitivity.parquet", art / "sensitivity.parquet")
    fix = f"pwcal sensitivity {MODEL} --artifacts {art} --force"
    one_error(serve(art), "sensitivity.parquet", fix)
    one_error(serve(art, "--no-verify"), "sensitivity.parquet", fix)
    # a hostile copy whose checksum was written into the manifest too: the table's provenance still tells
    digest = file_digest(art / "sensitivity.parquet")
    size = (art / "sensitivity.parquet").stat().st_size

    def record(m: dict[str, Any]) -> None:
        m["checksums"]["sensitivity.parquet"].update(xxh3_128=digest, size=size)

    edit_manifest(art, record)
    one_error(serve(art), "sensitivity.parquet", "another quantize run", fix)
    # the same table relabelled as this run's but another model's
    table = pq.read_table(artifacts[0] / "sensitivity.parquet")
    prov = json.loads(table.schema.metadata[PROVENANCE_KEY])
    prov["model"] = "0123456789abcdef"
    pq.write_table(table.replace_schema_metadata({PROVENANCE_KEY: json.dumps(prov).encode()}),
                   art / "sensitivity.parquet")
    digest, size = file_digest(art / "sensitivity.parquet"), (art / "sensitivity.parquet").stat().st_size
    edit_manifest(art, record)
    one_error(serve(art), "sensitivity.parquet", "another model", fix)
    one_error(runner.invoke(pwcal_app, ["verify", str(art)]), "another model", fix)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("bits", [3, 4, 5, 6, 7, 8, 9], "every bitwidth from seed_bits to parent_bits"),
    ("seed_bits", "3", "field 'seed_bits' is str '3', not int"),
    ("seed_bits", 5, "field 'seed_bits' is 5, not 2 or 3"),
    ("parent_bits", 7.5, "field 'parent_bits' is float"),
    ("files", {"zero": "layer_000.safetensors"}, "field 'files.zero'"),
    ("files", {"0": "../../etc/passwd"}, "a file name inside the artifact directory"),
    ("files", {}, "field 'files.0' is None, not layer_000.safetensors (the checksum record of that file says it holds "
     "layer 0)"),
    ("checksums", {"layer_000.safetensors": {"size": -1, "xxh3_128": "0" * 32, "stage": "quantize"}},
     "field 'checksums.layer_000.safetensors.size' is -1"),
    ("checksums", {"layer_000.safetensors": {"size": 1, "xxh3_128": "xyz", "stage": "quantize"}},
     "32 lower-case hex digits"),
    ("stages", {"quantize": {"complete": "yes"}}, "field 'stages.quantize.complete' is str"),
    ("run_id", 7, "field 'run_id' is int"),
    ("checksums", None, "field 'checksums' is missing (schema 2 records them)"),
    ("schema_version", 9, "manifest schema 9, newer than the 2 this version reads"),
])
def test_bad_manifest_fields_are_named(art: Path, field: str, value: Any, message: str) -> None:
    edit_manifest(art, lambda m: m.__setitem__(field, value))
    one_error(serve(art), "manifest.json", message)


def test_unknown_schema_names_the_version_that_reads_it(art: Path) -> None:
    edit_manifest(art, lambda m: m.update(schema_version=3, package_version="9.1.0"))
    one_error(runner.invoke(pwcal_app, ["verify", str(art)]), "schema 3", "pagedweight 9.1.0 or later")


def test_an_artifact_from_before_checksums_warns_and_can_be_updated(art: Path) -> None:
    def old(m: dict[str, Any]) -> None:
        for k in ("checksums", "run_id"):
            del m[k]
        m["schema_version"] = 1

    edit_manifest(art, old)
    r = serve(art, "--policy", "uniform", "--bits", "4")
    warn = [x for x in r.stderr.splitlines() if "checksums" in x]
    assert r.exit_code == 0 and len(warn) == 1 and f"pwcal verify {art} --update" in warn[0], r.stderr
    one_error(runner.invoke(pwcal_app, ["verify", str(art)]), "no content checksums", "--update")
    r = runner.invoke(pwcal_app, ["verify", str(art), "--update"])
    assert r.exit_code == 0 and "recorded the checksums of 7 files" in r.stderr, r.stderr
    assert runner.invoke(pwcal_app, ["verify", str(art)]).exit_code == 0
    r = serve(art, "--policy", "uniform", "--bits", "4")
    assert r.exit_code == 0 and "checksums" not in r.stderr, r.stderr


def test_a_second_writer_and_readers_are_refused_while_a_stage_writes(art: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from pwformat.writer_lock import "
         "writer_lock\nwith writer_lock(Path(sys.argv[1])):\n print('locked', flush=True); time.sleep(60)", str(art)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        before = {p.name: p.stat().st_mtime_ns for p in art.iterdir()}
        pid = f"process {holder.pid}"
        one_error(runner.invoke(pwcal_app, ["sensitivity", str(MODEL), "--artifacts", str(art), "--force", *QUANT]),
                  "is writing", pid)
        one_error(runner.invoke(pwcal_app, ["quantize", str(MODEL), "--out", str(art), "--force", *QUANT]),
                  "is writing", pid)
        one_error(serve(art), "is writing", pid)
        one_error(runner.invoke(pwcal_app, ["verify", str(art)]), "is writing", pid)
        assert {p.name: p.stat().st_mtime_ns for p in art.iterdir()} == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    r = runner.invoke(pwcal_app, ["verify", str(art)])  # a dead holder's lock is free: the kernel dropped it
    assert r.exit_code == 0, r.stderr


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path: Path) -> None:
    bad = Path(shutil.copytree(MODEL, tmp_path / "bad"))
    shard, name = next((f, k) for f in sorted(bad.glob("*.safetensors")) for k in sorted(load_file(f))
                       if "layers.1.self_attn.q_proj.weight" in k)
    tensors = load_file(shard)
    tensors[name][3, 5] = float("inf")
    save_file(tensors, shard, metadata={"format": "pt"})
    one_error(runner.invoke(pwrun_app, ["generate", "--prompt", "x", "--model", str(bad), "--device", "cpu"]),
              name, "NaN or Inf")
    one_error(runner.invoke(pwcal_app, ["quantize", str(bad), "--out", str(tmp_path / "o"), *QUANT]), name)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args", [["--temperature", "1e-300"], ["--temperature", "nan"], ["--temperature", "1e9"],
                                  ["--top-p", "inf"]])
def test_absurd_sampling_options_are_refused(args: list[str]) -> None:
    one_error(runner.invoke(pwrun_app, ["generate", "--prompt", "x", "--device", "cpu", *args]), args[0])


def test_sampling_params_refuse_what_the_sampler_cannot_do() -> None:
    for t in (1e-300, float("inf"), float("nan"), -1.0, 1e9):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=t)
    assert SamplingParams(temperature=0.001).temperature == 0.001


def test_a_budget_beyond_the_device_is_refused_before_allocating(art: Path) -> None:
    t0 = time.perf_counter()
    r = runner.invoke(pwrun_app, [*SERVE[:-2], "--gpu-memory", "500TiB", "--artifacts", str(art), "--policy",
                                  "uniform", "--bits", "4"])
    one_error(r, "--gpu-memory 500", "more than cpu has", "give at most")
    assert time.perf_counter() - t0 < 60


def test_leftovers_of_a_killed_quantize_are_recovered_or_removed(artifacts: tuple[Path, Path], tmp_path: Path
                                                                 ) -> None:
    out = tmp_path / "ap"
    partial, old = tmp_path / "ap.partial", tmp_path / "ap.old"
    # killed between its renames: OUT moved to OUT.old, the complete OUT.partial not yet renamed
    shutil.copytree(artifacts[1], partial)
    shutil.copytree(artifacts[0], old)
    one_error(serve(out), f"{out} has no manifest.json, but ap.old and ap.partial lie beside it",
              f"run `pwcal quantize MODEL --out {out}` again")
    r = runner.invoke(pwcal_app, ["quantize", str(MODEL), "--out", str(out), *QUANT, "--calib-seed", "1"])
    assert r.exit_code == 0, r.stderr
    notes = [x for x in r.stderr.splitlines() if str(out) in x and "ap." in x]
    assert len(notes) == 2 and "finished a previous run" in notes[0] and "removed ap.old" in notes[1], r.stderr
    assert "already quantized" in r.stderr and not partial.exists() and not old.exists()
    assert json.loads((out / "manifest.json").read_text())["run_id"] == json.loads(
        (artifacts[1] / "manifest.json").read_text())["run_id"]
    # killed before the new artifact was complete: the previous one comes back, the partial one goes
    out.rename(old)
    partial.mkdir()
    (partial / "layer_000.safetensors").write_bytes(b"half")
    r = runner.invoke(pwcal_app, ["quantize", str(MODEL), "--out", str(out), *QUANT, "--calib-seed", "1"])
    assert r.exit_code == 0 and "restored the previous artifact" in r.stderr and "removed ap.partial" in r.stderr
    assert not partial.exists() and not old.exists() and runner.invoke(pwcal_app, ["verify", str(out)]).exit_code == 0


def test_tables_record_their_provenance(artifacts: tuple[Path, Path]) -> None:
    a, b = (json.loads((x / "manifest.json").read_text()) for x in artifacts)
    assert a["run_id"] != b["run_id"]
    for x, m in zip(artifacts, (a, b), strict=True):
        prov = json.loads(pq.read_schema(x / "routing.parquet").metadata[PROVENANCE_KEY])
        assert prov["run"] == m["run_id"]
        assert isinstance(pd.read_parquet(x / "routing.parquet"), pd.DataFrame)


def test_verifying_a_large_artifact_shows_progress(art: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pwrun.cli_common

    monkeypatch.setattr(pwrun.cli_common, "LARGE_ARTIFACT", 0)
    r = serve(art, "--policy", "uniform", "--bits", "4")
    total = sum(p.stat().st_size for p in art.iterdir() if p.name != "manifest.json") / 2**20
    assert r.exit_code == 0 and f"verifying {art}, MiB: {total:.1f}/{total:.1f}" in r.stderr, r.stderr


@pytest.mark.parametrize(("text", "message"), [
    ('{"format_version": 1' + "0" * 5000 + "}", "manifest.json is corrupt (ValueError"),  # json's 4,300-digit limit
    ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "manifest.json is corrupt (RecursionError"),
    ('{"format": "x\x01"}', "manifest.json is corrupt (Invalid control character at line 1 column"),
])
def test_a_manifest_json_cannot_parse_is_one_line(art: Path, text: str, message: str) -> None:
    (art / "manifest.json").write_text(text)
    one_error(runner.invoke(pwcal_app, ["verify", str(art)]), message)
    one_error(serve(art), message, f"re-run `pwcal quantize MODEL --out {art} --force`")  # the artifact named


def test_manifest_that_is_not_a_file_or_of_another_format(art: Path) -> None:
    edit_manifest(art, lambda m: m.update(format="pagedweight-xx"))
    one_error(runner.invoke(pwcal_app, ["verify", str(art)]), "field 'format' is 'pagedweight-xx'")
    (art / "manifest.json").unlink()
    (art / "manifest.json").mkdir()
    one_error(serve(art), "manifest.json is not a regular file")


def test_a_fifo_in_place_of_the_lock_file_is_named_not_waited_on(art: Path) -> None:
    lock = art.with_name(art.name + ".lock")
    os.mkfifo(lock)
    try:
        for r in (runner.invoke(pwcal_app, ["verify", str(art)]), serve(art),
                  runner.invoke(pwcal_app, ["sensitivity", str(MODEL), "--artifacts", str(art), "--force"])):
            one_error(r, f"{lock} is not a regular file: remove it")
    finally:
        lock.unlink()


def test_a_table_no_stage_recorded_is_ignored_and_reported(art: Path) -> None:
    """A residual_heads table copied in (this artifact's own provenance, so only the manifest can tell): the
    runtime warns and serves without it, as before it was there; verify names it (the policy that reads it)."""
    before = serve(art, "--policy", "residual")
    assert before.exit_code == 0 and "has no residual_heads.parquet" in before.stderr, before.stderr
    prov = read_manifest(art).provenance()
    write_table(pd.DataFrame({c: [] for c in SCHEMAS["residual_heads"].names}), art / "residual_heads.parquet",
                "residual_heads", prov)
    after = serve(art, "--policy", "residual")
    assert after.exit_code == 0 and "residual_heads.parquet" in after.stderr, after.stderr
    assert "the manifest records no 'fit-residual' run that wrote it" in after.stderr
    assert after.stdout == before.stdout
    r = runner.invoke(pwcal_app, ["verify", str(art)])
    assert r.exit_code != 0 and "residual_heads.parquet is not recorded in the manifest" in r.stderr, r.stderr


@pytest.mark.parametrize("raw", [b"not json{", b'"abc"', b"[1, 2]", b"null"])
def test_unreadable_provenance_metadata_is_one_line(art: Path, raw: bytes) -> None:
    path = art / "sensitivity.parquet"
    pq.write_table(pq.read_table(path).replace_schema_metadata({PROVENANCE_KEY: raw}), path)
    digest, size = file_digest(path), path.stat().st_size  # recorded too: only the metadata can tell
    edit_manifest(art, lambda m: m["checksums"]["sensitivity.parquet"].update(xxh3_128=digest, size=size))
    one_error(serve(art), "sensitivity.parquet has unreadable provenance metadata")


def test_the_stage_named_to_fix_its_own_damaged_table_can_run(art: Path) -> None:
    """A truncated sensitivity table names `pwcal sensitivity --force`, and that command remakes it (it does not
    check the outputs it is about to rewrite)."""
    path = art / "sensitivity.parquet"
    path.write_bytes(path.read_bytes()[:100])
    one_error(serve(art), "sensitivity.parquet", f"pwcal sensitivity {MODEL} --artifacts {art} --force")
    r = runner.invoke(pwcal_app, ["sensitivity", str(MODEL), "--artifacts", str(art), "--force", "--samples", "2",
                                  "--seq-len", "64", "--min-tokens", "1", "--device", "cpu"])
    assert r.exit_code == 0, r.stderr
    assert serve(art).exit_code == 0


@pytest.mark.parametrize(("value", "message"), [
    ("abc", "stages.sensitivity.config.seq_len is 'abc', not int"),
    (None, "stages.sensitivity.config.seq_len is missing"),
    (1, "stages.sensitivity.config is not valid (--samples 2 must be >= 1 and --seq-len 1 >= 2)"),
])
def test_a_bad_recorded_stage_config_is_named(art: Path, value: Any, message: str) -> None:
    def change(m: dict[str, Any]) -> None:
        cfg = m["stages"]["sensitivity"]["config"]
        if value is None:
            del cfg["seq_len"]
        else:
            cfg["seq_len"] = value

    edit_manifest(art, change)
    r = runner.invoke(pwcal_app, ["fit-residual", str(MODEL), "--artifacts", str(art), "--prompts", "2", "--device",
                                  "cpu"])
    one_error(r, message, f"pwcal sensitivity MODEL --artifacts {art} --force")


def test_a_checkpoint_edited_where_the_fingerprint_does_not_sample_is_refused(art: Path, tmp_path: Path) -> None:
    """Two thousand sign flips a quarter into one attention weight: the sampled fingerprint (start, middle, end of
    each tensor) cannot see them, the digest of every weight serving reads does."""
    model = tmp_path / "m"
    shutil.copytree(MODEL, model)
    name = "model.layers.0.self_attn.o_proj.weight"
    shard = next(f for f in sorted(model.glob("*.safetensors")) if name.encode() in f.read_bytes()[:100_000])
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8:8 + n])[name]["data_offsets"]
    at = 8 + n + start + (end - start) // 4
    for i in range(at + 1, at + 4000, 2):  # the high byte of each bf16 value: its sign bit
        data[i] ^= 0x80
    shard.write_bytes(bytes(data))
    assert read_manifest(art).model.weights_served
    one_error(runner.invoke(pwrun_app, [*SERVE, "--artifacts", str(art), "--model", str(model)]),
              f"the weights in {model} differ from those artifact {art} was made from")
    assert serve(art).exit_code == 0  # the checkpoint it was made from


def test_a_directory_for_a_table_and_a_checksum_without_its_layer_are_named(art: Path) -> None:
    (art / "routing.parquet").unlink()
    (art / "routing.parquet").mkdir()
    one_error(serve(art, "--no-verify"), "routing.parquet is not a regular file")
    (art / "routing.parquet").rmdir()
    edit_manifest(art, lambda m: m["checksums"]["layer_000.safetensors"].update(layer=None))
    one_error(serve(art), "field 'checksums.layer_000.safetensors.layer' is None, not 0")


def test_a_stage_that_skips_as_complete_checks_its_own_files(art: Path) -> None:
    """A complete stage rerun with its parameters skips only if the files it vouches for are intact: its own tables
    (nothing later reads them) and, for quantize, the layer files; else the one-line error that remakes them."""
    sens = ["sensitivity", str(MODEL), "--artifacts", str(art), "--samples", "2", "--seq-len", "64", "--min-tokens",
            "1", "--device", "cpu"]
    r = runner.invoke(pwcal_app, sens)
    assert r.exit_code == 0 and "nothing to do" in r.stderr, r.stderr
    flip(art / "sensitivity.parquet", 200)
    one_error(runner.invoke(pwcal_app, sens), "sensitivity.parquet is corrupt",
              f"pwcal sensitivity {MODEL} --artifacts {art} --force")
    quant = ["quantize", str(MODEL), "--out", str(art), *QUANT]
    path = art / "layer_001.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    one_error(runner.invoke(pwcal_app, quant), "layer_001.safetensors has",
              f"pwcal quantize {MODEL} --out {art} --force")


def test_a_checksum_record_names_a_known_stage(art: Path) -> None:
    """The stage a checksum record names is pasted into the remake command: anything else is a corrupt manifest."""
    edit_manifest(art, lambda m: m["checksums"]["layer_000.safetensors"].update(stage="rm -rf ~; echo"))
    one_error(runner.invoke(pwcal_app, ["verify", str(art)]), "checksums.layer_000.safetensors.stage",
              "one of quantize, sensitivity, fit-residual, search-buckets")


def test_an_artifact_given_as_the_model_is_named(art: Path) -> None:
    one_error(runner.invoke(pwcal_app, ["inspect", str(art)]), "has no config.json",
              "it is a PagedWeight artifact: pass it as --artifacts")
