"""Render a `convolab bench --json` file as the Markdown table in docs/ladder.md.

    python3 benchmarks/ladder_table.py benchmarks/results/bench_final_h100_2026-11-23.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def cell(row: dict | None) -> str:
    if row is None:
        return "—"
    if row.get("status") != "ok" or not row.get("op"):
        return row.get("status", "—")
    op = row["op"]
    speed = row.get("speedup_vs_anchor")
    x = f", {speed:.1f}×" if speed else ""
    return f"{op['median_ms']:.3f} (±{op['spread_pct']:.0f}%{x})"


def main(path: str) -> None:
    with open(path) as f:
        report = json.load(f)
    cases = [c["label"] for c in report["cases"]]
    by_impl: dict[str, dict[str, dict]] = defaultdict(dict)
    order: list[str] = []
    rungs: dict[str, str] = {}
    for row in report["rows"]:
        name = row["impl"]
        if name not in by_impl:
            order.append(name)
        by_impl[name][row["case"]] = row
        rungs[name] = "anchor" if row.get("anchor") else str(row.get("rung") or row["device"])
    print(f"Device: {report['device']}, {report['date'][:10]}, B={report['batch']}, "
          f"median of {report['reps']} (spread = p10–p90 / median), ×: speed-up vs cuDNN fp32.\n")
    print("| impl | rung | " + " | ".join(f"{c} Op Time ms" for c in cases) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in cases) + " |")
    for name in order:
        print(f"| {name} | {rungs[name]} | "
              + " | ".join(cell(by_impl[name].get(c)) for c in cases) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
