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


# ---- train, finetune, config show ------------------------------------------------------------


class _Override(argparse.Action):
    """``--section.key=value`` (or ``--section.key value``) appended to ``args.overrides`` in
    command-line order, for :func:`highrank.config.load_config`."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        overrides = list(getattr(namespace, "overrides", None) or [])
        overrides.append(f"{option_string.removeprefix('--')}={values}")
        namespace.overrides = overrides


class _Alias(_Override):
    """A flag that stands for one config key (``const``): ``--checkpoint-every 50`` is
    ``--train.checkpoint_every=50``, an override in command-line order like the others."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, f"--{self.const}")


def _config_keys() -> list[str]:
    """Every dotted config key, head knobs of every head included."""
    import dataclasses

    from highrank.config import MODEL_SET_KNOBS, SECTIONS
    from highrank.heads import HEADS, head_knobs

    keys = ["head.name"]
    for section, schema in SECTIONS.items():
        if section != "head":
            keys += [f"{section}.{f.name}" for f in dataclasses.fields(schema)]
    knobs = {k for name in HEADS for k in head_knobs(name) if k not in MODEL_SET_KNOBS}
    return keys + [f"head.{k}" for k in sorted(knobs)]


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    """One ``--section.key`` option per config key (hidden from --help, listed in the epilog)."""
    for key in _config_keys():
        parser.add_argument(f"--{key}", action=_Override, dest="overrides", help=argparse.SUPPRESS)
    parser.set_defaults(overrides=[])
    parser.epilog = (
        "Any config key can be overridden as --section.key=value (e.g. --train.lr=20 "
        "--head.name=mos --run.out_dir=runs/x); `highrank config show` prints them all."
    )


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-steps",
        type=positive_int,
        help="stop after this many steps in total, saving last.pt (resume continues exactly)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=positive_int,
        action=_Alias,
        const="train.checkpoint_every",
        dest="overrides",
        metavar="N",
        help="steps between saves of checkpoints/last.pt, besides every epoch end; the same as "
        "--train.checkpoint_every=N (default: the config's, 1000 unless it says otherwise)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")


def _train_options(args: argparse.Namespace):
    from highrank.train import TrainOptions

    return TrainOptions(max_steps=args.max_steps, progress=not args.no_progress)


def _input_errors() -> tuple[type[Exception], ...]:
    """Errors in what the user gave (config, corpus, run directory): exit status 2."""
    from highrank.checkpoint import CheckpointError
    from highrank.config import ConfigError
    from highrank.data import CorpusError
    from highrank.runs import RunDirError

    return ConfigError, CorpusError, CheckpointError, RunDirError


# What a user does after Ctrl-C, per verb.
_AFTER_INTERRUPT = {
    "train": "continue from the last checkpoint with `highrank train --resume RUN_DIR`",
    "finetune": "continue from the last checkpoint with `highrank finetune RUN_DIR --resume`",
    "analyze": "run the same command again: a kept matrix and the saved Gram matrix are reused",
}


def _guarded(verb: str, job: Callable[[], int]) -> int:
    """Run ``job``; input errors print one line (status 2), divergence status 1, Ctrl-C 130."""
    from highrank.checkpoint import NonFiniteCheckpointError
    from highrank.train import TrainingError

    try:
        return job()
    except (TrainingError, NonFiniteCheckpointError) as error:
        print(f"highrank {verb}: stopped: {error}", file=sys.stderr)
        return 1
    except _input_errors() as error:
        print(f"highrank {verb}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"highrank {verb}: interrupted; {_AFTER_INTERRUPT.get(verb, 'nothing was kept')}",
            file=sys.stderr,
        )
        return 130


def _train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="TOML experiment file (see configs/)")
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last checkpoint, exactly (no CONFIG)",
    )
    _add_run_options(parser)
    _add_overrides(parser)


def _run_train(args: argparse.Namespace) -> int:
    from highrank import train as training
    from highrank.config import load_config

    if (args.config is None) == (args.resume is None):
        args.parser.error("give either CONFIG (a new run) or --resume RUN_DIR, not both")
    command = ["highrank", "train", *([args.config] if args.config else [])]
    command += [*(["--resume", args.resume] if args.resume else []), *_flags(args)]

    def job() -> int:
        options = _train_options(args)
        if args.resume:
            kwargs = {"overrides": args.overrides, "options": options, "command": command}
            result = training.resume(args.resume, **kwargs)
        else:
            config = load_config(args.config, args.overrides)
            result = training.train(config, options=options, command=command)
        print(_result_line(result))
        return 0

    return _guarded("train", job)


