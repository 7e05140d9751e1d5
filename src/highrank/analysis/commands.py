"""The analysis verbs of the command line: ``highrank analyze KIND``, ``compare``, ``report``.

Each analysis module keeps its own command-line glue next to the code it runs, as two
functions, ``add_arguments(parser)`` and ``run(args) -> exit status``; this module only
routes to them, so adding an analysis is adding one entry to :data:`ANALYSES`.

    highrank analyze rank runs/ptb-softmax runs/ptb-mos --split test
"""

from __future__ import annotations

import argparse
import importlib

# kind -> (module under highrank.analysis, one-line help)
ANALYSES: dict[str, tuple[str, str]] = {
    "rank": ("rank_cli", "log-prob matrix, Press and epsilon-effective rank, singular values"),
    "similarity": ("similarity", "word similarity of the input and output embeddings (Spearman)"),
    "kl": ("kl", "expected pairwise KL divergence between next-token distributions"),
    "topk": ("topk", "top-k next tokens of several models side by side, with the reference"),
    "hidden-size": ("hidden_size", "output layer's hidden size from the knee of the spectrum"),
    "unargmaxable": ("unargmaxable", "tokens no hidden state can make the argmax (LP, HiGHS)"),
}


def add_run_arguments(
    parser: argparse.ArgumentParser, *, corpus: bool = True, hf: bool = False
) -> None:
    """The options every analysis of trained runs shares: ``RUN_DIR...`` and ``--which``;
    with ``corpus`` also ``--split`` and ``--data-dir`` (the corpus the contexts come from);
    with ``hf`` RUN_DIRs become optional and ``--hf MODEL --text FILE`` (Hugging Face causal
    LMs, :mod:`highrank.analysis.hf_contexts`) can replace them."""
    parser.add_argument(
        "run_dirs",
        nargs="*" if hf else "+",
        metavar="RUN_DIR",
        help="runs of `highrank train`" + (" (or --hf MODEL --text FILE)" if hf else ""),
    )
    parser.add_argument(
        "--which", default="best", help="checkpoint: best, last, finetuned or a .pt path (best)"
    )
    if corpus:
        parser.add_argument(
            "--split", choices=("train", "valid", "test"), default="test", help="(test)"
        )
        parser.add_argument("--data-dir", help="corpus folder (default: each run's data.dir)")
    if hf:
        from highrank.analysis.hf_contexts import add_hf_arguments

        add_hf_arguments(parser)


def _module(name: str):
    return importlib.import_module(f"highrank.analysis.{name}")


def analyze_arguments(parser: argparse.ArgumentParser) -> None:
    """``highrank analyze KIND ...``: one sub-subcommand per entry of :data:`ANALYSES`."""
    kinds = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    for kind, (module, help_text) in ANALYSES.items():
        sub = kinds.add_parser(kind, help=help_text, description=help_text, allow_abbrev=False)
        _module(module).add_arguments(sub)
        sub.set_defaults(analysis_module=module)


def run_analyze(args: argparse.Namespace) -> int:
    return _module(args.analysis_module).run(args)


def compare_arguments(parser: argparse.ArgumentParser) -> None:
    _module("significance").add_arguments(parser)


def run_compare(args: argparse.Namespace) -> int:
    return _module("significance").run(args)


def report_arguments(parser: argparse.ArgumentParser) -> None:
    _module("report").add_arguments(parser)


def run_report(args: argparse.Namespace) -> int:
    return _module("report").run(args)
