#!/usr/bin/env bash
# ncu metrics for the kernels under study (one device call, ~1-2 min):
#   bash benchmarks/device_ncu.sh   -> $OUT/ncu.csv, $OUT/ncu.txt
# Metrics: FMA-pipe and LSU issue, shared wavefronts, L1 hit rate, occupancy, stall reasons.
set -u
OUT=${OUT:-/tmp/convolab-ncu}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
M=gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active
M=$M,smsp__issue_active.avg.pct_of_peak_sustained_active
M=$M,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active
M=$M,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active
M=$M,sm__inst_executed_pipe_uniform.avg.pct_of_peak_sustained_active
M=$M,smsp__inst_executed.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_global_ld.sum
M=$M,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum
M=$M,l1tex__t_sector_hit_rate.pct,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum
M=$M,l1tex__data_pipe_lsu_wavefronts_mem_global_op_ld.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,l1tex__throughput.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem
for s in long_scoreboard short_scoreboard mio_throttle lg_throttle math_pipe_throttle barrier wait not_selected selected no_instruction dispatch_stall tex_throttle; do
  M=$M,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio
done
PYTHONPATH=src timeout 240 "$NCU" --metrics "$M" --csv --page raw \
  -k regex:"fcp_exact|fcp_mma|lenet_head" python3 benchmarks/ncu_targets.py \
  > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
echo "ncu rc=$?"; tail -3 "$OUT/ncu.err"
python3 - "$OUT/ncu.csv" <<'PY' | tee "$OUT/ncu.txt"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r and not r[0].startswith("==")]
start = next(i for i, r in enumerate(rows) if r[0] == "ID")  # the program's own output first
head, units, data = rows[start], rows[start + 1], rows[start + 2:]
keep = [i for i, h in enumerate(head) if h in ("Kernel Name",) or "__" in h]
for r in data:
    print("----", r[head.index("Kernel Name")][:40])
    for i in keep:
        if "__" in head[i]:
            print(f"  {head[i]:78s} {r[i]:>14s} {units[i]}")
PY
