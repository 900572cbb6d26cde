#!/usr/bin/env bash
# Call 1 (issue 12 remainder): GPU tests of the trainer and its modes, step timings per mode,
# one speedrun per mode, --smoothing/--mirror runs, the validation search of the flags set,
# compute-sanitizer memcheck + racecheck over the trainer launches. Each stage time-boxed.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 CONVOLAB_DATA=$PWD/../.data
O=${OUT:-/tmp/out}; mkdir -p "$O"
T0=$(date +%s); st() { echo "== +$(( $(date +%s) - T0 ))s $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$O/gpu.txt" 2>&1
st pytest
timeout 110 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE -s tests/test_trainer_modes.py tests/test_gpu_trainer.py > "$O/pytest.txt" 2>&1
grep -E "held-out|passed|failed|Error|assert" "$O/pytest.txt" | tail -25
st bench
timeout 60 python3 -c "
from pathlib import Path; from convolab.bench import train as t
t.main(reps=10, out=Path('$O'), torch=False)" > "$O/bench.txt" 2>&1; tail -40 "$O/bench.txt"
st speedruns
{ for m in exact tf32 bf16; do timeout 25 python3 -m convolab train --device gpu --speedrun --mode $m --out /tmp/w_$m.safetensors --force 2>&1 | grep -E "speedrun|rror"; done
  timeout 25 python3 -m convolab train --device gpu --speedrun --smoothing 0.1 --out /tmp/ws.safetensors 2>&1 | grep -E "speedrun|rror"
  timeout 25 python3 -m convolab train --device gpu --speedrun --mirror --out /tmp/wm.safetensors 2>&1 | grep -E "speedrun|rror"
} > "$O/speedruns.txt"; cat "$O/speedruns.txt"
st search
timeout 45 python3 benchmarks/train_search.py search --set flags --seeds 5 --out "$O/search_flags.json" > "$O/search.txt" 2>&1; tail -8 "$O/search.txt"
st sanitize
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
for tool in memcheck racecheck; do
  timeout 50 "$SAN" --tool $tool python3 benchmarks/sanitize.py --only trainer > "$O/sanitize_$tool.txt" 2>&1
  tail -4 "$O/sanitize_$tool.txt"
done
st done
