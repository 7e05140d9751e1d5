"""``highrank analyze KIND``: rank, KL, top-k, word similarity of trained runs; each KIND is a
module of :mod:`highrank.analysis`, routed by :mod:`highrank.analysis.commands`."""

from __future__ import annotations

import argparse

from highrank.cli.common import guarded


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from highrank.analysis.commands import analyze_arguments

    analyze_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from highrank.analysis.commands import run_analyze

    return guarded("analyze", lambda: run_analyze(args))
