"""``highrank report``: one self-contained HTML page of what trained runs hold
(:mod:`highrank.analysis.report`; its code is :mod:`highrank.cli.analyze.report`)."""

from __future__ import annotations

import argparse

from highrank.cli.analyze.common import check_paths
from highrank.cli.common import guarded, refuse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from highrank.cli.analyze.report import add_arguments as report_arguments

    report_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from highrank.cli.analyze.report import run as run_report

    # the paths first, one line each, before the library (torch) is imported
    status = refuse("report", check_paths(args, "report.html and its files"))
    return status or guarded("report", lambda: run_report(args))
