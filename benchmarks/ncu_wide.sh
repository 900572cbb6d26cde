#!/usr/bin/env bash
# Nsight Compute (and SASS) on the wide zoo conv2 (eecs498's, B = 10000), one launch each
# (benchmarks/layer_once.py). Run from the repo root on the device machine.
#   bash benchmarks/ncu_wide.sh OUT.txt            rung 28 against rung 44, fp16 and 3xfp16:
#                                                  the sections that say what bounds a kernel
#   bash benchmarks/ncu_wide.sh OUT.txt stalls     rung 44 only: why its warps wait (stall
#                                                  reasons per issued instruction, and the
#                                                  SASS lines the samples land on)
#   bash benchmarks/ncu_wide.sh OUT.txt sass       rung 44's SASS census at the zoo's conv2
#                                                  (needs nvcc and cuobjdump, no GPU): ptxas's
#                                                  registers and notes (serialized wgmmas show
#                                                  here), HGMMA / LDS / ARRIVE / DEPBAR counts
set -u
export PYTHONPATH=src
OUT_FILE=${1:-ncu_wide.txt}
if [ "${2:-}" = sass ]; then
  for prec in 0 3; do
    for shape in "-DFW_C=12 -DFW_H=29 -DFW_W=29 -DFW_WS=35 -DFW_M=24 -DFW_K=7 -DFW_TAILS=1" \
                 "-DFW_C=12 -DFW_H=33 -DFW_W=33 -DFW_WS=38 -DFW_M=24 -DFW_K=5"; do
      echo "== FW_PREC=$prec $shape"
      nvcc -gencode=arch=compute_90a,code=sm_90a -cubin -Xptxas -v -DFW_PREC=$prec $shape \
        -o /tmp/k44.cubin src/convolab/kernels/44_fused_conv_pool_wgmma.cu 2>&1 \
        | grep -E "registers|warning|spill"
      cuobjdump -sass /tmp/k44.cubin > /tmp/k44.sass
      for op in HGMMA HMMA LDS WARPGROUP.ARRIVE WARPGROUP.DEPBAR BAR.SYNC; do
        printf '%s %s\n' "$op" "$(grep -c "$op" /tmp/k44.sass)"
      done
    done
  done > "$OUT_FILE" 2>&1
  exit
fi
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
