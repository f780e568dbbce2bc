"""Sums Nsight Compute's per-instruction stall samples: which SASS instructions a kernel's warps wait at, and why.

    python3 benchmarks/stall_ledger.py SOURCE.csv [TOP]

SOURCE.csv is ``ncu --import REPORT --page source --csv --print-source sass`` of a report collected with the
SourceCounters section (``h200_run.sh profile`` makes one). Prints the share of all warp samples per stall reason,
then the TOP (default 25) instructions by samples, each with its offset, its text and its three largest reasons.
"""

from __future__ import annotations

import csv
import sys
from collections import Counter

ALL = "Warp Stall Sampling (All Samples)"


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25
    with open(path, newline="") as f:
        # a "Kernel Name" line (and Nsight Compute's own "==" messages) may come before the header
        lines = [line for line in f if not line.startswith(("==", '"Kernel Name"'))]
    rows = list(csv.DictReader(lines))
    if not rows or ALL not in rows[0]:
        raise SystemExit(f"{path}: no '{ALL}' column; columns: {list(rows[0]) if rows else 'none'}")
    # per-reason columns (all samples; each also has a "(Not Issued)" twin, left out)
    reasons = [c for c in rows[0] if c.startswith("stall_") and not c.endswith("(Not Issued)")]
    text = next((c for c in ("Source", "SASS", "Instruction") if c in rows[0]), None)
    total = sum(number(r[ALL]) for r in rows) or 1.0
    by_reason = Counter({c: sum(number(r[c]) for r in rows) for c in reasons})
    print(f"{len(rows)} instructions, {total:.0f} samples")
    for c, n in by_reason.most_common(12):
        if n:
            print(f"  {c:<40} {100 * n / total:5.1f}%")
    base = int(rows[0].get("Address", "0"), 16)
    print(f"top {top} instructions by samples (address from the kernel's first instruction):")
    for r in sorted(rows, key=lambda r: -number(r[ALL]))[:top]:
        # samples whose reason this Nsight Compute exports in no column (seen on SM90 at wgmma issue) count as "other"
        counts = {c: number(r[c]) for c in reasons}
        counts["other"] = number(r[ALL]) - sum(counts.values())
        why = ", ".join(f"{c} {100 * n / total:.1f}%" for c, n in Counter(counts).most_common(3) if n > 0)
        offset = int(r.get("Address", "0"), 16) - base
        print(f"  {100 * number(r[ALL]) / total:5.1f}% {offset:06x} {r.get(text, '').strip()[:60]:<60} {why}")


if __name__ == "__main__":
    main()
