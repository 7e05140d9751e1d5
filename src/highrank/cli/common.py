"""What several verbs share: argument types, config overrides, and the error guard.

A bad value of an option is an argparse error naming the option (exit status 2); inside a verb,
:func:`guarded` turns the library's errors into one line on stderr and an exit status: 2 for
bad input (config, corpus, run directory, checkpoint), 1 for a diverged run, 130 for Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from highrank.cli.choices import HEAD_NAMES
from highrank.util.argtypes import int_list, non_negative_int, positive_int
from highrank.util.checks import check_names

# ---- argument types: a bad value is an argparse error naming the option --------------------
# (positive_int, non_negative_int and int_list live in highrank.util.argtypes: the analyses
# declare options too, and must not import the command line)


def head_list(text: str) -> tuple[str, ...]:
    """Comma-separated head names from ``highrank.heads.HEADS`` (checked against its
    torch-free copy, :data:`highrank.cli.choices.HEAD_NAMES`)."""
    return name_list(text, "head", HEAD_NAMES)


def name_list(text: str, what: str, known: tuple[str, ...]) -> tuple[str, ...]:
    """Comma-separated names from ``known``: none unknown, none twice, at least one."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    try:
        check_names(what, names, known)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return names


# ---- parsers that declare their arguments when first used ---------------------------------


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` some of whose arguments are declared when it is first used.

    ``highrank --help`` and the errors argparse itself reports must not import torch (seconds
    on a busy machine), yet declaring the config keys does (the heads' knobs), and declaring
    every verb's options would import each verb's module. So :func:`highrank.cli.
    build_parser` hands each verb's ``add_arguments`` to :meth:`declare_later` (``analyze``
    each KIND's too), and argparse only ever parses with, or prints the help of, the verb on
    the command line. A declaration
    with ``needed`` runs at a parse only when ``needed(argument strings)`` says so, and at
    :meth:`declare_now` always. Subparsers are of this class too (argparse makes them of their
    parent's class).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pending: list[tuple[Callable[[argparse.ArgumentParser], None], Callable]] = []

    def declare_later(
        self,
        declare: Callable[[argparse.ArgumentParser], None],
        *,
        needed: Callable[[list[str]], bool] = lambda arguments: True,
    ) -> None:
        """Call ``declare(self)`` before the first parse that ``needed``, or help or usage."""
        self._pending.append((declare, needed))

    def declare_now(self, arguments: list[str] | None = None) -> None:
        """Run the pending declarations (with ``arguments``: those they are ``needed`` for),
        in the order they were handed over."""
        index = 0
        while index < len(self._pending):  # a declaration may hand over more (add_overrides)
            declare, needed = self._pending[index]
            if arguments is None or needed(arguments):
                del self._pending[index]
                declare(self)
            else:
                index += 1

    def parse_known_args(self, args=None, namespace=None):
        arguments = sys.argv[1:] if args is None else list(args)
        self.declare_now(arguments)
        return super().parse_known_args(arguments, namespace)

    def format_usage(self) -> str:
        self._declare_all_but_conditional()
        return super().format_usage()

    def format_help(self) -> str:
        self._declare_all_but_conditional()
        return super().format_help()

    def _declare_all_but_conditional(self) -> None:
        """What help and usage show: every declaration but those waiting on the arguments
        (the config keys, hidden from help)."""
        self.declare_now([])


def _has_dotted_option(arguments: list[str]) -> bool:
    """Whether an argument looks like ``--section.key`` (or ``--section.key=value``)."""
    return any(a.startswith("--") and "." in a.split("=", 1)[0] for a in arguments)


# ---- config overrides: --section.key=value ------------------------------------------------


class Override(argparse.Action):
    """``--section.key=value`` (or ``--section.key value``) appended to ``args.overrides`` in
    command-line order, for :func:`highrank.config.load_config`."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        overrides = list(getattr(namespace, "overrides", None) or [])
        overrides.append(f"{option_string.removeprefix('--')}={values}")
        namespace.overrides = overrides


class Alias(Override):
    """A flag that stands for one config key (``const``): ``--checkpoint-every 50`` is
    ``--train.checkpoint_every=50``, an override in command-line order like the others."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        super().__call__(parser, namespace, values, f"--{self.const}")


def config_keys() -> list[str]:
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


def add_overrides(parser: argparse.ArgumentParser) -> None:
    """One ``--section.key`` option per config key (hidden from --help, listed in the epilog).

    Listing the keys imports the config schema and every head (torch): a :class:`Parser`
    declares them only when a command line holds a ``--section.key`` (or for an error message
    that may name one); they can match nothing else, so the parse is the same either way."""

    def declare(parser: argparse.ArgumentParser) -> None:
        for key in config_keys():
            parser.add_argument(
                f"--{key}", action=Override, dest="overrides", help=argparse.SUPPRESS
            )

    if isinstance(parser, Parser):
        parser.declare_later(declare, needed=_has_dotted_option)
    else:
        declare(parser)
    parser.set_defaults(overrides=[])
    parser.epilog = (
        "Any config key can be overridden as --section.key=value (e.g. --train.lr=20 "
        "--head.name=mos --run.out_dir=runs/x); `highrank config show` prints them all."
    )


# ---- errors --------------------------------------------------------------------------------


def input_errors() -> tuple[type[Exception], ...]:
    """Errors in what the user gave (config, corpus, run directory): exit status 2."""
    from highrank.causal_lm import HFInputError
    from highrank.config import ConfigError
    from highrank.data import CorpusError
    from highrank.mt.subwords import SubwordError
    from highrank.runs.checkpoint import CheckpointError
    from highrank.runs.locks import LockedError
    from highrank.runs.run_dir import RunDirError

    return (ConfigError, CorpusError, CheckpointError, RunDirError, SubwordError, LockedError,
            HFInputError)


# What a user does after Ctrl-C, per verb.
AFTER_INTERRUPT = {
    "train": "continue from the last checkpoint with `highrank train --resume RUN_DIR`",
    "finetune": "continue from the last checkpoint with `highrank finetune RUN_DIR --resume`",
    "analyze": "run the same command again: a kept matrix and the saved Gram matrix are reused",
    "retrofit": "run the same command again: the caches and the training continue from their "
    "last checkpoint",
}


def guarded(verb: str, job: Callable[[], int]) -> int:
    """Run ``job``; input errors print one line (status 2), divergence status 1, Ctrl-C 130
    (SIGTERM 143 when training stopped on it), naming what was saved. The error classes are
    imported only once ``job`` raises, so what ``job`` checks before it imports the library
    (torch) is answered without it."""
    try:
        return job()
    except (Exception, KeyboardInterrupt) as error:
        status = _reported(verb, error)
        if status is None:
            raise
        return status


def _reported(verb: str, error: BaseException) -> int | None:
    """Print ``error`` as :func:`guarded` says and return the exit status; None: not ours."""
    from highrank.runs.checkpoint import NonFiniteCheckpointError
    from highrank.train import Interrupted, TrainingError, distributed

    if isinstance(error, TrainingError | NonFiniteCheckpointError):
        print(f"highrank {verb}: stopped: {error}", file=sys.stderr)
        return 1
    if isinstance(error, input_errors()):
        print(f"highrank {verb}: error: {error}", file=sys.stderr)
        return 2
    if isinstance(error, Interrupted):  # training saved its state between two steps
        run_dir = error.saved.parent.parent  # RUN_DIR/checkpoints/<name>.pt
        hint = AFTER_INTERRUPT[verb].replace("from the last checkpoint", "from it")
        if distributed.launched_rank() not in (None, 0):
            return error.exit_status  # under torchrun process 0 saved and says so: once
        print(
            f"highrank {verb}: interrupted by {error.signal_name} at step {error.step}; saved "
            f"{error.saved}; {hint.replace('RUN_DIR', str(run_dir))}",
            file=sys.stderr,
        )
        return error.exit_status
    if isinstance(error, KeyboardInterrupt):
        print(f"highrank {verb}: interrupted; {_unsaved(verb)}", file=sys.stderr)
        return 130
    return None


def refuse(verb: str, *problems: str | None) -> int | None:
    """The first of ``problems`` (from :mod:`highrank.util.paths`) that is not None, printed as
    the verb's one-line error: exit status 2; None when there is none. Verbs call it before
    they import the library, so a path typo is answered at once."""
    for problem in problems:
        if problem:
            print(f"highrank {verb}: error: {problem}", file=sys.stderr)
            return 2
    return None


# After an interrupt that saved nothing (a second Ctrl-C, or outside the training steps).
_UNSAVED = {
    "train": "nothing was saved now; continue from the last checkpoint with `highrank train "
    "--resume RUN_DIR` (a run that saved none starts again)",
    "finetune": "nothing was saved now; continue from the last checkpoint with `highrank "
    "finetune RUN_DIR --resume`, or start it again with `highrank finetune RUN_DIR` if it "
    "saved none",
}


def _unsaved(verb: str) -> str:
    return _UNSAVED.get(verb) or AFTER_INTERRUPT.get(verb, "nothing was kept")


__all__ = [
    "AFTER_INTERRUPT",
    "Alias",
    "Override",
    "Parser",
    "add_overrides",
    "config_keys",
    "guarded",
    "head_list",
    "input_errors",
    "int_list",
    "name_list",
    "non_negative_int",
    "positive_int",
    "refuse",
]
