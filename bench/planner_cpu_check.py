"""Planner time on the critical path and admission behaviour of `pwrun generate` on the CPU (bundled tiny model).

Runs one `pwrun generate` with the given arguments in this process and prints, from its summary: steps, preemptions,
prefill tokens (prompt tokens computed, recomputation included), demotions / promotions and the planner's ms per step
on the critical path. ``--cuda-order`` forces the planner's overlapped step order (``PlannerConfig.overlapped``, what
a CUDA engine does: demotion plans prepared while the device computes) so that what would sit on a GPU step's
critical path is what is timed. Usage (from the repo root, artifacts from `make demo`)::

    python bench/planner_cpu_check.py [--cuda-order] -- --prompts P.jsonl --artifacts artifacts/runs/tiny-ap \\
        --gpu-memory 48MiB --max-new-tokens 64
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path


def main() -> None:
    argv = sys.argv[1:]
    cuda_order = "--cuda-order" in argv[: argv.index("--")] if "--" in argv else False
    gen_args = argv[argv.index("--") + 1:] if "--" in argv else argv
    import pwrun.engine.serve as serve
    from pwrun.cli import app

    if cuda_order:  # serve.py sets overlapped = (device is CUDA) through dataclasses.replace
        real = dataclasses.replace

        def replace(obj, **kw):  # type: ignore[no-untyped-def]
            if "overlapped" in kw:
                kw["overlapped"] = True
            return real(obj, **kw)

        serve.replace = replace  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        sys.argv = ["pwrun", "generate", *gen_args, "--output", str(Path(tmp) / "out.jsonl"),
                    "--summary-json", str(summary)]
        try:
            app()
        except SystemExit as e:
            if e.code:
                raise
        s = json.loads(summary.read_text())
    keys = ("steps", "preemptions", "prefill_tokens", "decode_tokens", "demoted_blocks", "promoted_blocks",
            "planner_ms_per_step", "planner_overlapped_ms_per_step", "seconds")
    print(json.dumps({"cuda_order": cuda_order, **{k: s.get(k) for k in keys}}))


if __name__ == "__main__":
    main()
