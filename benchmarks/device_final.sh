#!/usr/bin/env bash
# The closing device check, one call (< 600 s): the whole GPU test suite, verify, classify with
# every rung at B=10000, the per-layer bench and the network bench. Everything lands in $OUT.
#   bash benchmarks/device_final.sh [tests] [verify] [classify] [zoo] [seeds] [bench] [network]
set -u
OUT=${OUT:-/tmp/convolab-final}
mkdir -p "$OUT/final"
export PYTHONPATH=src CONVOLAB_DATA=${CONVOLAB_DATA:-.data} PYTHONUNBUFFERED=1
stamp() { echo "== $(date +%T) $*"; }
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(tests verify classify zoo seeds bench network)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/final/gpu.txt"
for stage in "${STAGES[@]}"; do
  stamp "$stage"
  case "$stage" in
    tests)    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests \
                > "$OUT/final/pytest_gpu.txt" 2>&1; echo "rc=$?"; tail -n 4 "$OUT/final/pytest_gpu.txt" ;;
    verify)   timeout 60 python3 -m convolab verify --device gpu > "$OUT/final/verify.txt" 2>&1
              echo "rc=$?"; grep -cE "PASS" "$OUT/final/verify.txt"; grep -E "FAIL|ERROR" "$OUT/final/verify.txt" | head ;;
    classify) timeout 150 python3 benchmarks/classify_all.py --batch 10000 \
                --out "$OUT/final/classify_all.json" 2>&1 | tee "$OUT/final/classify_all.txt" | tail -n 40 ;;
    zoo)      for m in ece408-mxnet eecs498; do
                timeout 40 python3 -m convolab classify --model "$m" --device gpu --batch 10000 \
                  > "$OUT/final/classify_$m.txt" 2>&1; echo "$m rc=$?"; cat "$OUT/final/classify_$m.txt"
              done ;;
    seeds)    timeout 60 python3 -m convolab bench --shapes seeds --batch 10000 --reps 20 \
                -i auto -i register-tiled -i tensor-core-tf32 --json "$OUT/final/bench_seeds.json" \
                > "$OUT/final/bench_seeds.txt" 2>&1; echo "seeds rc=$?" ;;
    bench)    timeout 150 python3 -m convolab bench --batch 10000 --reps 20 \
                --json "$OUT/final/bench.json" > "$OUT/final/bench.txt" 2>&1; echo "rc=$?" ;;
    network)  timeout 90 python3 -m convolab bench --network --batch 10000 --reps 20 \
                --json "$OUT/final/network.json" > "$OUT/final/network.txt" 2>&1; echo "rc=$?"
              tail -n 20 "$OUT/final/network.txt" ;;
  esac
done
tar -czf "$OUT/final.tar.gz" -C "$OUT" final && rm -rf "$OUT/final"
stamp done
