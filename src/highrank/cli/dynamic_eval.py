"""``highrank dynamic-eval``: dynamic evaluation (Krause et al. 2017) of a trained run."""

from __future__ import annotations

import argparse
import sys

from highrank.cli.common import guarded, positive_int, refuse
from highrank.cli.evaluate import add_eval_options, report_eval
from highrank.util.paths import run_dir_problem


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
    status = refuse("dynamic-eval", run_dir_problem(args.run_dir))  # before torch is imported
    if status:
        return status
    from highrank.data.streaming import split_stream
    from highrank.evaluate.dynamic import (
        dynamic_evaluate,
        gradient_statistics,
        refuse_transformer_dynamic_eval,
        unmeasured_statistics,
    )
    from highrank.evaluate.perplexity import evaluate_perplexity
    from highrank.evaluate.run import eval_record, load_for_eval, split_tokens

    def job() -> int:
        loaded = load_for_eval(args.run_dir, args.which, data_dir=args.data_dir)
        model, config, corpus = loaded.model, loaded.config, loaded.corpus
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
        zeros, names = unmeasured_statistics(stats)
        if zeros:  # steps of lr * grad / epsilon there: a likely divergence, said up front
            print(f"note: {zeros:,} elements of the gradient statistics are 0 (in "
                  f"{', '.join(names)}): the statistics' training segments never reached "
                  "them; more segments (--max-stats-batches) measure them", file=sys.stderr)
        knobs = {
            "lr": settings.lr if args.lr is None else args.lr,
            "epsilon": settings.epsilon if args.epsilon is None else args.epsilon,
            "prior_decay": settings.prior_decay if args.prior_decay is None else args.prior_decay,
        }
        # The same tokens in the same segments, without adapting: the figure to compare with.
        static = evaluate_perplexity(
            model,
            split_tokens(corpus, args.split, args.max_tokens),
            batch_size=settings.batch_size,
            bptt=settings.bptt,
            progress=not args.no_progress,
            name=f"static {corpus.path(args.split)}",
        )
        result = dynamic_evaluate(
            model,
            split_tokens(corpus, args.split, args.max_tokens),
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
        record = eval_record(
            loaded, args.run_dir, args.which, args.split, result, extra,
            max_tokens=args.max_tokens,
        )
        report_eval(args, "dynamic-eval", record)
        print(f"static perplexity of the same {static.tokens:,} tokens in the same segments "
              f"(no adaptation): {static.perplexity:.2f}")
        return 0

    return guarded("dynamic-eval", job)
