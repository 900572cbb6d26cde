#!/usr/bin/env bash
# One device call for rung 13 and the fused LeNet (run from the repo root, < 420 s):
#   bash benchmarks/device_fused.sh [tests] [sanitize] [bench]     (default: all three)
# tests: GPU tests of tests/test_gpu_fused.py; sanitize: compute-sanitizer memcheck and
# racecheck on tiny batches of every kernel; bench: timings -> $OUT/fused.json, network.json.
set -u
OUT=${OUT:-/tmp/convolab-fused}
mkdir -p "$OUT"
export PYTHONPATH=src CONVOLAB_DATA=${CONVOLAB_DATA:-.data}
stamp() { echo "== $(date +%T) $*"; }
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(tests sanitize bench)
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader

for stage in "${STAGES[@]}"; do
  case "$stage" in
    tests)
      stamp tests
      timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_fused.py \
        > "$OUT/pytest_fused.txt" 2>&1
      echo "pytest rc=$?"; tail -n 25 "$OUT/pytest_fused.txt" ;;
    sanitize)
      for tool in memcheck racecheck; do
        stamp "sanitize $tool"
        timeout 100 "$SAN" --tool "$tool" --error-exitcode 9 \
          python3 benchmarks/device_fused.py --smoke > "$OUT/sanitize_$tool.txt" 2>&1
        echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error|smoke Fused" \
          "$OUT/sanitize_$tool.txt" | tail -n 8
      done ;;
    bench)
      stamp bench
      timeout 250 python3 benchmarks/device_fused.py --out "$OUT" --reps 30 \
        > "$OUT/bench_fused.log" 2>&1
      echo "bench rc=$?"; tail -n 60 "$OUT/bench_fused.log" ;;
  esac
done
stamp done
