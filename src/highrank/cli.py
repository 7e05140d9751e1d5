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


# ---- data stats ----------------------------------------------------------------------------


def _data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["stats"], help="stats: lines, tokens and vocabulary")
    parser.add_argument("directory", help="corpus folder with train.txt, valid.txt, test.txt")
    parser.add_argument("--mode", choices=["word", "char"], default="word", help="token unit")
    parser.add_argument("--cache-dir", help="token-id cache folder (default ~/.cache/highrank)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _run_data(args: argparse.Namespace) -> int:
    import json

    from highrank.data import CorpusError, corpus_stats, format_stats

    try:
        stats = corpus_stats(args.directory, mode=args.mode, cache_dir=args.cache_dir)
    except CorpusError as error:
        print(f"highrank data stats: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


# ---- bench heads ---------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    """Comma-separated positive integers."""
    return [positive_int(part) for part in text.split(",") if part.strip()]


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    from highrank.bench.heads import CASES, DEFAULT_CASES

    parser.add_argument("what", choices=["heads"], help="heads: output-layer time and memory")
    parser.add_argument(
        "--vocab",
        type=_int_list,
        default=[10_000, 33_278, 100_000],
        help="comma-separated vocabulary sizes (default 10000,33278,100000)",
    )
    parser.add_argument(
        "--cases",
        type=lambda text: [c.strip() for c in text.split(",") if c.strip()],
        default=list(DEFAULT_CASES),
        help=f"comma-separated cases from: {', '.join(CASES)}",
    )
    parser.add_argument("--tokens", type=positive_int, default=1400, help="tokens per step")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed runs (median)")
    parser.add_argument("--warmup", type=non_negative_int, default=2, help="untimed runs first")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument(
        "--budget-mb",
        type=float,
        default=None,
        help="also time each head at the largest batch fitting this peak-memory growth (MiB)",
    )
    parser.add_argument("--out", default="bench-out", help="folder for heads.json and heads.md")


def _run_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from highrank.bench.heads import markdown_table, run_benchmark, write_results

    if args.device.startswith("cuda") and not _cuda_available():
        args.parser.error(f"--device {args.device}: CUDA is not available on this machine")
    try:
        result = run_benchmark(
            vocab_sizes=args.vocab,
            labels=args.cases,
            tokens=args.tokens,
            repeats=args.repeats,
            warmup=args.warmup,
            device=args.device,
            budget_mb=args.budget_mb,
            progress=lambda message: print(message, file=sys.stderr),
        )
    except ValueError as error:
        args.parser.error(str(error))
    json_path, md_path = write_results(result, Path(args.out))
    print(markdown_table(result))
    print(f"wrote {json_path} and {md_path}")
    return 0


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


VERBS: list[Verb] = [
    Verb(
        "demo",
        "fit every head to a synthetic language of known rank (the softmax bottleneck)",
        _demo_arguments,
        _run_demo,
    ),
    Verb(
        "data",
        "corpus statistics: lines, tokens with <eos>, vocabulary",
        _data_arguments,
        _run_data,
    ),
    Verb(
        "bench",
        "benchmark the heads' time and peak memory against a naive softmax",
        _bench_arguments,
        _run_bench,
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
