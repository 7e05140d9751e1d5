"""The shared argument checks: each returns the value or raises one line naming it."""

from __future__ import annotations

import math

import pytest

from highrank.util.checks import (
    check_dropout_time_dim,
    check_finite,
    check_positive_int,
    check_probability,
    is_number,
)


def test_valid_values_pass_through():
    assert check_positive_int("n", 3) == 3
    assert check_probability("p", 0) == 0.0 and isinstance(check_probability("p", 0), float)
    assert check_finite("c", -1) == -1.0
    assert check_dropout_time_dim(None) is None and check_dropout_time_dim(-1) == -1
    assert is_number(1) and is_number(1.5) and not is_number(True) and not is_number("1")


@pytest.mark.parametrize(
    "check, value, message",
    [
        (check_positive_int, 0, "n must be a positive integer; got 0"),
        (check_positive_int, True, "n must be a positive integer; got True"),
        (check_positive_int, 2.0, "n must be a positive integer; got 2.0"),
        (check_probability, 1.0, r"n must be a number in \[0, 1\); got 1.0"),
        (check_probability, -0.1, r"n must be a number in \[0, 1\); got -0.1"),
        (check_probability, False, r"n must be a number in \[0, 1\); got False"),
        (check_finite, math.inf, "n must be a finite number; got inf"),
        (check_finite, math.nan, "n must be a finite number; got nan"),
        (check_finite, "1", "n must be a finite number; got '1'"),
    ],
)
def test_bad_values_raise_one_line_naming_the_argument(check, value, message):
    with pytest.raises(ValueError, match=message):
        check("n", value)


def test_dropout_time_dim_must_be_an_integer_or_none():
    with pytest.raises(ValueError, match="dropout_time_dim must be an integer axis or None"):
        check_dropout_time_dim(True)
