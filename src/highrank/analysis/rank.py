"""Numerical rank of a log-probability matrix.

Press rank (Press et al., *Numerical Recipes*, Sec. 2.6; used by Yang et al. 2018 and the
rank study of Ganea et al. 2019): the number of singular values above

    tol = 0.5 * sqrt(m + n + 1) * s_max * eps,

with eps the machine epsilon of the matrix's own dtype (float32: 2**-23), so a float32
matrix is judged at float32 precision. The epsilon-effective rank is the smallest k whose
leading singular values hold a (1 - epsilon) share of the squared Frobenius norm.

These functions work on in-memory matrices (NumPy arrays or torch tensors).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch

EFFECTIVE_RANK_EPSILONS = (1e-3, 1e-4, 1e-5)


def singular_values(matrix: np.ndarray | torch.Tensor) -> np.ndarray:
    """Singular values in descending order, computed in the matrix's own dtype."""
    array = _as_float_array(matrix)
    return np.linalg.svd(array, compute_uv=False)


def press_threshold(shape: tuple[int, int], s_max: float, dtype: np.dtype | torch.dtype) -> float:
    """``0.5 * sqrt(m + n + 1) * s_max * eps`` for a matrix of ``shape`` and ``dtype``."""
    m, n = shape
    return 0.5 * math.sqrt(m + n + 1) * s_max * _machine_epsilon(dtype)


def press_rank_from_singular_values(
    values: np.ndarray, shape: tuple[int, int], dtype: np.dtype | torch.dtype
) -> int:
    """Press rank given the singular values of a matrix of ``shape`` stored as ``dtype``."""
    values = np.asarray(values)
    if values.size == 0:
        return 0
    threshold = press_threshold(shape, float(values.max()), dtype)
    return int(np.count_nonzero(values > threshold))


def press_rank(matrix: np.ndarray | torch.Tensor) -> int:
    """Press rank of a 2-D matrix, judged at the precision of its own dtype."""
    array = _as_float_array(matrix)
    return press_rank_from_singular_values(singular_values(array), array.shape, array.dtype)


def effective_rank(values: np.ndarray, epsilon: float) -> int:
    """Smallest k with sum_{i<=k} s_i^2 >= (1 - epsilon) * sum_i s_i^2 (values descending)."""
    if not 0.0 < epsilon < 1.0:
        raise ValueError(f"epsilon must lie in (0, 1); got {epsilon!r}")
    energy = np.square(np.asarray(values, dtype=np.float64))
    total = energy.sum()
    if total == 0.0:
        return 0
    cumulative = np.cumsum(energy)
    k = int(np.searchsorted(cumulative, (1.0 - epsilon) * total, side="left")) + 1
    return min(k, energy.size)


def rank_report(
    matrix: np.ndarray | torch.Tensor, epsilons: Iterable[float] = EFFECTIVE_RANK_EPSILONS
) -> dict[str, object]:
    """Press rank, epsilon-effective ranks and the singular values of ``matrix``."""
    array = _as_float_array(matrix)
    values = singular_values(array)
    return {
        "shape": list(array.shape),
        "dtype": str(array.dtype),
        "press_rank": press_rank_from_singular_values(values, array.shape, array.dtype),
        "effective_rank": {str(eps): effective_rank(values, eps) for eps in epsilons},
        "singular_values": values,
    }


def _as_float_array(matrix: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(matrix, torch.Tensor):
        matrix = matrix.detach().cpu()
        if matrix.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"rank needs a float32 or float64 matrix; got {matrix.dtype}")
        matrix = matrix.numpy()
    array = np.asarray(matrix)
    if array.ndim != 2:
        raise ValueError(f"rank needs a 2-D matrix; got shape {array.shape}")
    if array.dtype not in (np.float32, np.float64):
        raise TypeError(f"rank needs a float32 or float64 matrix; got {array.dtype}")
    if not np.isfinite(array).all():
        raise ValueError("the matrix holds NaN or infinite entries; its rank is undefined")
    return array


def _machine_epsilon(dtype: np.dtype | torch.dtype) -> float:
    if isinstance(dtype, torch.dtype):
        return float(torch.finfo(dtype).eps)
    return float(np.finfo(dtype).eps)
