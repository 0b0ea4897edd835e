"""The child process of the fault-injection kill tests: runs one stage of ``tests._artifacts`` on an artifact, in a
fresh interpreter that ``pwformat.atomic.fault_point`` kills at its ``PAGEDWEIGHT_FAULT_AT``-th write point.

A fresh interpreter rather than ``os.fork``: a child forked from a process whose OpenMP pool has run hangs in its
first parallel region.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pwcal.sensitivity import SensitivityConfig, run_sensitivity
from tests._artifacts import MODEL, SENSITIVITY, quantize_fast


def main(stage: str, artifact: str) -> None:
    ap = Path(artifact)
    if stage == "quantize":
        quantize_fast(ap, calib_seed=1, force=True)
    elif stage == "sensitivity":
        run_sensitivity(MODEL, ap, SensitivityConfig(**{**SENSITIVITY.__dict__, "seed": 2}), "cpu", force=True)
    else:
        raise SystemExit(f"unknown stage {stage!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
