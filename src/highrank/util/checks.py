"""Argument checks shared by heads, backbones and the rest of the package.

Each check raises ``ValueError`` with one line naming the argument, the value it got and what
was expected, and returns the value (converted where that is harmless, e.g. int -> float) so
that a constructor can write ``self.p = check_probability("p", p)``. Booleans are not numbers
here: ``True`` as a size or a rate is almost always a mistake in a config file.
"""

from __future__ import annotations

import math


def is_number(value: object) -> bool:
    """An int or float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_positive_int(name: str, value: object) -> int:
    """A size or count: an int (not a bool) > 0."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return value


def check_probability(name: str, value: object) -> float:
    """A dropout rate: a number in [0, 1). (1 would drop everything and divide by zero.)"""
    if not is_number(value) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1); got {value!r}")
    return float(value)


def check_finite(name: str, value: object) -> float:
    """A real number that is neither infinite nor NaN."""
    if not is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number; got {value!r}")
    return float(value)


def check_bool(name: str, value: object) -> bool:
    """A switch: True or False (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false; got {value!r}")
    return value


def check_dropout_time_dim(value: object) -> int | None:
    """The time axis over which dropout masks are shared (an int), or None for none."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"dropout_time_dim must be an integer axis or None; got {value!r}")
    return value


def check_names(what: str, names: tuple[str, ...] | list[str], known) -> None:
    """A list of names chosen from ``known`` (``what``: "head" for the heads): refuses an empty
    list, unknown names and duplicates, listing the valid ones."""
    if not names:
        raise ValueError(f"{what}s is empty; choose from: {', '.join(known)}")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(
            f"unknown {what}(s) {', '.join(map(repr, unknown))}; choose from: {', '.join(known)}"
        )
    repeated = sorted({n for n in names if list(names).count(n) > 1})
    if repeated:
        raise ValueError(f"{what}(s) listed twice: {', '.join(repeated)}")
