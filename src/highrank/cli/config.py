"""``highrank config show``: a resolved config and its parameter count."""

from __future__ import annotations

import argparse

from highrank.cli.common import add_overrides, guarded, positive_int, refuse
from highrank.util.paths import config_file_problem


def add_arguments(parser: argparse.ArgumentParser) -> None:
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
    add_overrides(parser)


def run(args: argparse.Namespace) -> int:
    status = args.config and refuse("config show", config_file_problem(args.config))
    if status:  # a mistyped path, answered before torch is imported
        return status
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

    return guarded("config show", job)