def _flags(args: argparse.Namespace) -> list[str]:
    """The options of a train / finetune command line, for command.txt (``--checkpoint-every
    N`` is among the overrides, written as ``--train.checkpoint_every=N``)."""
    words = [f"--{text}" for text in args.overrides]
    if args.max_steps is not None:
        words += ["--max-steps", str(args.max_steps)]
    return words


def _result_line(result) -> str:
    how = {"epochs": "all epochs done", "nonmono": "stopped by the non-monotone rule"}
    how["max_steps"] = "stopped at --max-steps (continue with --resume)"
    best = (
        f"best validation perplexity {result.best_val_ppl:.2f} (epoch {result.best_epoch})"
        if result.best_epoch
        else "no validation improvement"
    )
    return (
        f"{result.stage}: {how.get(result.stop_reason, result.stop_reason)} after "
        f"{result.epochs_completed} epoch(s), {result.steps} steps; {best}; "
        f"run directory {result.run_dir}"
    )


def _finetune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of `highrank train`")
    parser.add_argument(
        "--resume", action="store_true", help="continue an interrupted finetuning exactly"
    )
    _add_run_options(parser)
    _add_overrides(parser)


def _run_finetune(args: argparse.Namespace) -> int:
    from highrank import train as training

    command = ["highrank", "finetune", args.run_dir, *(["--resume"] if args.resume else [])]
    command += _flags(args)

    def job() -> int:
        result = training.finetune(
            args.run_dir,
            resume=args.resume,
            overrides=args.overrides,
            options=_train_options(args),
            command=command,
        )
        print(_result_line(result))
        return 0

    return _guarded("finetune", job)


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action", choices=["show"], help="show: the resolved config and its parameter count"
    )
    parser.add_argument("config", nargs="?", help="TOML experiment file (default: the defaults)")
    parser.add_argument(
        "--vocab-size",
        type=positive_int,
        help="vocabulary size for the parameter count (default: read the corpus at data.dir; "
        "PTB 10000, WikiText-2 33278)",
    )
    _add_overrides(parser)


def _run_config(args: argparse.Namespace) -> int:
    from pathlib import Path

    from highrank.config import ConfigError, dump_toml, load_config
    from highrank.train import corpus_vocab_size, parameter_count

    def job() -> int:
        config = load_config(args.config, args.overrides)
        vocab_size, source = args.vocab_size, "--vocab-size"
        if vocab_size is None:
            if not Path(config.data.dir).is_dir():
                raise ConfigError(
                    f"cannot count the parameters: data.dir = {config.data.dir!r} is not a "
                    "directory; pass --vocab-size N (PTB 10000, WikiText-2 33278) or "
                    "--data.dir=PATH to the corpus"
                )
            vocab_size, source = corpus_vocab_size(config), f"the corpus at {config.data.dir}"
        print(dump_toml(config), end="")
        print(f"\n# vocabulary size {vocab_size} ({source}); model built on the meta device")
        print(f"parameters: {parameter_count(config, vocab_size)}")
        return 0

    return _guarded("config show", job)


# ---- eval, dynamic-eval --------------------------------------------------------------------


def _add_eval_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of `highrank train`")
    parser.add_argument("--split", choices=["valid", "test"], default="test", help="(test)")
    parser.add_argument(
        "--which", default="best", help="checkpoint: best, last, finetuned or a .pt path (best)"
    )
    parser.add_argument("--data-dir", help="corpus folder (default: the run's data.dir)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    _add_eval_options(parser)
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        help="columns (default: the run's eval_batch_size (10) for valid, test_batch_size (1) "
        "for test)",
    )
    parser.add_argument("--bptt", type=positive_int, default=70, help="segment length (70)")
    parser.add_argument("--token-nll", help="also write per-token NLL to this .tsv or .npy file")


def _load_for_eval(args: argparse.Namespace):
    """The run's model, config and corpus, checked against the run's vocabulary."""
    from highrank.checkpoint import load_run_corpus

    return load_run_corpus(args.run_dir, args.which, data_dir=args.data_dir)


def _report_eval(args: argparse.Namespace, kind: str, result, extra: dict) -> None:
    import json
    from pathlib import Path

    record = {
        "split": args.split,
        "checkpoint": args.which,
        "loss": result.loss,
        "perplexity": result.perplexity,
        "tokens": result.tokens,
        **extra,
    }
    path = Path(args.run_dir) / f"{kind}-{args.split}-{Path(args.which).stem}.json"
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(
        f"{kind} {args.split}: loss {result.loss:.4f}, perplexity {result.perplexity:.2f} "
        f"over {result.tokens:,} tokens; wrote {path}"
    )


