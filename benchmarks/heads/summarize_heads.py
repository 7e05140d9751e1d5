"""Print the README's summary table of the head benchmark from its recorded JSON results.

python -m benchmarks.heads.summarize_heads benchmarks/results/heads-cpu-*/heads.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCABS = (10_000, 33_278, 100_000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("heads_json", nargs="+", help="heads.json files of `highrank bench heads`")
    paths = parser.parse_args(argv).heads_json
    cells: dict[tuple[str, int], dict] = {}
    for path in paths:
        try:
            rows = json.loads(Path(path).read_text(encoding="utf-8"))["rows"]
        except (OSError, ValueError, KeyError) as error:
            parser.error(f"{path}: not a heads.json of `highrank bench heads` ({error})")
        for row in rows:
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
    raise SystemExit(main())
