#!/usr/bin/env bash
# One device call for `convolab bench` and `convolab profile` (run from the repo root, < 420 s):
#   1. the model's layers at B=10000, 20 reps, with the plot when matplotlib is installed;
#   2. a smoke run of the VGG16 shape set (its own batches, 5 reps);
#   3. Nsight Compute metrics at B=100 on a representative subset of rungs;
#   4. the --network delegation (whole-network forward, convolab.gpu.network).
# Each step has its own time limit; bench and profile write their JSON after every layer /
# implementation, so a step cut short still leaves its partial results. The device tool
# returns only a few files, so everything is written under $OUT/work and packed at the end
# into $OUT/results.tar.gz (plus the B=10000 JSON and plot, the ones looked at first).
set -u
FINAL=${OUT:-/tmp/convolab-device}
OUT="$FINAL/work"
mkdir -p "$OUT"
export PYTHONPATH=src CONVOLAB_DATA=.data
stamp() { echo "== $(date +%T) $*"; }

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
  python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())" || true
  python3 -c "import matplotlib; print('matplotlib', matplotlib.__version__)" || true
  command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null || echo "no ncu"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

PLOT=()
python3 -c "import matplotlib" 2>/dev/null && PLOT=(--plot "$OUT/bench_b10000.png")

stamp "bench: model layers, B=10000, 20 reps"
timeout 170 python3 -m convolab bench --batch 10000 --reps 20 \
  --json "$OUT/bench_b10000.json" "${PLOT[@]}" > "$OUT/bench_b10000.log" 2>&1
echo "rc=$?"; grep -v "^bench: " "$OUT/bench_b10000.log" | tail -n 80

stamp "bench smoke: VGG16 shapes (B=16/64), 5 reps"
timeout 80 python3 -m convolab bench --shapes vgg --batch 64 --reps 5 \
  --json "$OUT/bench_vgg.json" > "$OUT/bench_vgg.log" 2>&1
echo "rc=$?"; grep -v "^bench: " "$OUT/bench_vgg.log" | tail -n 40

stamp "profile: B=100"
if command -v ncu >/dev/null || [ -x /usr/local/cuda/bin/ncu ]; then
  timeout 80 python3 -m convolab profile --batch 100 --json "$OUT/profile.json" \
    -i basic -i tiled -i restrict-unroll -i fused-gemm -i register-tiled -i channel-tree \
    -i tensor-core-tf32 -i fused-conv-pool2 -i fused-conv-pool4 > "$OUT/profile.log" 2>&1
  echo "rc=$?"; tail -n 30 "$OUT/profile.log"
else
  python3 -m convolab profile --batch 100 > "$OUT/profile.log" 2>&1
  echo "rc=$? (no ncu: expecting the clear error)"; cat "$OUT/profile.log"
fi
stamp "bench --network: B=10000"
timeout 45 python3 -m convolab bench --network --batch 10000 --reps 20 \
  --json "$OUT/bench_network_b10000.json" > "$OUT/bench_network.log" 2>&1
echo "rc=$?"; tail -n 20 "$OUT/bench_network.log"
stamp done
tar -C "$OUT" -czf "$FINAL/results.tar.gz" .
cp "$OUT/bench_b10000.json" "$FINAL/" 2>/dev/null
cp "$OUT/bench_b10000.png" "$FINAL/" 2>/dev/null
rm -rf "$OUT"
