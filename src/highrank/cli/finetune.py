"""``highrank finetune``: averaged SGD restarted from a trained run's best checkpoint."""

from __future__ import annotations

import argparse

from highrank.cli.common import add_overrides, guarded
from highrank.cli.train import add_run_options, flags, result_line, train_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of `highrank train`")
    parser.add_argument(
        "--resume", action="store_true", help="continue an interrupted finetuning exactly"
    )
    parser.add_argument(
        "--which",
        choices=("best", "last"),
        default="best",
        help="start from this checkpoint's evaluation weights (best; last when the run has "
        "no epoch end yet)",
    )
    add_run_options(parser)
    add_overrides(parser)


def run(args: argparse.Namespace) -> int:
    from highrank import train as training

    command = ["highrank", "finetune", args.run_dir, *(["--resume"] if args.resume else [])]
    command += ["--which", args.which] if args.which != "best" else []
    command += flags(args)

    def job() -> int:
        result = training.finetune(
            args.run_dir,
            resume=args.resume,
            which=args.which,
            overrides=args.overrides,
            options=train_options(args),
            command=command,
        )
        print(result_line(result))
        return 0

    return guarded("finetune", job)
