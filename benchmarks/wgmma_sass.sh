#!/usr/bin/env bash
# SASS census of rung 44 for the zoo's conv2 at its default pitch (device machine: needs nvcc
# and cuobjdump): HGMMA / HMMA / LDS / BAR counts, registers and ptxas's notes (serialized wgmmas show here).
set -u
cd src/convolab/kernels
for prec in 0 3; do
  for shape in "-DFW_C=12 -DFW_H=29 -DFW_W=29 -DFW_WS=35 -DFW_M=24 -DFW_K=7" \
               "-DFW_C=12 -DFW_H=33 -DFW_W=33 -DFW_WS=38 -DFW_M=24 -DFW_K=5"; do
    echo "== FW_PREC=$prec $shape"
    nvcc -gencode=arch=compute_90a,code=sm_90a -cubin -Xptxas -v -DFW_PREC=$prec $shape \
      -o /tmp/k44.cubin 44_fused_conv_pool_wgmma.cu 2>&1 | grep -E "registers|warning|spill"
    cuobjdump -sass /tmp/k44.cubin > /tmp/k44.sass
    for op in HGMMA HMMA LDS WARPGROUP.ARRIVE WARPGROUP.DEPBAR BAR.SYNC; do
      printf '%s %s\n' "$op" "$(grep -c "$op" /tmp/k44.sass)"
    done
  done
done
