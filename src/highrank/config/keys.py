"""The vocabulary for declaring config keys: :class:`ConfigError`, the range rules a key may
carry (``POSITIVE``, ``PROBABILITY``, ``one_of(...)``, ...) and :class:`Family`, what a model
family declares about the keys only it reads (see :mod:`highrank.config.families`).

Nothing here knows a section or a family; the modules above it do.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """Bad configuration: the message names the dotted key, the value, its source and the fix."""


# ---- range rules ------------------------------------------------------------------------------

# (accepts(value) -> bool, what is expected, as the error message says it)
Rule = tuple[Callable[[Any], bool], str]


def _positive_int(v: Any) -> bool:
    return v > 0


def _non_negative(v: Any) -> bool:
    return v >= 0


def _positive_finite(v: Any) -> bool:
    return math.isfinite(v) and v > 0


def _non_negative_finite(v: Any) -> bool:
    return math.isfinite(v) and v >= 0


def _probability(v: Any) -> bool:
    return 0 <= v < 1


def one_of(choices: Sequence[str]) -> Rule:
    """The value is one of ``choices``."""
    return (lambda v: v in choices), "one of: " + ", ".join(repr(c) for c in choices)


POSITIVE: Rule = (_positive_int, "> 0")
NON_NEGATIVE: Rule = (_non_negative, ">= 0")
POSITIVE_FINITE: Rule = (_positive_finite, "a finite number > 0")
NON_NEGATIVE_FINITE: Rule = (_non_negative_finite, "a finite number >= 0")
PROBABILITY: Rule = (_probability, "a probability in [0, 1)")
NON_EMPTY: Rule = (bool, "a non-empty string")
DEVICE: Rule = (
    lambda v: re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", v) is not None,
    "'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'",
)
SEED: Rule = (lambda v: 0 <= v < 2**32, "an int in [0, 2**32)")
LANGUAGE: Rule = (
    lambda v: re.fullmatch(r"[A-Za-z0-9_\-]+", v) is not None,
    "a language suffix such as 'en' (letters, digits, '_' or '-'; the split files' extension)",
)
# A key with no range rule (a bool, or a value its type check settles).
ANY: None = None


# ---- model families ---------------------------------------------------------------------------

# where(dotted) -> the source of a key for a message ("x.toml, line 3", "override ...",
# "default"); show(value) -> a value as the user would write it in TOML.
Where = Callable[[str], str]
Show = Callable[[Any], str]
# A family's cross-key checks of a whole config (a highrank.config.Config): raise a
# ConfigError or return.
Check = Callable[[Any, Where, Show], None]


def _no_check(config: Any, where: Where, show: Show) -> None:
    """A family with no cross-key rules."""


@dataclass(frozen=True)
class Family:
    """What a model family (``model.backbone = name``) declares about its config.

    Attributes:
        name: the family, the value of model.backbone.
        keys: section -> {key: its range rule (None: none)} for the keys of that section only
            this family (and any other family declaring them too) reads; the defaults and
            types stay in the section dataclasses of :mod:`highrank.config.schema`. A key no
            family declares is read by every family.
        check: the cross-key rules of a config of this family, run after every key's range.
        parallel_corpus: its data is a parallel corpus and its model translates (no word
            corpus to score): the verbs of language models refuse its runs.
        head_layers: for a head that reads more than hidden states (``OutputHead.reads``:
            other layers, the context's tokens), how many layers the family gives it and why
            no more, from the config; None: it gives a head its hidden states alone.
    """

    name: str
    keys: Mapping[str, Mapping[str, Rule | None]]
    check: Check = _no_check
    parallel_corpus: bool = False
    head_layers: Callable[[Any], tuple[int, str]] | None = None


__all__ = [
    "ANY",
    "DEVICE",
    "LANGUAGE",
    "NON_EMPTY",
    "NON_NEGATIVE",
    "NON_NEGATIVE_FINITE",
    "POSITIVE",
    "POSITIVE_FINITE",
    "PROBABILITY",
    "SEED",
    "Check",
    "ConfigError",
    "Family",
    "Rule",
    "Show",
    "Where",
    "one_of",
]
