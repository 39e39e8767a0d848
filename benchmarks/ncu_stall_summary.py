"""Sum Nsight Compute's sampled warp stalls over a kernel's SASS (the ``--page source --csv`` export of a report
taken with ``--section WarpStateStats --section SourceCounters``): stall reasons over all instructions, then the
instructions with the most samples and their top reasons.

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv
    python benchmarks/ncu_stall_summary.py sass.csv [--top 40]
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from pathlib import Path


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def summarize(path: Path, top: int) -> str:
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))  # after the kernel-name line
    rows = list(csv.DictReader(lines[start:]))
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    total_col = next((c for c in rows[0] if c.strip() == "Warp Stall Sampling (All Samples)"), None)
    src_col = next((c for c in rows[0] if c.strip() in ("Source", "SASS")), None)
    by_reason: Counter = Counter()
    per_inst = []
    for r in rows:
        stalls = Counter({c: _number(r[c]) for c in reasons})
        by_reason.update(stalls)
        total = _number(r[total_col]) if total_col else sum(stalls.values())
        per_inst.append((total, r.get("Address", ""), r.get(src_col, "") if src_col else "", stalls))
    grand = sum(t for t, *_ in per_inst) or 1.0
    out = [f"total samples {grand:.0f}"]
    out += [f"{name:34s} {n:7.0f} {100 * n / grand:5.1f}%" for name, n in by_reason.most_common() if n]
    out.append("--- top instructions by samples")
    for total, addr, src, stalls in sorted(per_inst, key=lambda x: -x[0])[:top]:
        why = [(name.replace("stall_", ""), n) for name, n in stalls.most_common(3) if n]
        out.append(f"{addr:>18s} {total:6.0f} {100 * total / grand:5.1f}%  {src.strip()[:60]:60s} {why}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    print(summarize(a.csv, a.top))


if __name__ == "__main__":
    main()
