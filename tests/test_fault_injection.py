"""Fault injection: bytes flipped at seeded random offsets of every kind of artifact file, every manifest field
set to wrong-typed or out-of-range values, and SIGKILL at every write point of ``pwcal quantize`` and ``pwcal
sensitivity``. Every case ends in exit code 2 with exactly one ``error:`` line (no traceback), or in output identical
to the intact artifact's; never a hang or a silently different result.

The artifacts come from ``tests._artifacts.make_artifact``; a killed stage runs in ``tests._fault_child``, a
fresh interpreter that ``pwformat.atomic.fault_point`` kills at its N-th write point (``PAGEDWEIGHT_FAULT_AT=N``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import Result

import pwcal.quant.quantize as quantize_module
import pwformat.atomic as atomic
from pwcal.cli import app as pwcal_app
from pwformat.checksums import file_digest
from tests._artifacts import (
    MODEL,
    QUANT,
    make_artifact,
    one_error,
    runner,
    serve,
    uniform_nested,
)

UNIFORM = ("--policy", "uniform", "--bits", "4")
OFFSETS = 3  # seeded random offsets per file kind
VALUES = 1  # seeded wrong values per manifest field
KIND_FILES = {  # kind -> (a file of that kind, region of its bytes)
    "layer-header": ("layer_001.safetensors", "header"),
    "layer-data": ("layer_002.safetensors", "data"),
    "sensitivity-table": ("sensitivity.parquet", "all"),
    "routing-table": ("routing.parquet", "all"),
    "block-features-table": ("block_features.parquet", "all"),
    "manifest": ("manifest.json", "all"),
}
QUANTIZE_POINTS = 8  # 4 layer files, the manifest, OUT -> OUT.old, OUT.partial -> OUT, removing OUT.old
SENSITIVITY_POINTS = 5  # the manifest marked stale, three tables, the manifest marked complete
ROOT = Path(__file__).resolve().parents[1]
WRONG = [None, "x", -1, 2**63, 1.5, float("nan"), True, [], {}, [1, "a"], {"k": 1}, "../x", ""]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("faults") / "base", 0)


@pytest.fixture(scope="module")
def clean(base: Path) -> dict[str, str]:
    """The intact artifact's generated text under the default policy and a uniform one (and `pwcal verify`)."""
    assert runner.invoke(pwcal_app, ["verify", str(base)]).exit_code == 0
    out = {}
    for name, extra in (("default", ()), ("uniform", UNIFORM)):
        r = serve(base, *extra)
        assert r.exit_code == 0 and r.stdout.strip(), r.stderr
        out[name] = r.stdout
    return out


