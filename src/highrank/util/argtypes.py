"""Command-line option types: a bad value is an argparse error naming the option.

Here rather than in :mod:`highrank.cli` so that modules declaring options of their own (the
analyses' ``add_arguments``) use them without importing the command line, which sits above
every other layer.
"""

from __future__ import annotations

import argparse


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


def int_list(text: str) -> list[int]:
    """Comma-separated positive integers."""
    return [positive_int(part) for part in text.split(",") if part.strip()]


__all__ = ["int_list", "non_negative_int", "positive_int"]
