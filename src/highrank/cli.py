"""The ``highrank`` command line: one subcommand per verb, each a thin call into the library.

A verb is a ``Verb``: a name, a one-line help, a function that adds its options to its
subparser and a function that runs it and returns the exit status. ``VERBS`` lists them in
the order ``highrank --help`` shows; adding a verb is adding one entry.

    highrank demo --rank 32 --dim 8 --out demo-out
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from highrank import __version__


@dataclass(frozen=True)
class Verb:
    """A subcommand: ``add_arguments(parser)`` declares its options, ``run(args)`` does it."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---- argument types: a bad value is an argparse error naming the option --------------------


def positive_int(text: str) -> int:
    """An integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0; got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0; got {text!r}")
    return value


def head_list(text: str) -> tuple[str, ...]:
    """Comma-separated head names from ``highrank.heads.HEADS``."""
    from highrank.demo import check_head_names

    names = tuple(name.strip() for name in text.split(",") if name.strip())
    try:
        check_head_names(names)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return names


# ---- demo ----------------------------------------------------------------------------------


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    from highrank.demo import DemoSettings
    from highrank.heads import HEADS

    d = DemoSettings()
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
        help=f"comma-separated heads (default all: {','.join(HEADS)})",
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


def _run_demo(args: argparse.Namespace) -> int:
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


VERBS: list[Verb] = [
    Verb(
        "demo",
        "fit every head to a synthetic language of known rank (the softmax bottleneck)",
        _demo_arguments,
        _run_demo,
    ),
]


# ---- entry point ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per entry of ``VERBS``."""
    parser = argparse.ArgumentParser(
        prog="highrank",
        description="Output layers that break the softmax bottleneck, and the instruments "
        "that measure it.",
    )
    parser.add_argument("--version", action="version", version=f"highrank {__version__}")
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb in VERBS:
        sub = subparsers.add_parser(verb.name, help=verb.help, description=verb.help)
        verb.add_arguments(sub)
        sub.set_defaults(run=verb.run, parser=sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``highrank`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    args = build_parser().parse_args(argv)
    return args.run(args)