def _run_eval(args: argparse.Namespace) -> int:
    from highrank.evaluate import evaluate_perplexity, write_token_nll

    def job() -> int:
        model, config, corpus = _load_for_eval(args)
        default_batch = {
            "valid": config.train.eval_batch_size,
            "test": config.train.test_batch_size,
        }
        batch_size = args.batch_size or default_batch[args.split]
        result = evaluate_perplexity(
            model,
            corpus.split(args.split),
            batch_size=batch_size,
            bptt=args.bptt,
            progress=not args.no_progress,
            return_token_nll=bool(args.token_nll),
            name=str(corpus.path(args.split)),
        )
        if args.token_nll:
            print(f"wrote {write_token_nll(args.token_nll, result, corpus.vocab)}")
        _report_eval(args, "eval", result, {"batch_size": batch_size, "bptt": args.bptt})
        return 0

    return _guarded("eval", job)


def _dynamic_eval_arguments(parser: argparse.ArgumentParser) -> None:
    _add_eval_options(parser)
    for flag, meaning in (("--lr", "eta"), ("--epsilon", "epsilon"), ("--prior-decay", "lambda")):
        parser.add_argument(flag, type=float, help=f"{meaning} (default: the run's [dynamic_eval])")
    parser.add_argument(
        "--max-stats-batches",
        type=positive_int,
        help="gradient statistics from only this many training segments (default: all)",
    )


def _run_dynamic_eval(args: argparse.Namespace) -> int:
    from highrank.evaluate import dynamic_evaluate, gradient_statistics

    def job() -> int:
        model, config, corpus = _load_for_eval(args)
        settings = config.dynamic_eval
        stats = gradient_statistics(
            model,
            corpus.train,
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
        result = dynamic_evaluate(
            model,
            corpus.split(args.split),
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
        }
        _report_eval(args, "dynamic-eval", result, extra)
        return 0

    return _guarded("dynamic-eval", job)


# ---- analysis (highrank.analysis.commands routes each to its module) ------------------------


def _analyze_arguments(parser: argparse.ArgumentParser) -> None:
    from highrank.analysis.commands import analyze_arguments

    analyze_arguments(parser)


def _run_analyze(args: argparse.Namespace) -> int:
    from highrank.analysis.commands import run_analyze

    return _guarded("analyze", lambda: run_analyze(args))


def _compare_arguments(parser: argparse.ArgumentParser) -> None:
    from highrank.analysis.commands import compare_arguments

    compare_arguments(parser)


def _run_compare(args: argparse.Namespace) -> int:
    from highrank.analysis.commands import run_compare

    return _guarded("compare", lambda: run_compare(args))


def _report_arguments(parser: argparse.ArgumentParser) -> None:
    from highrank.analysis.commands import report_arguments

    report_arguments(parser)


def _run_report(args: argparse.Namespace) -> int:
    from highrank.analysis.commands import run_report

    return _guarded("report", lambda: run_report(args))


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
    Verb(
        "train",
        "train a language model from a TOML config (or --resume a run exactly)",
        _train_arguments,
        _run_train,
    ),
    Verb(
        "finetune",
        "finetune a trained run: averaged SGD restarted from its best checkpoint",
        _finetune_arguments,
        _run_finetune,
    ),
    Verb(
        "config",
        "show a resolved config and its parameter count",
        _config_arguments,
        _run_config,
    ),
    Verb(
        "eval",
        "perplexity of a trained run on a split (hidden state carried)",
        _eval_arguments,
        _run_eval,
    ),
    Verb(
        "dynamic-eval",
        "dynamic evaluation (Krause et al. 2017) of a trained run",
        _dynamic_eval_arguments,
        _run_dynamic_eval,
    ),
    Verb(
        "analyze",
        "measure the bottleneck of trained runs: rank, KL, top-k, word similarity",
        _analyze_arguments,
        _run_analyze,
    ),
    Verb(
        "compare",
        "compare two groups of runs (seeds): t-test on perplexity, rank vs perplexity",
        _compare_arguments,
        _run_compare,
    ),
    Verb(
        "report",
        "one self-contained HTML page of what trained runs hold (tables and plots)",
        _report_arguments,
        _run_report,
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
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _reject_unknown(parser, args, unknown)
    return args.run(args)


def _reject_unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown) -> None:
    """argparse's error for unknown arguments, naming the closest config keys for a
    ``--section.key`` that is not one (``--train.lrr=20``: did you mean train.lr?)."""
    import difflib

    verb_parser = getattr(args, "parser", parser)
    for argument in unknown:
        name = argument.removeprefix("--").split("=", 1)[0]
        if argument.startswith("--") and "." in name:
            close = difflib.get_close_matches(name, _config_keys(), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            verb_parser.error(
                f"unknown config key {name!r}{hint} (`highrank config show` lists every key)"
            )
    verb_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
