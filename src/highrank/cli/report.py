"""``highrank report``: one self-contained HTML page of what trained runs hold
(:mod:`highrank.analysis.report`, routed by :mod:`highrank.analysis.commands`)."""

from __future__ import annotations

import argparse

from highrank.cli.common import guarded


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from highrank.analysis.commands import report_arguments

    report_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from highrank.analysis.commands import run_report

    return guarded("report", lambda: run_report(args))
