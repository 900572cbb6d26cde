#!/usr/bin/env bash
# The one device driver (run from the repo root on the GPU machine):
#
#   bash benchmarks/device.sh [--no-tests] [--sanitize] [--profile] [PLAN ...]
#
#   1. the GPU test suite (pytest -m gpu, -n 8 with pytest-xdist) -> pytest_gpu.txt
#   2. convolab verify --device gpu                             -> verify.txt
#   3. each PLAN (a name in benchmarks/plans/ or a path): convolab bench --plan -> PLAN/
#   4. --sanitize: benchmarks/sanitize.py (every GPU kernel once, checked against fp64) under
#      compute-sanitizer memcheck, racecheck, initcheck, synccheck, each limited to
#      $SANITIZE_LIMIT s (default 130; $SANITIZE_TOOLS picks tools)  -> sanitize_<tool>.txt,
#      sanitize_summary.txt (per tool: errors, racecheck hazards, launches checked)
#   5. --profile: convolab profile (Nsight Compute) on the model's layers -> profile.json
#
# Everything lands in one dated folder: $OUT/<date>_<gpu>_device, or benchmarks/results/...
# when $OUT is unset. Each step is guarded, so one failure does not lose the others' results.
# Nothing here imports Numba (broken on the device image); no network access is needed.
#   e.g.  bash benchmarks/device.sh closing network
set -u
export PYTHONPATH=src CONVOLAB_DATA=${CONVOLAB_DATA:-.data} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
TESTS=1 SANITIZE=0 PROFILE=0 PLANS=()
for arg in "$@"; do
  case "$arg" in
    --no-tests) TESTS=0 ;;
    --sanitize) SANITIZE=1 ;;
    --profile) PROFILE=1 ;;
    -*) echo "unknown option $arg" >&2; exit 2 ;;
    *) PLANS+=("$arg") ;;
  esac
done
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
SLUG=$(echo "${GPU:-cpu}" | grep -oiE '[A-Z]+[0-9]+[A-Z]?' | head -1 | tr 'A-Z' 'a-z')
DIR="${OUT:-benchmarks/results}/$(date +%F)_${SLUG:-gpu}_device"
mkdir -p "$DIR"
stamp() { echo "== $(date +%T) $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$DIR/gpu.txt" 2>&1
status=0

if [ "$TESTS" = 1 ]; then
  stamp "pytest -m gpu"
  # The suite is mostly NVRTC builds (CPU-bound): with pytest-xdist, workers share the GPU and
  # the on-disk cubin cache, and the wgmma builds are warmed in parallel first (2:41 vs ~9 min).
  XDIST=()
  if $PY -c "import xdist" 2>/dev/null; then
    XDIST=(-n "${GPU_TEST_WORKERS:-8}")
    $PY benchmarks/wgmma_warm.py > "$DIR/wgmma_warm.txt" 2>&1 || status=1
  fi
  $PY -m pytest -q -p no:cacheprovider "${XDIST[@]}" -m gpu tests > "$DIR/pytest_gpu.txt" 2>&1 \
    || status=1
  tail -n 3 "$DIR/pytest_gpu.txt"
  stamp "verify --device gpu"
  $PY -m convolab verify --device gpu > "$DIR/verify.txt" 2>&1 || status=1
  tail -n 3 "$DIR/verify.txt"
fi

for plan in "${PLANS[@]}"; do
  file="$plan"
  [ -f "$file" ] || file="benchmarks/plans/$plan.toml"
  name=$(basename "$file" .toml)
  stamp "bench --plan $file"
  $PY -m convolab bench --plan "$file" --out "$DIR/$name" > "$DIR/$name.txt" 2>&1 || status=1
  tail -n 40 "$DIR/$name.txt"
done

if [ "$SANITIZE" = 1 ]; then
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -n "$SAN" ]; then
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
      stamp "compute-sanitizer $tool (limit ${SANITIZE_LIMIT:-130} s)"
      timeout -k 10 "${SANITIZE_LIMIT:-130}" "$SAN" --tool "$tool" --error-exitcode 1 \
        $PY benchmarks/sanitize.py > "$DIR/sanitize_$tool.txt" 2>&1 || status=1
      tail -n 2 "$DIR/sanitize_$tool.txt"
    done
    $PY benchmarks/sanitize.py --summarize "$DIR" || status=1
  else
    echo "compute-sanitizer not found: skipped" | tee "$DIR/sanitize_summary.txt"
  fi
fi

if [ "$PROFILE" = 1 ]; then
  stamp "profile"
  $PY -m convolab profile --json "$DIR/profile.json" > "$DIR/profile.txt" 2>&1 || status=1
  tail -n 20 "$DIR/profile.txt"
fi
stamp "done: $DIR (status $status)"
exit $status
