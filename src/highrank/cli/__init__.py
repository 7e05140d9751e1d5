"""The ``highrank`` command line: a table of verbs, each verb a small module of this package.

A verb is a :class:`Verb`: a name, a one-line help, ``add_arguments(parser)`` that declares
its options on its subparser and ``run(args) -> int`` that does it and returns the exit status.
Each lives in ``highrank/cli/<verb>.py`` (shared option types, config overrides and the error
guard in :mod:`highrank.cli.common`); :data:`VERBS` lists them in the order ``highrank --help``
shows, so adding a verb is one module and one entry. Verb modules import the library inside
their functions and declare their options from torch-free constants (head names, bench cases,
the analyses' defaults: :mod:`highrank.cli.choices`, each held equal to the library's by
tests/cli/test_cli.py); :func:`main` declares a verb's options only when that verb is used (the
config keys only when a ``--section.key`` is given). So ``highrank --help``, every verb's and
sub-verb's ``--help`` and argparse's errors import no torch, numpy, scipy or optional extra,
and the verbs check the paths they are given (missing, a file for a folder) before they import
the library (tests/test_layering.py runs them all).

    highrank demo --rank 32 --dim 8 --out demo-out
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from highrank import __version__
from highrank.cli import (
    analyze,
    bench,
    compare,
    config,
    data,
    demo,
    dynamic_eval,
    evaluate,
    finetune,
    report,
    retrofit,
    train,
    translate,
)
from highrank.cli.common import Parser, config_keys, non_negative_int, positive_int


@dataclass(frozen=True)
class Verb:
    """A subcommand: ``add_arguments(parser)`` declares its options, ``run(args)`` does it."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _verb(name: str, help: str, module) -> Verb:
    return Verb(name, help, module.add_arguments, module.run)


VERBS: list[Verb] = [
    _verb(
        "demo",
        "fit every head to a synthetic language of known rank (the softmax bottleneck)",
        demo,
    ),
    _verb("data", "corpora: get a benchmark corpus (checked), statistics, synthetic Zipf", data),
    _verb("bench", "benchmark the heads' time and peak memory against a naive softmax", bench),
    _verb("train", "train a language model from a TOML config (or --resume a run exactly)", train),
    _verb(
        "finetune",
        "finetune a trained run: averaged SGD restarted from its best checkpoint",
        finetune,
    ),
    _verb("config", "show a resolved config and its parameter count", config),
    _verb("eval", "perplexity of a trained run on a split (hidden state carried)", evaluate),
    _verb(
        "translate",
        "translate a split with a translation run and score it (sacreBLEU)",
        translate,
    ),
    _verb("dynamic-eval", "dynamic evaluation (Krause et al. 2017) of a trained run", dynamic_eval),
    _verb(
        "analyze",
        "measure the bottleneck of trained runs or HF models: rank, KL, top-k, word "
        "similarity, hidden size, unargmaxable tokens, saturation, gradient bottleneck",
        analyze,
    ),
    _verb(
        "compare",
        "compare two groups of runs (seeds): t-test on perplexity, rank vs perplexity",
        compare,
    ),
    _verb(
        "report",
        "one self-contained HTML page of what trained runs hold (tables and plots)",
        report,
    ),
    _verb(
        "retrofit",
        "a warm-started high-rank head on your own causal LM, trained and saved in one command",
        retrofit,
    ),
]


def build_parser(*, lazy: bool = False) -> argparse.ArgumentParser:
    """The top-level parser with one subparser per entry of ``VERBS``.

    With ``lazy`` (what :func:`main` uses) a verb's options are declared only when that verb
    is parsed or its help printed (:class:`~highrank.cli.common.Parser`), so building the
    parser, ``highrank --help`` and the errors of the top level import nothing but argparse;
    without, every option of every verb is declared now (for tests and tools that walk it)."""
    parser = Parser(
        prog="highrank",
        allow_abbrev=False,  # --head.n_component=3 must not silently mean n_components
        description="Output layers that break the softmax bottleneck, and the instruments "
        "that measure it.",
    )
    parser.add_argument("--version", action="version", version=f"highrank {__version__}")
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb in VERBS:
        sub = subparsers.add_parser(
            verb.name, help=verb.help, description=verb.help, allow_abbrev=False
        )
        sub.declare_later(verb.add_arguments)
        sub.set_defaults(run=verb.run, parser=sub)
        if not lazy:
            _declare_everything(sub)
    return parser


def _declare_everything(parser: argparse.ArgumentParser) -> None:
    """Every pending declaration of ``parser`` and of the subparsers it has then."""
    if isinstance(parser, Parser):
        parser.declare_now()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _declare_everything(sub)


def main(argv: list[str] | None = None) -> int:
    """Run ``highrank`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    let_idle_openmp_threads_sleep()
    parser = build_parser(lazy=True)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _reject_unknown(parser, args, unknown)
    return args.run(args)


def let_idle_openmp_threads_sleep() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets ``OMP_WAIT_POLICY`` or
    ``GOMP_SPINCOUNT``: torch's OpenMP threads sleep as soon as they wait, instead of spinning
    first (libgomp's default: 300,000 spins; ``GOMP_SPINCOUNT=300000`` restores it, and
    ``OMP_WAIT_POLICY=ACTIVE`` spins far longer, 30 billion, as the libgomp manual says).

    Every operator is a parallel region ending at a barrier, where libgomp's threads spin for
    a while before they sleep. With another process busy on the machine, one of our threads is
    often off its core while its partner spins on the core it needs, once per operator; the
    heads whose chunked loss runs thousands of small operators per step (MoS, Mixtape, the
    chunked softmax) lost far more than the naive softmax's few large ones
    (``benchmarks/heads/heads_under_load.py``, results in ``benchmarks/results/heads-under-load``).
    libgomp reads the variable once, when torch loads it: this runs before any verb imports
    torch, and changes nothing in a process that already has (a script importing highrank
    sets it itself, before ``import torch``). It does change ``os.environ`` of the calling
    process, so what that process starts later inherits it (torchrun workers each run this
    themselves). A run's ``environment.json`` records the variable as the run saw it.
    """
    user_chose = {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys()
    if "torch" not in sys.modules and not user_chose:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def _reject_unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown) -> None:
    """argparse's error for unknown arguments, naming the closest config keys for a
    ``--section.key`` that is not one (``--train.lrr=20``: did you mean train.lr?)."""
    import difflib

    verb_parser = getattr(args, "parser", parser)
    if isinstance(verb_parser, Parser):
        verb_parser.declare_now()  # the config keys too: a suggestion may name one
    for argument in unknown:
        name = argument.removeprefix("--").split("=", 1)[0]
        if argument.startswith("--") and "." in name:
            close = difflib.get_close_matches(name, config_keys(), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            verb_parser.error(
                f"unknown config key {name!r}{hint} (`highrank config show` lists every key)"
            )
    options = [o for action in verb_parser._actions for o in action.option_strings]
    for argument in unknown:
        name = argument.split("=", 1)[0]
        close = difflib.get_close_matches(name, options, n=3) if name.startswith("--") else []
        if close:  # abbreviations are refused (allow_abbrev=False): say what was meant
            verb_parser.error(f"unrecognized option {name!r}; did you mean {', '.join(close)}?")
    verb_parser.error(f"unrecognized arguments: {' '.join(unknown)}")


__all__ = ["VERBS", "Verb", "build_parser", "main", "non_negative_int", "positive_int"]
