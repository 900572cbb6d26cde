#!/usr/bin/env bash
# Nsight Compute on the wide zoo conv2 (eecs498's, B = 10000): rung 28 against rung 44, fp16
# and 3xfp16, one launch each (benchmarks/layer_once.py), the sections that say what bounds a
# kernel. Run from the repo root on the device machine; writes to $1 (default ncu_wide.txt).
set -u
export PYTHONPATH=src
ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
    --section Occupancy --section LaunchStats \
    python3 benchmarks/layer_once.py --shape 10000,12,29,29,24,7 \
    fused-conv-pool2-wide-tc fused-conv-pool2-wgmma-tc \
    fused-conv-pool2-wide-3xfp16 fused-conv-pool2-wgmma-3xfp16 > "${1:-ncu_wide.txt}" 2>&1
