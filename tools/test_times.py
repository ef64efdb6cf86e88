"""Print the wall time of each part of `make test` (seconds, slowest first) and the total, from the TSV that
the Makefile's test target writes (`<seconds>\t<part>` per line)."""

from __future__ import annotations

import sys
from pathlib import Path

BUDGET_MIN = 35  # make test on a quiet machine; CI's hard limit is 90


def main(path: str) -> None:
    rows = []
    for line in Path(path).read_text().splitlines():
        secs, _, part = line.partition("\t")
        if part:
            rows.append((int(secs), part))
    total = sum(s for s, _ in rows)
    print("\nwall time per part of make test (slowest first)")
    for secs, part in sorted(rows, reverse=True):
        print(f"{secs // 60:4d}:{secs % 60:02d}  {part}")
    print(f"{total // 60:4d}:{total % 60:02d}  total (budget {BUDGET_MIN}:00 on a quiet machine)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".test-times.tsv")
