"""``highrank analyze similarity``: Spearman correlation of the input and output
embeddings' cosines with human word-similarity scores (:mod:`highrank.analysis.similarity`)."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from highrank.cli.analyze.common import add_run_arguments
from highrank.cli.choices import WORD_SIM_DIR
from highrank.util.atomic import write_text_atomic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``highrank analyze similarity``."""
    add_run_arguments(parser, corpus=False)
    parser.add_argument(
        "--data-dir",
        help=f"folder of the benchmark files (default {WORD_SIM_DIR} if it exists)",
    )
    parser.add_argument(
        "--benchmarks",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        help="comma-separated benchmark names, e.g. EN-WS-353-ALL,EN-SIMLEX-999 (default all)",
    )
    parser.add_argument("--out", help="also write similarity.json and similarity.md here")
    parser.add_argument(
        "--no-progress", action="store_true", help="accepted as by every verb (nothing is slow)"
    )


def resolve_data_dir(data_dir: str | None) -> Path:
    """``--data-dir``, or :data:`~highrank.analysis.similarity.DEFAULT_DATA_DIR` (its copy
    :data:`~highrank.cli.choices.WORD_SIM_DIR`) when it exists."""
    from highrank.analysis.similarity import WordSimError

    if data_dir is not None:
        return Path(data_dir)
    if WORD_SIM_DIR.is_dir():
        return WORD_SIM_DIR
    raise WordSimError(
        f"no --data-dir given and the default {WORD_SIM_DIR} does not exist (relative to "
        f"{Path.cwd()}); pass --data-dir DIR, the folder holding EN-WS-353-ALL.txt and the "
        "other word-sim files"
    )


HEADERS = ["run", "benchmark", "pairs", "used", "OOV", "Spearman (input)", "Spearman (output)"]


def table_rows(records: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
    """One row per run and benchmark, in :data:`HEADERS` order."""
    rows = []
    for record in records:
        for name, result in record["benchmarks"].items():
            rho = [_finite_or_none(result["spearman"][key]) for key in ("input", "output")]
            counts = [result[key] for key in ("pairs", "pairs_used", "oov_skipped")]
            rows.append([record["run_dir"], name, *counts, *rho])
    return rows


def run(args: argparse.Namespace) -> int:
    """``highrank analyze similarity``: score each run, write its record, print the table."""
    from highrank.analysis.output import run_record_path, text_table, write_json
    from highrank.analysis.similarity import (
        WordSimError,
        analyze_similarity,
        benchmark_paths,
        read_benchmark,
    )

    try:
        paths = benchmark_paths(resolve_data_dir(args.data_dir), args.benchmarks)
        benchmarks = [read_benchmark(path) for path in paths]
    except WordSimError as error:
        print(f"highrank analyze similarity: error: {error}", file=sys.stderr)
        return 2
    records, written = [], []
    for run_dir in args.run_dirs:
        record = analyze_similarity(run_dir, benchmarks, which=args.which)
        written.append(write_json(run_record_path(run_dir, "similarity", _tag(args)), record))
        records.append(record)
    print(text_table(HEADERS, table_rows(records)), end="")
    tied = [record["run_dir"] for record in records if record["tied"]]
    if tied:
        print(f"tied weights (input and output are one tensor): {', '.join(tied)}")
    if args.out:
        written += _write_summary(Path(args.out), records)
    print("wrote " + ", ".join(map(str, written)))
    return 0


def _tag(args: argparse.Namespace) -> str:
    """``best`` for ``--which best``, the file stem for ``--which path/to/x.pt``; with
    ``--benchmarks``, their names too (a subset never replaces the record of all of them)."""
    tag = Path(args.which).stem
    return tag + "-" + "+".join(args.benchmarks) if args.benchmarks else tag


def _write_summary(out: Path, records: list[dict]) -> list[Path]:
    from highrank.analysis.output import text_table, write_json

    title = "# Word similarity: Spearman of embedding cosines vs human scores\n\n"
    table = text_table(HEADERS, table_rows(records), markdown=True)
    return [
        write_json(out / "similarity.json", {"runs": records}),
        write_text_atomic(out / "similarity.md", title + table),
    ]


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
