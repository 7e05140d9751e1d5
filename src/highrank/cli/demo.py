"""``highrank demo``: fit every head to a synthetic language of known rank."""

from __future__ import annotations

import argparse
import sys

from highrank.cli.choices import DEMO_DEFAULTS, HEAD_NAMES, PAPER_HEAD_NAMES
from highrank.cli.common import head_list, non_negative_int, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options, from torch-free defaults (``DEMO_DEFAULTS``, equal to ``DemoSettings()``:
    tests/cli/test_cli.py), so ``highrank demo --help`` and its errors import no torch."""
    d = argparse.Namespace(**DEMO_DEFAULTS)
    parser.add_argument(
        "--rank", type=positive_int, default=d.rank, help="true rank r (default %(default)s)"
    )
    parser.add_argument(
        "--dim",
        type=positive_int,
        default=d.dim,
        help="context and embedding size d of every head (default %(default)s)",
    )
    parser.add_argument(
        "--vocab",
        type=positive_int,
        default=d.vocab,
        help="vocabulary size V (default %(default)s)",
    )
    parser.add_argument(
        "--contexts",
        type=positive_int,
        default=d.contexts,
        help="number of contexts N (default %(default)s)",
    )
    parser.add_argument(
        "--heads",
        type=head_list,
        default=d.heads,
        help=f"comma-separated heads, from {','.join(HEAD_NAMES)} (default: the seven "
        f"papers' heads, {','.join(PAPER_HEAD_NAMES)}; mlp_softmax, the capacity control, only "
        "when named)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=d.steps,
        help="Adam steps per head (default %(default)s)",
    )
    parser.add_argument(
        "--seed", type=non_negative_int, default=d.seed, help="random seed (default %(default)s)"
    )
    parser.add_argument(
        "--mixtape-frequent-fraction",
        type=float,
        default=d.mixtape_frequent_fraction,
        help="share of tokens with their own Mixtape gates (default 1.0: every token; the "
        "paper's 0.1 shares one prior among 90%% of the tokens)",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=d.threads,
        help="torch threads while fitting (default 1: reproducible whatever the machine's load)",
    )
    parser.add_argument(
        "--out",
        default="demo-out",
        help="output folder for results.json and the plot (default %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    from highrank.demo import DemoSettings, format_table, reading, run_demo

    try:
        settings = DemoSettings(
            rank=args.rank,
            dim=args.dim,
            vocab=args.vocab,
            contexts=args.contexts,
            heads=args.heads,
            steps=args.steps,
            seed=args.seed,
            mixtape_frequent_fraction=args.mixtape_frequent_fraction,
            threads=args.threads,
        )
    except ValueError as error:
        args.parser.error(str(error))  # exits with status 2
    for note in settings.notes():
        print(f"note: {note}", file=sys.stderr)
    results = run_demo(settings, args.out, progress=not args.no_progress)
    print(format_table(results))
    print(reading(results))
    print(f"total {results['total_seconds']:.1f} s; wrote results.json and the plot to {args.out}")
    return 0
