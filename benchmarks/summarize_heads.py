"""Print the README's summary table of the head benchmark from its recorded JSON results.

python benchmarks/summarize_heads.py benchmarks/results/heads-cpu-*/heads.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCABS = (10_000, 33_278, 100_000)


def main(paths: list[str]) -> int:
    cells: dict[tuple[str, int], dict] = {}
    for path in paths:
        for row in json.loads(Path(path).read_text(encoding="utf-8"))["rows"]:
            cells[row["case"], row["vocab_size"]] = row
    cases = list(dict.fromkeys(case for case, _ in cells))
    for case in cases:
        times = [_ratio(cells.get((case, v)), "time_ratio") for v in VOCABS]
        memory = [_ratio(cells.get((case, v)), "memory_ratio") for v in VOCABS]
        print(f"| {case} | " + " | ".join(times + memory) + " |")
    return 0


def _ratio(row: dict | None, key: str) -> str:
    if row is None or row.get(key) is None:
        return "-"
    return f"{row[key]:.2f}x"


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
