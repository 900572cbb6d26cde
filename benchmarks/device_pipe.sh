#!/usr/bin/env bash
# One device call for fcp_exact_pipe (run from the repo root, < 240 s): correctness + Op Time
# of every variant (benchmarks/device_pipe.py -> $OUT/pipe.json), then its GPU tests.
set -u
OUT=${OUT:-/tmp/convolab-pipe}
mkdir -p "$OUT"
export PYTHONPATH=src
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout 100 python3 benchmarks/device_pipe.py --out "$OUT" --reps 30 --budget 80 \
  > "$OUT/bench_pipe.log" 2>&1
echo "bench rc=$?"; grep -v "^ " "$OUT/bench_pipe.log" | tail -n 45
timeout 50 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_fused_pipe.py \
  > "$OUT/pytest_pipe.txt" 2>&1
echo "pytest rc=$?"; tail -n 15 "$OUT/pytest_pipe.txt"
# the rung's own GPU tests on the exact path, whose defaults now pick the pipe
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fused.py \
  -k "exact_random_shapes or simple_fallback or fused_lenet_exact" > "$OUT/pytest_fused.txt" 2>&1
echo "pytest fused rc=$?"; tail -n 8 "$OUT/pytest_fused.txt"
