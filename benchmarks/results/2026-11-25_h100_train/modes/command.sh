#!/usr/bin/env bash
# Call 2 (issue 12 remainder, numbers of record): GPU tests of the trainer and its modes; the
# speedrun, 5 seeds, in every mode (the default recipe) and the previous recipe (10 epochs, no
# smoothing) in exact; `convolab bench --train` (every row, with PyTorch); compute-sanitizer
# memcheck + racecheck over the trainer launches of benchmarks/sanitize.py.
set -u
cd "$(dirname "$0")/.."  # the .wt12 copy
export PYTHONPATH=src PYTHONUNBUFFERED=1 CONVOLAB_DATA=$PWD/../.data
O=${OUT:-/tmp/out}; mkdir -p "$O" /tmp/sr
T0=$(date +%s); st() { echo "== +$(( $(date +%s) - T0 ))s $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$O/gpu.txt" 2>&1
st pytest
timeout 70 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -s tests/test_trainer_modes.py tests/test_gpu_trainer.py > "$O/pytest.txt" 2>&1
grep -E "held-out|passed|failed|Error" "$O/pytest.txt" | tail -12
st speedruns
for run in exact tf32 bf16 "exact --epochs 10 --smoothing 0"; do
  name=$(echo "$run" | tr -d ' -')
  timeout 30 python3 -m convolab train --device gpu --speedrun --seeds 5 --json /tmp/sr/$name.json --mode $run 2>&1 | tail -1
done
python3 - "$O/speedruns.json" /tmp/sr/*.json <<'PY'
import json, sys
json.dump({p.split('/')[-1][:-5]: json.load(open(p)) for p in sys.argv[2:]}, open(sys.argv[1], 'w'), indent=1)
PY
st bench
timeout 110 python3 -m convolab bench --train --out /tmp/bench > "$O/bench.txt" 2>&1
cp /tmp/bench/train.json "$O/bench_train.json" 2>/dev/null
cat "$O/bench.txt"
st sanitize
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
n=2
for tool in memcheck racecheck; do
  timeout $(( (292 - ($(date +%s) - T0)) / n )) "$SAN" --tool $tool python3 benchmarks/sanitize.py --only trainer > "$O/sanitize_$tool.txt" 2>&1
  grep -E "^(ok|FAIL)|SUMMARY|launches" "$O/sanitize_$tool.txt" | tail -12
  n=1
done
st done
