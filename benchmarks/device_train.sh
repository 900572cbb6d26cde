#!/usr/bin/env bash
# One device call for GPU training work (run from the repo root; keep the whole call < 420 s).
# Steps run in the order given, each under its own time limit, logs and JSON into $OUT:
#   env                         GPU, driver, CuPy/torch versions
#   tests                       pytest tests/test_gpu_backward.py
#   throughput                  benchmarks/train_throughput.py (batch 256 and 4096, vs PyTorch)
#   train:MODEL:EPOCHS:BATCH:LR[:METHOD]   one GPU training run, alone (its time is reported)
#   bg:MODEL:EPOCHS:BATCH:LR[:METHOD]      the same, in the background (runs share the GPU)
#   wait                        wait for the background runs
#   sanitize                    compute-sanitizer memcheck + racecheck on the backward kernels
# Example: benchmarks/device_train.sh env tests train:ece408:20:256:0.002 sanitize
set -u
OUT=${OUT:-/tmp/convolab-device}
mkdir -p "$OUT"
export PYTHONPATH=src CONVOLAB_DATA=.data
stamp() { echo "== $(date +%T) $*"; }

train_run() {  # MODEL EPOCHS BATCH LR [METHOD] -> $OUT/<tag>/
  local model=$1 epochs=$2 batch=$3 lr=$4 method=${5:-}
  local tag="${model}_e${epochs}_b${batch}_lr${lr}${method:+_$method}"
  mkdir -p "$OUT/$tag"
  timeout 300 python3 benchmarks/device_train.py --model "$model" --epochs "$epochs" \
    --batch "$batch" --lr "$lr" ${method:+--method "$method"} --out-dir "$OUT/$tag" \
    > "$OUT/$tag/train.log" 2>&1
  echo "rc=$? $tag"; tail -n 3 "$OUT/$tag/train.log"
}

for step in "$@"; do
  case "$step" in
    env)
      stamp env
      { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
        python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
        python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())"
        nproc; } > "$OUT/env.txt" 2>&1
      cat "$OUT/env.txt" ;;
    tests)
      stamp "pytest tests/test_gpu_backward.py"
      timeout 200 python3 -m pytest -q tests/test_gpu_backward.py > "$OUT/tests.log" 2>&1
      echo "rc=$?"; tail -n 25 "$OUT/tests.log" ;;
    throughput)
      stamp "train throughput"
      timeout 150 python3 benchmarks/train_throughput.py --json "$OUT/train_throughput.json" \
        > "$OUT/throughput.log" 2>&1
      echo "rc=$?"; cat "$OUT/throughput.log" | tail -n 20 ;;
    train:*)
      IFS=: read -r _ model epochs batch lr method <<< "$step"
      stamp "train $model"
      train_run "$model" "$epochs" "$batch" "$lr" "$method" ;;
    bg:*)
      IFS=: read -r _ model epochs batch lr method <<< "$step"
      stamp "background train $model"
      train_run "$model" "$epochs" "$batch" "$lr" "$method" &
      ;;
    wait)
      stamp "waiting for background runs"; wait ;;
    sanitize)
      SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
      if [ -z "$SAN" ]; then echo "no compute-sanitizer"; continue; fi
      for tool in memcheck racecheck; do
        stamp "compute-sanitizer $tool"
        timeout 120 "$SAN" --tool "$tool" --error-exitcode 9 python3 benchmarks/sanitize_backward.py \
          > "$OUT/sanitize_$tool.log" 2>&1
        echo "rc=$?"; tail -n 6 "$OUT/sanitize_$tool.log"
      done ;;
    *) echo "unknown step $step" ;;
  esac
done
wait
stamp done
