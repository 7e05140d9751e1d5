"""``highrank dynamic-eval``: dynamic evaluation (Krause et al. 2017) of a trained run."""

from __future__ import annotations

import argparse

from highrank.cli.common import guarded, positive_int
from highrank.cli.evaluate import add_eval_options, load_for_eval, report_eval, split_ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_eval_options(parser)
    for flag, meaning in (("--lr", "eta"), ("--epsilon", "epsilon"), ("--prior-decay", "lambda")):
        parser.add_argument(flag, type=float, help=f"{meaning} (default: the run's [dynamic_eval])")
    parser.add_argument(
        "--max-stats-batches",
        type=positive_int,
        help="gradient statistics from only this many training segments (default: all)",
    )


def run(args: argparse.Namespace) -> int:
    from highrank.data.streaming import split_stream
    from highrank.evaluate.dynamic import (
        dynamic_evaluate,
        gradient_statistics,
        refuse_transformer_dynamic_eval,
    )
    from highrank.evaluate.perplexity import evaluate_perplexity

    def job() -> int:
        model, config, corpus = load_for_eval(args)
        refuse_transformer_dynamic_eval(config)
        settings = config.dynamic_eval
        stats = gradient_statistics(
            model,
            split_stream(corpus, "train"),  # a data.memmap run's map: never read whole
            batch_size=settings.stats_batch_size,
            bptt=settings.bptt,
            progress=not args.no_progress,
            max_batches=args.max_stats_batches,
            name=str(corpus.path("train")),
        )
        knobs = {
            "lr": settings.lr if args.lr is None else args.lr,
            "epsilon": settings.epsilon if args.epsilon is None else args.epsilon,
            "prior_decay": settings.prior_decay if args.prior_decay is None else args.prior_decay,
        }
        # The same tokens in the same segments, without adapting: the figure to compare with.
        static = evaluate_perplexity(
            model,
            split_ids(args, corpus),
            batch_size=settings.batch_size,
            bptt=settings.bptt,
            progress=not args.no_progress,
            name=f"static {corpus.path(args.split)}",
        )
        result = dynamic_evaluate(
            model,
            split_ids(args, corpus),
            stats,
            **knobs,
            batch_size=settings.batch_size,
            bptt=settings.bptt,
            progress=not args.no_progress,
            name=str(corpus.path(args.split)),
        )
        extra = {
            **knobs,
            "batch_size": settings.batch_size,
            "bptt": settings.bptt,
            "max_stats_batches": args.max_stats_batches,
            "static_perplexity": static.perplexity,
        }
        report_eval(args, "dynamic-eval", result, extra, corpus)
        print(f"static perplexity of the same {static.tokens:,} tokens in the same segments "
              f"(no adaptation): {static.perplexity:.2f}")
        return 0

    return guarded("dynamic-eval", job)
