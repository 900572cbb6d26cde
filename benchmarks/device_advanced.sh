#!/usr/bin/env bash
# Device run for GPU rungs 8-12/14: tests, compute-sanitizer, B=10000 timings.
#   bash benchmarks/device_advanced.sh [tests] [sanitize] [tune] [bench] [accuracy]
#   (default: the first four, in this order)
# Writes logs and JSON to $OUT (the device tool brings them back).
set -u
export PYTHONPATH=src
OUT=${OUT:-/tmp/convolab-out}
mkdir -p "$OUT"
# The tuner writes its cache here, and the bench's `auto` then reads it.
export CONVOLAB_CACHE="$OUT"
steps=${*:-tests sanitize tune bench}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/env.txt" 2>&1
python3 -c "import cupy; print('cupy', cupy.__version__)" >> "$OUT/env.txt" 2>&1
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
for step in $steps; do
  start=$(date +%s)
  case $step in
    tests)
      timeout 150 python3 -m pytest -q -rA -s tests/test_gpu_advanced.py > "$OUT/tests.log" 2>&1
      echo "pytest rc=$?" >> "$OUT/tests.log" ;;
    sanitize)
      { echo "== memcheck"; timeout 50 "$SAN" --tool memcheck --error-exitcode 9 \
          python3 benchmarks/device_advanced.py sanitize; echo "memcheck rc=$?";
        echo "== racecheck"; timeout 60 "$SAN" --tool racecheck --error-exitcode 9 \
          python3 benchmarks/device_advanced.py sanitize; echo "racecheck rc=$?"; } \
        > "$OUT/sanitizer.log" 2>&1 ;;
    accuracy)
      # LeNet (shipped ece408 weights) on all 10,000 test images through each new rung.
      for impl in channel-tree channel-atomic fp16 tensor-core-tf32 tensor-core-fp16 \
                  tensor-core-bf16 tensor-core-3xtf32 fft auto; do
        echo "== $impl"
        CONVOLAB_DATA=.data timeout 60 python3 -m convolab classify --impl "$impl" \
          --batch 10000 --per-layer 2>&1 | grep -E "Op Time|Layer Time|Accuracy|rror" | tail -8
      done > "$OUT/accuracy.log" 2>&1 ;;
    bench)
      timeout 140 python3 benchmarks/device_advanced.py bench --json "$OUT/advanced_bench.json" \
        > "$OUT/bench.log" 2>&1
      echo "bench rc=$?" >> "$OUT/bench.log" ;;
    tune)
      export CONVOLAB_TUNE_BUDGET_S=${CONVOLAB_TUNE_BUDGET_S:-190}
      export CONVOLAB_TUNE_MAX_CANDIDATES=${CONVOLAB_TUNE_MAX_CANDIDATES:-12}
      export CONVOLAB_TUNE_JSON="$OUT/tune_trials.json" COLUMNS=160
      timeout 290 python3 -m convolab tune --batch 10000 > "$OUT/tune.log" 2>&1
      echo "tune rc=$?" >> "$OUT/tune.log" ;;
  esac
  echo "$step took $(( $(date +%s) - start )) s" >> "$OUT/env.txt"
done
