#!/bin/bash
# The GPU runs that CPU-only changes wait for. Seventeenth session: the full tables of issues 4 and 8 ran on
# 746ba40 (ap_moe_s17*, serve_s17*, serve_mixtral_s17*); the 16-token GEMV, its warm-up, shared_paths and test_cuda
# passed natively (gpu_checks/pytest_s17_h200.txt). What waits now:
#   0. the warm-up's coverage of mixed steps (kernels/warmup.py::step_token_limit, CPU-tested only): the
#      seventeenth session's batch-4 runs compiled Qwen's router GEMV and Mixtral's 5..16-token gemv1 pair inside
#      serving (a prompt's last chunk beside the running decodes: more tokens than the batch). Check: serve
#      Mixtral (SERVE_FLAGS="--skip-hf --skip-lean16 --no-equal-memory --config-dir
#      tests/fixtures/configs/mistralai__Mixtral-8x7B-v0.1" SERVE_BITS=3 SERVE_BATCHES=1,4, ~2.5 min; the carried
#      cache lacks that pair, calls 4 and 7 did not pack): no compile inside a run, and the startup's warm-up time
#      (more jobs now: Qwen 20, Mixtral 9, on a cold cache)
#   1. the shared expert at 8 and 32 tokens over every path (SHARED_APPLY=1 SHARED_TS=32,8 ... shared, ~3 min)
# Always with carry [".triton_cache.txz"] (the Triton cache of the last call: join $OUT/triton_cache.txz.part* from its
# results into .triton_cache.txz in the checkout, which .git/info/exclude ignores; a cold machine otherwise compiles
# for minutes) and COMMIT=<local short hash> in the command.
# Usage on the device machine: bash bench/gpu_pending_check.sh [STAGES]: comma-separated of warm, tests, attention, slots, prefill, shared, table, profile, serve (default:
# tests and attention, ~6 min; serving in a second call, ~5 min: one call may run 10 min). Results land in $OUT.
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# the device copy's git metadata can lag the working tree (thirteenth session: it named 7484990 for ab9437b): pass
# COMMIT=<local short hash> in the command for the results headers
C=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
STAGES=${1:-tests,attention}
# Triton's cache travels between calls (a fresh machine compiles the decode kernels for minutes): a carried
# .triton_cache.txz is unpacked first, and the cache is packed into $OUT/triton_cache.txz.part* after every stage.
export TRITON_CACHE_DIR=$PWD/.triton_cache
mkdir -p "$TRITON_CACHE_DIR"
if [[ -f .triton_cache.txz ]]; then  # a truncated archive (a part missing) must not leave half-written kernels
  if (set -o pipefail; xz -dc -T0 .triton_cache.txz | tar xf -); then echo "unpacked $(ls "$TRITON_CACHE_DIR" | wc -l) cached kernels"
  else rm -rf "$TRITON_CACHE_DIR"; mkdir -p "$TRITON_CACHE_DIR"; echo "the carried Triton cache is damaged: starting cold"; fi
