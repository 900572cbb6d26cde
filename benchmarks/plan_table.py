"""One line per row of a bench plan's results.csv (run, implementation or variant, params,
median ms, relative L2, speed-ups against PyTorch), for reading a device call's results where
the plan's folder does not come back.

    python3 benchmarks/plan_table.py RESULTS.csv
"""

from __future__ import annotations

import csv
import sys


def main() -> None:
    with open(sys.argv[1], newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        ms = row.get("op_median_ms") or row.get("median_ms") or "nan"
        name = (row.get("impl") or row.get("name") or "")[:48]
        what = row.get("params") or row.get("variant") or ""
        err = row.get("rel_l2") or ""
        err = f"{float(err):.2e}" if err else "-"  # a slice of the text would drop the exponent
        print(f"{row['run']:16s} {name:48s} {what:30s} {float(ms):9.4f} "
              f"rel_l2={err:9s} {row.get('status', '')} "
              f"x_eager={row.get('speedup_vs_torch_eager_fp32', '')[:5]} "
              f"x_fp16={row.get('speedup_vs_torch_best_fp16', '')[:5]} "
              f"b2b={row.get('back_to_back_ms', '')[:6]}")


if __name__ == "__main__":
    main()
