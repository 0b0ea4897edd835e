"""Small artifacts of the bundled model for the integrity and fault-injection tests, and the checks they share.

``make_artifact`` runs the real quantize stage with a fast stand-in for the nested k-means (uniform nested codes:
these tests check what is recorded, verified and recovered, not quantization quality) and the real sensitivity
stage, a few seconds each. ``one_error`` is the contract of every refused command: exit code 2, exactly one
``error:`` line, no traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner, Result

import pwcal.quant.quantize as quantize_module
from pwcal.quant.kmeans1d import NestedCodes
from pwcal.quant.quantize import QuantizeConfig, quantize
from pwcal.sensitivity import SensitivityConfig, run_sensitivity
from pwrun.cli import app as pwrun_app
from pwrun.data import default_model_dir

MODEL = default_model_dir()
runner = CliRunner()
QUANT = ["--samples", "2", "--seq-len", "64", "--device", "cpu"]
SERVE = ["generate", "--prompt", "The river", "--max-new-tokens", "2", "--device", "cpu", "--gpu-memory", "48MiB"]
SENSITIVITY = SensitivityConfig(samples=2, seq_len=64, min_tokens=1)


def uniform_nested(x: torch.Tensor, w: torch.Tensor, seed_bits: int = 3, iters: int = 50) -> NestedCodes:
    """Nested codes of x [R, K] on a uniform 256-level grid per row, with each b-bit LUT at its cells' centres."""
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    step = (hi - lo).clamp_min(1e-8) / 256
    codes = ((x - lo) / step).floor().clamp(0, 255).to(torch.uint8)
    luts = {b: (lo + (torch.arange(2**b, dtype=x.dtype) + 0.5) * step * 2 ** (8 - b)).half()
            for b in range(seed_bits, 9)}
    return NestedCodes(codes, luts)


def quantize_fast(out: Path, calib_seed: int = 0, force: bool = False) -> dict[str, Any]:
    """The real quantize stage of the bundled model into ``out``, with ``uniform_nested`` for the k-means."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quantize_module, "nested_kmeans", uniform_nested)
        return quantize(MODEL, out, QuantizeConfig(samples=2, seq_len=64, calib_seed=calib_seed), device="cpu",
                        force=force)


def make_artifact(out: Path, calib_seed: int) -> Path:
    quantize_fast(out, calib_seed)
    run_sensitivity(MODEL, out, SENSITIVITY, "cpu")
    return out


def one_error(r: Result, *needles: str) -> str:
    """The single ``error:`` line of a failed command, which must contain every needle."""
    lines = r.stderr.strip().splitlines()
    errors = [x for x in lines if x.startswith("error:")]
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.exit_code, r.stderr, r.exception)
    assert len(errors) == 1 and "Traceback" not in r.output + r.stderr, r.stderr
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


def serve(art: Path, *extra: str) -> Result:
    return runner.invoke(pwrun_app, [*SERVE, "--artifacts", str(art), *extra])


def flip(path: Path, offset: int, n: int = 16) -> None:
    data = bytearray(path.read_bytes())
    data[offset:offset + n] = bytes(b ^ 0xFF for b in data[offset:offset + n])
    path.write_bytes(bytes(data))


def edit_manifest(art: Path, change: Any) -> None:
    m = json.loads((art / "manifest.json").read_text())
    change(m)
    (art / "manifest.json").write_text(json.dumps(m))