fi
# $OUT returns files of at most 16 MiB and the tree that travels is at most 64 MiB (fourteenth session: the gzip cache
# grew to 36 MB, xz makes it 11 MB): the cache comes back as xz in 15 MB parts $OUT/triton_cache.txz.partaa, .partab,
# ...; join them here with cat into .triton_cache.txz (carry that; with gemv_compare's tile candidates it grew to 463 MB,
# 19 MB as xz -9; fifteenth session: 25.2 MB travelled beside the 40.7 MB checkout, 26.7 MB was refused in the
# fourteenth: past that drop the cache and start cold)
# NOPACK=1: skip packing (a warm machine keeps .triton_cache between calls; pack in the last call of a session)
pack() { [[ ${NOPACK:-0} == 1 ]] && return 0; rm -f "$OUT"/triton_cache.txz.part*; tar cf - .triton_cache | xz -9 -T0 | split -b 15m - "$OUT/triton_cache.txz.part"; }
if [[ $STAGES == *warm* ]]; then
{ echo "# decode warm-up of the Qwen1.5-MoE shape up to 16 tokens, commit $C, $(date -u +%F)"
  timeout 330 python -u -c "
import time
from kernels.warmup import MoEShape, precompile_decode
t = time.perf_counter()
print('errors:', precompile_decode([MoEShape(2048, 1408, 4, 5632)], 16))
print(f'warm-up wall {time.perf_counter() - t:.1f} s')" 2>&1; } > "$OUT/warmup.txt"
pack; echo "warm-up done at ${SECONDS}s"; cat "$OUT/warmup.txt"
fi
if [[ $STAGES == *tests* ]]; then
{ echo "# pending-change tests, commit $C, $(date -u +%F), $(nvidia-smi --query-gpu=name --format=csv,noheader)"
  # TESTS: a narrower list (space-separated pytest ids) when only some changes wait
  timeout ${TESTS_TIMEOUT:-300} python -u -m pytest -q -p no:warnings ${TESTS:-tests/test_paged_attention.py tests/test_pooled_attention.py \
    tests/test_moe_prefill.py tests/test_cuda.py \
    "tests/test_ap_moe_kernel.py::test_shared_expert_prefill_path" \
    "tests/test_ap_moe_kernel.py::test_word_first_path_chunks_beyond_8_tokens" \
    "tests/test_ap_moe_kernel.py::test_chunked_word_first_path_rebuilds_foreign_activations" \
    "tests/test_ap_moe_kernel.py::test_routed_and_shared_block_on_chunked_word_first_path" \
    tests/test_warmup.py tests/test_warmup_gemv.py tests/test_dense_gemv.py tests/test_shared_paths.py} -rs 2>&1 | tail -15; } > "$OUT/pytest_pending.txt"
pack
echo "tests done at ${SECONDS}s"; tail -3 "$OUT/pytest_pending.txt"
fi
if [[ $STAGES == *attention* ]]; then
timeout 320 python -u bench/paged_attention_speed.py --batches 1,4,16 --time-limit 200 \
  --out-md "$OUT/paged_attention_h200.md" --write-configs kernels/configs/paged_attention.json \
  > "$OUT/paged_attention_stdout.txt" 2>&1
cp kernels/configs/paged_attention.json "$OUT/"
pack
echo "attention tuning done at ${SECONDS}s"; tail -12 "$OUT/paged_attention_stdout.txt"
fi
if [[ $STAGES == *slots* ]]; then
{ echo "# gemv1 sorted slots vs the committed decode paths, commit $C, $(date -u +%F)"
  cp kernels/configs/ap_moe.json "$OUT/ap_moe_slots.json"
  timeout ${SLOTS_TIMEOUT:-420} python -u bench/gemv_compare.py --shapes ${SLOTS_SHAPES:-qwen1.5-moe,mixtral-8x7b} \
    --ts ${SLOTS_TS:-4,16,8,32} --qs 3,4,5,6,8 --tune-qs 4 --grid small --slots 1,2,4 --pick sum ${SLOTS_EXTRA:-} \
    --time-limit $(( ${SLOTS_TIMEOUT:-420} - 90 )) --write-configs "$OUT/ap_moe_slots.json" 2>&1
  python -m pytest -q -p no:warnings tests/test_pair_sort.py 2>&1 | tail -2
  python -m pytest -q -p no:warnings tests/test_ap_moe_kernel.py -k sorted_slots 2>&1 | tail -2; } \
  > "$OUT/gemv1_slots.txt"
pack; echo "slots done at ${SECONDS}s"; grep -v '^{' "$OUT/gemv1_slots.txt" | tail -30
if [[ ${SLOTS_APPLY:-0} == 1 ]]; then cp "$OUT/ap_moe_slots.json" kernels/configs/ap_moe.json; echo "later stages use the slots winners"; fi
fi
if [[ $STAGES == *prefill* ]]; then  # fused at prefill tile sizes vs the committed dequant path (~4-6 min)
{ echo "# fused at prefill tiles (BLOCK_M 32..128) vs the committed path, T = 256 / 2048, commit $C, $(date -u +%F)"
  cp kernels/configs/ap_moe.json "$OUT/ap_moe_prefill.json"
  timeout ${PREFILL_TIMEOUT:-360} python -u bench/prefill_tune.py --shapes ${PREFILL_SHAPES:-qwen1.5-moe,mixtral-8x7b} \
    --ts 256,2048 --qs 4,mixed --time-limit $(( ${PREFILL_TIMEOUT:-360} - 60 )) --write-configs "$OUT/ap_moe_prefill.json" 2>&1
  python -m pytest -q -p no:warnings tests/test_ap_moe_prefill_tiles.py tests/test_ap_moe_kernel.py -k "prefill_tile or fused" 2>&1 | tail -2; } \
  > "$OUT/prefill_tune.txt"
pack; echo "prefill tuning done at ${SECONDS}s"; grep -v '^{' "$OUT/prefill_tune.txt" | tail -16
if [[ ${PREFILL_APPLY:-0} == 1 ]]; then cp "$OUT/ap_moe_prefill.json" kernels/configs/ap_moe.json; echo "later stages use the prefill winners"; fi
fi
if [[ $STAGES == *shared* ]]; then  # Qwen's shared expert at 8..32 tokens: dequant / fused / gemv1 slots vs committed
{ echo "# shared expert paths at 8..32 tokens vs the committed config, commit $C, $(date -u +%F)"
  cp kernels/configs/ap_moe.json "$OUT/ap_moe_shared.json"
  timeout ${SHARED_TIMEOUT:-300} python -u bench/shared_paths.py --ts ${SHARED_TS:-16,32,8} \
    --write-configs "$OUT/ap_moe_shared.json" 2>&1; } > "$OUT/shared_paths.txt"
pack; echo "shared paths done at ${SECONDS}s"; grep -v '^{' "$OUT/shared_paths.txt" | tail -8
if [[ ${SHARED_APPLY:-0} == 1 ]]; then cp "$OUT/ap_moe_shared.json" kernels/configs/ap_moe.json; echo "later stages use the shared winners"; fi
fi
if [[ $STAGES == *table* ]]; then  # the kernel table of issue 4 with the committed buckets (~1 min, cache warm)
# TABLE_TS (default 1,4,16,256,2048), TABLE_QS (4,mixed), TABLE_TIMEOUT (200 s per table), TABLE_COLD=1: a second table with L2 flushed before every timed call
timeout ${TABLE_TIMEOUT:-200} python -u bench/ap_moe_speed.py --shapes qwen1.5-moe,mixtral-8x7b --ts ${TABLE_TS:-1,4,16,256,2048} --qs ${TABLE_QS:-4,mixed} --reps 20 \
  --out-md "$OUT/ap_moe_table_h200.md" > "$OUT/ap_moe_table_stdout.txt" 2>&1
echo "kernel table done at ${SECONDS}s"; grep '^|' "$OUT/ap_moe_table_h200.md" | cut -c1-220 | tail -24
if [[ ${TABLE_COLD:-0} == 1 ]]; then
timeout ${TABLE_TIMEOUT:-200} python -u bench/ap_moe_speed.py --shapes qwen1.5-moe,mixtral-8x7b --ts ${TABLE_TS:-1,4,16,256,2048} --qs ${TABLE_QS:-4,mixed} --reps 20 \
  --cold-l2 --out-md "$OUT/ap_moe_table_cold_h200.md" > "$OUT/ap_moe_table_cold_stdout.txt" 2>&1
echo "cold-L2 kernel table done at ${SECONDS}s"; grep '^|' "$OUT/ap_moe_table_cold_h200.md" | cut -c1-220 | tail -24
fi
pack
fi
if [[ $STAGES == *profile* ]]; then  # where a decode step's GPU time goes now (eager steps; PROFILE_BATCHES, default "1 16")
for b in ${PROFILE_BATCHES:-1 16}; do timeout 200 python -u bench/profile_decode.py --bits 4 --batch $b --out "$OUT/profile_decode_u4_b${b}.txt" \
  > "$OUT/profile_b${b}_stdout.txt" 2>&1; head -12 "$OUT/profile_decode_u4_b${b}.txt"; done
pack; echo "profiles done at ${SECONDS}s"
fi
if [[ $STAGES == *serve* ]]; then
# SERVE_FLAGS: the full table of issue 8 (transformers and the 16-bit lean rows too) with SERVE_FLAGS=" "
timeout ${SERVE_TIMEOUT:-300} python -u bench/serve_speed.py ${SERVE_FLAGS:---skip-hf --skip-lean16} --batches ${SERVE_BATCHES:-16,4,1} --bits ${SERVE_BITS:-4} --interleave ${SERVE_REPEATS:-3} \
  --time-limit $(( ${SERVE_TIMEOUT:-300} - 40 )) --out-md "$OUT/serve_pending_h200.md" > "$OUT/serve_stdout.txt" 2>&1
pack; echo "serving done at ${SECONDS}s"; sed -n '/| system/,$p' "$OUT/serve_pending_h200.md" | cut -c1-160 | tail -30
fi
