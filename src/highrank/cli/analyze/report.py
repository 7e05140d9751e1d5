"""``highrank report``: one self-contained HTML page of what trained runs hold
(:func:`highrank.analysis.report.write_report`)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="runs of `highrank train`")
    parser.add_argument("--out", required=True, help="folder for report.html and its files")


def run(args: argparse.Namespace) -> int:
    from highrank.analysis.report import write_report

    path = write_report(args.run_dirs, args.out)
    print(f"wrote {path}")
    return 0
