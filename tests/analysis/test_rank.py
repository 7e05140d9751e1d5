"""Tests for highrank.analysis.rank: Press rank, epsilon-effective rank, the rank report.

Every expectation is planted (a matrix built with a known rank or a known spectrum) or worked
out by hand in a comment, never read back from the function under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from highrank.analysis.rank import (
    EFFECTIVE_RANK_EPSILONS,
    effective_rank,
    press_rank,
    press_rank_from_singular_values,
    press_threshold,
    rank_report,
    singular_values,
)

DTYPES = (np.float32, np.float64)


def planted_low_rank(m: int, n: int, r: int, dtype, seed: int = 0) -> np.ndarray:
    """An m x n matrix of rank exactly r: a Gaussian (m, r) factor times a Gaussian (r, n)."""
    rng = np.random.default_rng(seed)
    left = rng.standard_normal((m, r)).astype(dtype)
    right = rng.standard_normal((r, n)).astype(dtype)
    return left @ right


def planted_spectrum(m: int, n: int, values, seed: int = 0) -> np.ndarray:
    """A float64 m x n matrix U diag(values) V^T with random orthonormal U, V."""
    rng = np.random.default_rng(seed)
    k = len(values)
    u, _ = np.linalg.qr(rng.standard_normal((m, k)))
    v, _ = np.linalg.qr(rng.standard_normal((n, k)))
    return (u * np.asarray(values, dtype=np.float64)) @ v.T


# ---- Press rank of planted matrices -------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "r"),
    [
        (40, 40, 7),  # square
        (120, 30, 5),  # tall
        (25, 90, 12),  # wide
        (50, 60, 1),  # rank one
        (35, 35, 35),  # full rank, square
        (80, 20, 20),  # full rank, tall
        (15, 70, 15),  # full rank, wide
    ],
)
def test_press_rank_of_a_planted_low_rank_matrix_is_exactly_r(m, n, r, dtype):
    matrix = planted_low_rank(m, n, r, dtype, seed=m * n + r)
    assert matrix.dtype == dtype
    assert press_rank(matrix) == r
    assert press_rank(matrix.T) == r  # the transpose has the same rank


@pytest.mark.parametrize("dtype", DTYPES)
def test_press_rank_of_the_zero_matrix_is_zero(dtype):
    assert press_rank(np.zeros((6, 4), dtype=dtype)) == 0


def test_press_threshold_follows_the_formula_with_the_dtypes_own_epsilon():
    # 0.5 * sqrt(m + n + 1) * s_max * eps with m + n + 1 = 12 + 3 + 1 = 16, s_max = 2:
    # float32: 0.5 * 4 * 2 * 2**-23 = 2**-21;  float64: 0.5 * 4 * 2 * 2**-52 = 2**-50.
    assert press_threshold((12, 3), 2.0, np.float32) == 2.0**-21
    assert press_threshold((12, 3), 2.0, np.float64) == 2.0**-50
    assert press_threshold((12, 3), 2.0, np.dtype("float32")) == 2.0**-21
    assert press_threshold((12, 3), 2.0, torch.float32) == 2.0**-21
    assert press_threshold((12, 3), 2.0, torch.float64) == 2.0**-50


def test_press_rank_from_singular_values_counts_strictly_above_the_threshold():
    # Shape (12, 3) and s_max = 1: float32 threshold 0.5 * 4 * 1 * 2**-23 = 2**-22.
    threshold = 2.0**-22
    values = np.array([1.0, 0.5, 2.0 * threshold, threshold, 0.5 * threshold])
    # 1, 0.5 and 2*threshold are above; the value equal to the threshold is not (strict >).
    assert press_rank_from_singular_values(values, (12, 3), np.float32) == 3
    # The same values judged at float64 precision (threshold 2**-51): all five count.
    assert press_rank_from_singular_values(values, (12, 3), np.float64) == 5
    assert press_rank_from_singular_values(np.array([]), (0, 3), np.float64) == 0


@pytest.mark.parametrize("r", [1, 6])
def test_a_component_between_the_float64_and_float32_thresholds_counts_only_in_float64(r):
    # m = n = 40: threshold / s_max = 0.5 * sqrt(81) * eps = 4.5 * eps, i.e.
    # float64: 4.5 * 2**-52 ~ 1.0e-15 and float32: 4.5 * 2**-23 ~ 5.4e-7.
    # The planted spectrum has r values in [0.5, 1] and one extra value 1e-10 * s_max,
    # five orders of magnitude above the float64 threshold and below the float32 one.
    strong = np.linspace(1.0, 0.5, r)
    matrix = planted_spectrum(40, 40, [*strong, 1e-10], seed=r)
    assert press_rank(matrix) == r + 1
    assert press_rank(matrix.astype(np.float32)) == r
    assert press_rank(torch.from_numpy(matrix)) == r + 1
    assert press_rank(torch.from_numpy(matrix).float()) == r

    # A component far below even the float64 threshold (1e-20 * s_max) counts in neither.
    hidden = planted_spectrum(40, 40, [*strong, 1e-20], seed=r)
    assert press_rank(hidden) == r
    assert press_rank(hidden.astype(np.float32)) == r


@pytest.mark.parametrize(
    ("dtype", "loud", "quiet"),
    [
        # (60 x 30): threshold / s_max = 0.5 * sqrt(91) * eps: ~1.1e-15 (float64), ~5.7e-7
        # (float32). Noise with entries of std sigma has its smallest singular values near
        # sigma * (sqrt(57) - sqrt(27)) ~ 2.4 sigma away from the planted space.
        (np.float64, 1e-8, 1e-22),
        (np.float32, 1e-4, 1e-12),
    ],
)
def test_tiny_noise_above_the_threshold_makes_a_low_rank_matrix_full_rank(dtype, loud, quiet):
    m, n, r = 60, 30, 3
    base = planted_low_rank(m, n, r, np.float64, seed=11)
    base /= np.linalg.norm(base, 2)  # s_max = 1, so noise std is relative to s_max
    noise = np.random.default_rng(12).standard_normal((m, n))
    assert press_rank(base.astype(dtype)) == r
    # The known jump: a perturbation far too small to matter to the model's probabilities
    # lifts the Press rank from r straight to min(m, n).
    assert press_rank((base + loud * noise).astype(dtype)) == min(m, n)
    assert press_rank((base + quiet * noise).astype(dtype)) == r


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        # Shape (20, 30): threshold = 0.5 * sqrt(51) * eps * s_max with s_max = 1:
        # float64 ~ 7.9e-16: the 13 values 1, 0.1, ..., 1e-12 count;
        # float32 ~ 4.3e-7: the 7 values 1, ..., 1e-6 count (1e-7 lies below).
        (np.float64, 13),
        (np.float32, 7),
    ],
)
def test_press_rank_agrees_with_a_direct_numpy_threshold_count(dtype, expected):
    spectrum = 10.0 ** -np.arange(13)
    matrix = planted_spectrum(20, 30, spectrum, seed=3).astype(dtype)
    values = np.linalg.svd(matrix.astype(np.float64), compute_uv=False)
    tolerance = 0.5 * np.sqrt(20 + 30 + 1) * values[0] * np.finfo(dtype).eps
    assert int(np.sum(values > tolerance)) == expected  # the direct count, in float64
    assert press_rank(matrix) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_tensors_and_numpy_arrays_give_the_same_answer(dtype):
    numpy_dtype = np.float32 if dtype == torch.float32 else np.float64
    array = planted_low_rank(30, 45, 4, numpy_dtype, seed=5)
    tensor = torch.tensor(array, dtype=dtype, requires_grad=True)  # grad must not matter
    assert press_rank(tensor) == press_rank(array) == 4
    assert press_rank(tensor.detach().T) == press_rank(np.ascontiguousarray(array.T)) == 4
    from_tensor, from_array = rank_report(tensor), rank_report(array)
    assert from_tensor["dtype"] == from_array["dtype"] == str(np.dtype(numpy_dtype))
    assert from_tensor["press_rank"] == from_array["press_rank"] == 4
    assert from_tensor["effective_rank"] == from_array["effective_rank"]
    np.testing.assert_array_equal(from_tensor["singular_values"], from_array["singular_values"])


def test_singular_values_are_descending_and_match_the_planted_spectrum():
    spectrum = [5.0, 3.0, 2.0, 0.25]
    matrix = planted_spectrum(9, 7, spectrum, seed=2)
    values = singular_values(matrix)
    assert values.shape == (7,)
    np.testing.assert_allclose(values[:4], spectrum, rtol=1e-12)
    np.testing.assert_allclose(values[4:], 0.0, atol=1e-13)
    assert singular_values(matrix.astype(np.float32)).dtype == np.float32  # its own dtype


# ---- epsilon-effective rank ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("epsilon", "expected"),
    [
        # Values [3, 2, 1]: squared energies 9, 4, 1; total 14; cumulative 9, 13, 14.
        # k = 1 needs 9 >= (1 - eps) * 14, i.e. eps >= 5/14 ~ 0.357.
        # k = 2 needs 13 >= (1 - eps) * 14, i.e. eps >= 1/14 ~ 0.0714.
        (0.5, 1),
        (0.36, 1),
        (0.35, 2),
        (0.1, 2),
        (0.072, 2),
        (0.07, 3),
        (1e-3, 3),
    ],
)
def test_effective_rank_on_hand_made_singular_values(epsilon, expected):
    assert effective_rank(np.array([3.0, 2.0, 1.0]), epsilon) == expected


def test_effective_rank_counts_an_exact_hit_of_the_share():
    # Values [1, 1]: energies 1, 1; (1 - 0.5) * 2 = 1 is reached exactly by k = 1 (>=, not >).
    assert effective_rank(np.array([1.0, 1.0]), 0.5) == 1
    # Values [2, 1, 1] in float32: energies 4, 1, 1 (total 6); (1 - 0.25) * 6 = 4.5 -> k = 2.
    assert effective_rank(np.array([2.0, 1.0, 1.0], dtype=np.float32), 0.25) == 2


def test_effective_rank_of_all_zeros_is_zero():
    assert effective_rank(np.zeros(5), 1e-3) == 0
    assert effective_rank(np.zeros(0), 1e-3) == 0


def test_effective_rank_of_equal_values_needs_all_of_them():
    # r equal values: k of them hold a k / r share, so a share of 1 - 1e-3 needs all r = 6,
    assert effective_rank(np.full(6, 0.7), 1e-3) == 6
    # while a share of 1 - 0.5 needs r / 2 = 3 (0.5**2 = 0.25: every sum here is exact).
    assert effective_rank(np.full(6, 0.5), 0.5) == 3


@pytest.mark.parametrize("epsilon", [0.0, 1.0, -0.1, 1.5])
def test_effective_rank_rejects_an_epsilon_outside_the_open_unit_interval(epsilon):
    with pytest.raises(ValueError, match="epsilon"):
        effective_rank(np.array([1.0]), epsilon)


# ---- the report ---------------------------------------------------------------------------


def test_rank_report_keys_and_values():
    # Spectrum 1, 0.1, 0.01, 1e-4 then zeros, on a (12, 8) float64 matrix.
    # Energies 1, 1e-2, 1e-4, 1e-8; total 1.01010001.
    #   eps = 1e-3: share needed 1.00909 -> k = 2 (cumulative 1.01).
    #   eps = 1e-4: share needed 1.0100 -> k = 2 (1.01 >= 1.0099990...).
    #   eps = 1e-5: share needed 1.0100899 -> k = 3 (cumulative 1.0101).
    matrix = planted_spectrum(12, 8, [1.0, 0.1, 0.01, 1e-4], seed=9)
    report = rank_report(matrix)
    assert set(report) == {"shape", "dtype", "press_rank", "effective_rank", "singular_values"}
    assert report["shape"] == [12, 8]
    assert report["dtype"] == "float64"
    assert report["press_rank"] == 4
    assert set(report["effective_rank"]) == {"0.001", "0.0001", "1e-05"}
    assert report["effective_rank"] == {"0.001": 2, "0.0001": 2, "1e-05": 3}
    assert report["singular_values"].shape == (8,)
    np.testing.assert_allclose(report["singular_values"][:4], [1.0, 0.1, 0.01, 1e-4], rtol=1e-9)

    custom = rank_report(matrix.astype(np.float32), epsilons=(0.5,))
    assert custom["dtype"] == "float32"
    assert custom["effective_rank"] == {"0.5": 1}
    assert EFFECTIVE_RANK_EPSILONS == (1e-3, 1e-4, 1e-5)  # the defaults the design names


# ---- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "matrix",
    [np.ones(5), np.ones((2, 3, 4)), torch.ones(5), np.float64(1.0)],
    ids=["1-D array", "3-D array", "1-D tensor", "scalar"],
)
def test_a_matrix_that_is_not_2d_is_rejected(matrix):
    with pytest.raises(ValueError, match="2-D"):
        press_rank(matrix)
    with pytest.raises(ValueError, match="2-D"):
        rank_report(matrix)


@pytest.mark.parametrize(
    "matrix",
    [
        np.ones((3, 3), dtype=np.int64),
        np.ones((3, 3), dtype=np.float16),
        torch.ones(3, 3, dtype=torch.int64),
        torch.ones(3, 3, dtype=torch.bfloat16),
    ],
    ids=["int64 array", "float16 array", "int64 tensor", "bfloat16 tensor"],
)
def test_a_matrix_that_is_not_float32_or_float64_is_rejected(matrix):
    with pytest.raises(TypeError, match="float32 or float64"):
        press_rank(matrix)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_a_matrix_with_nan_or_infinite_entries_is_rejected(bad, as_tensor):
    matrix = planted_low_rank(5, 4, 2, np.float64)
    matrix[2, 1] = bad
    if as_tensor:
        matrix = torch.from_numpy(matrix)
    with pytest.raises(ValueError, match="NaN or infinite"):
        press_rank(matrix)
    with pytest.raises(ValueError, match="NaN or infinite"):
        singular_values(matrix)
