#!/usr/bin/env bash
# Device run for GPU rungs 1-7 (tests, compute-sanitizer, B=10000 timings). Run from the repo
# root on the GPU machine; results land in $OUT (default ./out). Extra args go to the script,
# e.g. `--skip tests sanitizer` or `--sweep`.
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/nvidia-smi.csv" 2>&1 || true
PYTHONPATH=src python3 benchmarks/device_ladder.py --out "$OUT" "$@" 2>&1 | tee "$OUT/device_ladder.log"
