#!/usr/bin/env bash
# Nsight Compute on the wide zoo conv2 (eecs498's, B = 10000), one launch each
# (benchmarks/layer_once.py). Run from the repo root on the device machine.
#   bash benchmarks/ncu_wide.sh OUT.txt            rung 28 against rung 44, fp16 and 3xfp16:
#                                                  the sections that say what bounds a kernel
#   bash benchmarks/ncu_wide.sh OUT.txt stalls     rung 44 only: why its warps wait (stall
#                                                  reasons per issued instruction, and the
#                                                  SASS lines the samples land on)
set -u
export PYTHONPATH=src
OUT_FILE=${1:-ncu_wide.txt}
if [ "${2:-}" = stalls ]; then
  ncu --profile-from-start off --section WarpStateStats --section SourceCounters \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      python3 benchmarks/layer_once.py --shape 10000,12,29,29,24,7 \
      fused-conv-pool2-wgmma-tc fused-conv-pool2-wgmma-3xfp16 > "$OUT_FILE" 2>&1
  exit
fi
ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
    --section Occupancy --section LaunchStats \
    python3 benchmarks/layer_once.py --shape 10000,12,29,29,24,7 \
    fused-conv-pool2-wide-tc fused-conv-pool2-wgmma-tc \
    fused-conv-pool2-wide-3xfp16 fused-conv-pool2-wgmma-3xfp16 > "$OUT_FILE" 2>&1
