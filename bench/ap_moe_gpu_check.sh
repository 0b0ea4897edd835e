#!/usr/bin/env bash
# One device call for the AP MoE kernels (issue #4): GPU correctness, then the quick tuned benchmark,
# then new vs committed numbers (bench/results/ap_moe_h200.json) per row. Writes under $OUT (default ./out).
# Usage (repository root, on the GPU machine): bash bench/ap_moe_gpu_check.sh
set -o pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 240 python3 -m pytest tests/test_ap_moe_kernel.py -x -q -n 8 -p no:cacheprovider 2>&1 | tail -6 | tee "$OUT/pytest.txt" || exit 1
timeout 330 python3 bench/ap_moe_speed.py --quick --tune --out-md "$OUT/ap_moe_h200.md" 2>&1 \
  | tee "$OUT/ap_moe_stdout.txt" | grep -v '^tune\|^{'
python3 - "$OUT/ap_moe_h200.json" bench/results/ap_moe_h200.json <<'PY'
import json, sys
new, old = (json.load(open(p))["rows"] for p in sys.argv[1:3])
prev = {(r["shape"], r["q"], r["T"]): r for r in old}
print("shape q T path | GPU ms (graph or eager) new / old = speedup | % floor | x vs dense | rel err")
for r in new:
    o = prev.get((r["shape"], r["q"], r["T"]))
    t = r["graph_ms"] if r["path"] == "gemv" else r["kernel_ms"]
    to = (o["graph_ms"] if o["path"] == "gemv" else o["kernel_ms"]) if o else float("nan")
    print(r["shape"][:7], r["q"], r["T"], r["path"], f"| {t} / {to} = {to / t:.2f}x |",
          round(100 * r["floor_ms"] / t, 1), "|", r["speedup_vs_dense"], "|", r["rel_err"])
PY
