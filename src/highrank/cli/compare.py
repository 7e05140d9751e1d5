"""``highrank compare``: two groups of runs (seeds), t-test on perplexity, rank vs perplexity
(:mod:`highrank.analysis.significance`, routed by :mod:`highrank.analysis.commands`)."""

from __future__ import annotations

import argparse

from highrank.cli.common import guarded


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from highrank.analysis.commands import compare_arguments

    compare_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from highrank.analysis.commands import run_compare

    return guarded("compare", lambda: run_compare(args))
