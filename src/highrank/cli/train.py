"""``highrank train``: train a language model from a TOML config, or ``--resume`` a run exactly.

Also the options and the result line ``highrank finetune`` shares with it.
"""

from __future__ import annotations

import argparse

from highrank.cli.common import Alias, add_overrides, guarded, positive_int, refuse
from highrank.util.paths import config_file_problem


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """--max-steps, --checkpoint-every, --no-progress."""
    parser.add_argument(
        "--max-steps",
        type=positive_int,
        help="stop after this many steps in total, saving last.pt (resume continues exactly)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=positive_int,
        action=Alias,
        const="train.checkpoint_every",
        dest="overrides",
        metavar="N",
        help="steps between saves of checkpoints/last.pt, besides every epoch end; the same as "
        "--train.checkpoint_every=N (default: the config's, 1000 unless it says otherwise)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def train_options(args: argparse.Namespace):
    from highrank.train import TrainOptions

    return TrainOptions(max_steps=args.max_steps, progress=not args.no_progress)


def flags(args: argparse.Namespace) -> list[str]:
    """The options of a train / finetune command line, for command.txt (``--checkpoint-every
    N`` is among the overrides, written as ``--train.checkpoint_every=N``)."""
    words = [f"--{text}" for text in args.overrides]
    if args.max_steps is not None:
        words += ["--max-steps", str(args.max_steps)]
    return words


def result_line(result) -> str:
    """One line on how a stage ended."""
    how = {"epochs": "all epochs done", "nonmono": "stopped by the non-monotone rule"}
    how["max_steps"] = "stopped at --max-steps (continue with --resume)"
    if result.best_epoch:
        best = f"best validation perplexity {result.best_val_ppl:.2f} (epoch {result.best_epoch})"
    elif result.best_val_loss == float("inf"):  # nothing validated yet (e.g. --max-steps)
        best = "no validation has run yet"
    else:
        best = "no validation improvement"
    return (
        f"{result.stage}: {how.get(result.stop_reason, result.stop_reason)} after "
        f"{result.epochs_completed} epoch(s), {result.steps} steps; {best}; "
        f"run directory {result.run_dir}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="TOML experiment file (see configs/)")
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last checkpoint, exactly (no CONFIG)",
    )
    parser.add_argument(
        "--init-from",
        metavar="SOFTMAX_RUN",
        help="start from a trained softmax run's best weights, with this config's head "
        "warm-started at its distribution (same model settings but [head])",
    )
    add_run_options(parser)
    add_overrides(parser)


def _one_process(args: argparse.Namespace) -> str | None:
    """What the training of the run to start or resume is called when its family trains in
    one process (translation: ``highrank.train.runner.RUN_KINDS``); None otherwise."""
    from pathlib import Path

    from highrank.config import ConfigError, load_config
    from highrank.train.runner import RUN_KINDS

    try:
        if args.resume:
            config = load_config(Path(args.resume) / "config.toml")
        else:
            config = load_config(args.config, args.overrides)
    except (ConfigError, OSError):
        return None  # the training itself reports what is wrong with it
    kind = RUN_KINDS[config.model.backbone]
    return None if kind.torchrun else kind.name


def run(args: argparse.Namespace) -> int:
    if args.config is None and args.resume is None:
        args.parser.error(
            "nothing to train: give a config file (a new run, e.g. highrank train "
            "configs/ptb/awd-lstm-softmax.toml) or --resume RUN_DIR (continue a run)"
        )
    if args.config is not None and args.resume is not None:
        args.parser.error("give either CONFIG (a new run) or --resume RUN_DIR, not both")
    status = args.config and refuse("train", config_file_problem(args.config))  # before torch
    if status:
        return status
    command = ["highrank", "train", *([args.config] if args.config else [])]
    command += [*(["--resume", args.resume] if args.resume else []), *flags(args)]
    if args.init_from is not None:
        if args.resume is not None:
            args.parser.error("--init-from starts a new run; it cannot go with --resume")
        command += ["--init-from", args.init_from]

    def job() -> int:
        from highrank import train as training
        from highrank.config import load_config
        from highrank.train import distributed

        options = train_options(args)
        one_process = _one_process(args)
        if one_process is not None and distributed.only_process_zero(one_process):
            return 0
        if args.resume:
            kwargs = {"overrides": args.overrides, "options": options, "command": command}
            result = training.resume(args.resume, **kwargs)
        else:
            config = load_config(args.config, args.overrides)
            if args.init_from is not None:
                from highrank.train.warm_start import with_base_init

                config = with_base_init(config)
            result = training.train(
                config, options=options, command=command, init_from=args.init_from
            )
        if distributed.is_writer():  # under torchrun: process 0 speaks for all
            print(result_line(result))
        return 0

    return guarded("train", job)
