#!/usr/bin/env bash
# Nsight Compute on one layer, one launch per named implementation (benchmarks/layer_once.py),
# with the sections that say what bounds a kernel and the stall reasons per issued instruction.
# Run from the repo root on the device machine:
#   bash benchmarks/ncu_layer.sh OUT.txt B,C,H,W,M,K IMPL[:k=v,...] ...
set -u
export PYTHONPATH=src
OUT_FILE=$1 SHAPE=$2
shift 2
ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
    --section Occupancy --section LaunchStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 benchmarks/layer_once.py --shape "$SHAPE" "$@" > "$OUT_FILE" 2>&1
