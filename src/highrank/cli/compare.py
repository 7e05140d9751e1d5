"""``highrank compare``: two groups of runs (seeds), t-test on perplexity, rank vs perplexity
(:mod:`highrank.analysis.significance`; its code is :mod:`highrank.cli.analyze.compare`)."""

from __future__ import annotations

import argparse

from highrank.cli.common import guarded


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from highrank.cli.analyze.compare import add_arguments as compare_arguments

    compare_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from highrank.cli.analyze.compare import run as run_compare

    return guarded("compare", lambda: run_compare(args))