@pytest.fixture(scope="module")
def work(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One copy of the artifact that the corruption and fuzzing cases damage and restore."""
    return Path(shutil.copytree(base, tmp_path_factory.mktemp("work") / "ap"))


def error_or_same(r: Result, expected: str, *needles: str) -> str:
    """'error' if ``r`` failed with one error line containing the needles, 'same' if it printed ``expected``."""
    if r.exit_code == 0:
        assert r.stdout == expected, ("silently different output", r.stdout, expected, r.stderr)
        return "same"
    one_error(r, *needles)
    return "error"


def region(path: Path, which: str) -> tuple[int, int]:
    size = path.stat().st_size
    if which == "all":
        return 0, size
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    return (0, header) if which == "header" else (header, size)


def test_every_file_kind_is_covered(base: Path) -> None:
    names = {p.name for p in base.iterdir()}
    covered = {f for f, _ in KIND_FILES.values()}
    kinds = {n if not n.startswith("layer_") else "layer" for n in names}
    assert kinds == {n if not n.startswith("layer_") else "layer" for n in covered}, names


@pytest.mark.parametrize("i", range(OFFSETS))
@pytest.mark.parametrize("kind", list(KIND_FILES))
def test_flipped_byte_is_refused_or_unused(kind: str, i: int, work: Path, clean: dict[str, str]) -> None:
    name, which = KIND_FILES[kind]
    path = work / name
    rng = random.Random(f"{kind}-{i}")
    offset, mask = rng.randrange(*region(path, which)), rng.randrange(1, 256)
    intact = file_digest(path)
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))
    try:
        needle = () if kind == "manifest" else (name,)
        verified = error_or_same(serve(work), clean["default"], *needle)
        if kind != "manifest":  # the checksum differs: verification always refuses it
            assert verified == "error"
            one_error(runner.invoke(pwcal_app, ["verify", str(work)]), name, "corrupt")
        if kind != "layer-data":  # headers, tables and the manifest are checked as they are read
            error_or_same(serve(work, "--no-verify"), clean["default"], *needle)
            error_or_same(serve(work, "--no-verify", *UNIFORM), clean["uniform"], *needle)
    finally:
        data[offset] ^= mask
        path.write_bytes(bytes(data))
    assert file_digest(path) == intact


@pytest.mark.parametrize(("old", "new", "message"), [
    (b'"7.gate_up.planes"', b'"7.gate_up.planez"', "has no tensor '7.gate_up.planes'"),
    (b'"4.gate_up.lut4"', b'"4.gate_up.lut\x7f"', "has no tensor '4.gate_up.lut4'"),
    (b'"dtype":"I32"', b'"dtype":"F32"', "is torch.float32, not torch.int32"),
    (b'"dtype":"F16"', b'"dtype":"I16"', "is torch.int16, not torch.float16"),
    (b'"shape":[8,256,8]', b'"shape":[8,512,4]', "has shape [256, 8], not [512, 8]"),  # same bytes, other shape
    (b'"shape":[8,256,8]', b'"shape":[8,8,256]', "has shape [256, 8], not [8, 8]"),
])
def test_a_header_naming_another_tensor_or_dtype_is_refused_unverified(old: bytes, new: bytes, message: str,
                                                                       work: Path) -> None:
    """Edits of a layer header that keep it valid JSON and the file's size: unverified, the reader still refuses
    them (names, dtypes, and shapes whose planes and LUTs disagree)."""
    path = work / "layer_001.safetensors"
    data = path.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    at = data.index(old, 0, header)
    try:
        path.write_bytes(data[:at] + new + data[at + len(old):])
        one_error(serve(work, "--no-verify", *UNIFORM), "layer_001.safetensors", message)
    finally:
        path.write_bytes(data)


def fields(node: Any, at: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every key path of a JSON object (a list is one field)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield (*at, k)
            yield from fields(v, (*at, k))


def set_field(m: dict[str, Any], at: tuple[str, ...], value: Any) -> None:
    for k in at[:-1]:
        m = m[k]
    m[at[-1]] = value


def names_field(line: str, at: tuple[str, ...], value: Any) -> bool:
    """Whether an error line names the manifest field ``at`` or what it governs: the field itself, the file whose
    checksum it records, the model it fingerprints, or its version."""
    return ("manifest.json" in line or f"'{'.'.join(at)}'" in line or at[-1] in line
            or (at[0] == "checksums" and at[1] in line)
            or (at[0] == "model" and "another model" in line) or f"v{value}" in line)


def is_stage_config(at: tuple[str, ...]) -> bool:
    """A parameter recorded in a stage's ``config`` (``stages.<stage>.config.<name>``): read by the pwcal stage's
    skip check, by no loader."""
    return len(at) == 4 and at[0] == "stages" and at[2] == "config"


def test_every_manifest_field_with_wrong_values(work: Path, clean: dict[str, str]) -> None:
    """Each field set to a seeded wrong value, one at a time (the stage config parameters all at once: no loader
    reads them, and one generation shows it)."""
    path = work / "manifest.json"
    text = path.read_text()
    paths = list(fields(json.loads(text)))
    configs = [at for at in paths if is_stage_config(at)]
    cases = [[(at, v)] for at in paths if not is_stage_config(at)
             for v in random.Random(".".join(at)).sample(WRONG, VALUES)]
    cases.append([(at, random.Random(".".join(at)).choice(WRONG)) for at in configs])
    outcomes = {"error": 0, "same": 0}
    try:
        for case in cases:
            m = json.loads(text)
            for at, value in case:
                set_field(m, at, value)
            path.write_text(json.dumps(m))
            at, value = case[0]
            r = serve(work)
            if r.exit_code != 0:
                assert len(case) == 1 and names_field(one_error(r), at, value), (case, r.stderr)
            outcomes[error_or_same(r, clean["default"])] += 1
            v = runner.invoke(pwcal_app, ["verify", str(work)])  # one line per file the field affects
            errors = [x for x in v.stderr.splitlines() if x.startswith("error:")]
            assert v.exit_code in (0, 2) and "Traceback" not in v.output + v.stderr, v.stderr
            assert all(names_field(x, at, value) for x in errors) and bool(errors) == (v.exit_code == 2)
    finally:
        path.write_text(text)
    assert len(paths) > 80 and len(configs) > 10 and outcomes["error"] > len(cases) // 2, (len(paths), outcomes)


def run_killed(stage: str, ap: Path, at: int, timeout: float = 300) -> int:
    """Run ``stage`` of ``tests._fault_child`` on ``ap`` in a fresh interpreter that ``fault_point`` kills at its
    ``at``-th write point; the child's signal (SIGKILL) or, if it finished, its exit code + 1000 (0: done)."""
    env = {**os.environ, atomic.FAULT_ENV: str(at), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, "-m", "tests._fault_child", stage, str(ap)], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the stage hung at write point {at}")
    if done.returncode < 0:
        return -done.returncode
    assert done.returncode == 0, done.stderr[-3000:]
    return 1000


def digests(ap: Path) -> dict[str, str]:
    return {p.name: file_digest(p) for p in sorted(ap.iterdir()) if not p.name.endswith(".tmp")}


def manifest(ap: Path) -> dict[str, Any]:
    return dict(json.loads((ap / "manifest.json").read_text()))


def leftovers(ap: Path) -> list[str]:
    return sorted([p.name for p in ap.parent.iterdir() if p.name != ap.name] +
                  [p.name for p in ap.iterdir() if p.name.endswith(".tmp")])


def check_notices(r: Result) -> None:
    """Each note about a stopped run's leftovers is one line."""
    for line in r.stderr.splitlines():
        if "stopped" in line:
            assert "Traceback" not in r.stderr and line.strip(), r.stderr


@pytest.mark.parametrize("at", range(1, QUANTIZE_POINTS + 2))
def test_quantize_killed_at_every_write_point(at: int, base: Path, clean: dict[str, str], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    ap = Path(shutil.copytree(base, tmp_path / "ap"))
    previous = digests(ap)
    got = run_killed("quantize", ap, at)
    assert got == (signal.SIGKILL if at <= QUANTIZE_POINTS else 1000), (at, got)
    # a reader meanwhile: the previous artifact byte for byte, the new complete one, or one error line
    verified = runner.invoke(pwcal_app, ["verify", str(ap)])
    state = "error" if verified.exit_code != 0 else "previous" if digests(ap) == previous else "new"
    if state == "error":
        one_error(verified, str(ap))
    elif state == "new":
        assert manifest(ap)["stages"]["quantize"]["config"]["calib_seed"] == 1
        assert serve(ap, *UNIFORM).exit_code == 0
    # the same command again completes and leaves nothing behind
    monkeypatch.setattr(quantize_module, "nested_kmeans", uniform_nested)
    r = runner.invoke(pwcal_app, ["quantize", str(MODEL), "--out", str(ap), *QUANT, "--calib-seed", "1", "--force"])
    assert r.exit_code == 0, r.stderr
    check_notices(r)
    assert leftovers(ap) == [], leftovers(ap)
    assert runner.invoke(pwcal_app, ["verify", str(ap)]).exit_code == 0
    new = manifest(ap)
    assert new["stages"]["quantize"]["config"]["calib_seed"] == 1 and new["run_id"] != manifest(base)["run_id"]


@pytest.mark.parametrize("at", range(1, SENSITIVITY_POINTS + 2))
def test_sensitivity_killed_at_every_write_point(at: int, base: Path, clean: dict[str, str], tmp_path: Path
                                                 ) -> None:
    ap = Path(shutil.copytree(base, tmp_path / "ap"))
    got = run_killed("sensitivity", ap, at)
    assert got == (signal.SIGKILL if at <= SENSITIVITY_POINTS else 1000), (at, got)
    reader = serve(ap)
    verified = runner.invoke(pwcal_app, ["verify", str(ap)])
    if verified.exit_code != 0:
        one_error(verified)
    r = runner.invoke(pwcal_app, ["sensitivity", str(MODEL), "--artifacts", str(ap), *QUANT, "--min-tokens", "1",
                                  "--seed", "2", "--force"])
    assert r.exit_code == 0, r.stderr
    check_notices(r)
    assert leftovers(ap) == [], leftovers(ap)
    assert runner.invoke(pwcal_app, ["verify", str(ap)]).exit_code == 0
    if reader.exit_code != 0:
        one_error(reader)
    elif reader.stdout != clean["default"]:  # then it must have read the new complete artifact
        final = serve(ap)
        assert final.exit_code == 0 and reader.stdout == final.stdout, (reader.stdout, final.stdout, final.stderr)
