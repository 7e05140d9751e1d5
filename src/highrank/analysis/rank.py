"""Numerical rank of a log-probability matrix.

Press rank (Press et al., *Numerical Recipes*, Sec. 2.6; used by Yang et al. 2018 and the
rank study of Ganea et al. 2019): the number of singular values above

    tol = 0.5 * sqrt(m + n + 1) * s_max * eps,

with eps the machine epsilon of the matrix's own dtype (float32: 2**-23), so a float32
matrix is judged at float32 precision. The epsilon-effective rank is the smallest k whose
leading singular values hold a (1 - epsilon) share of the squared Frobenius norm.

:func:`rank_report` works on matrices in memory (NumPy arrays or torch tensors);
:func:`rank_report_file` on ``.npy`` files of any size, streamed (see "matrices on disk").
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from highrank.analysis import logprob_matrix  # iter_row_blocks looked up per call: tests wrap it
from highrank.analysis.contexts import count_contexts
from highrank.analysis.logprob_matrix import (
    check_disk_space,
    contexts_path,
    matrix_record,
    npy_layout,
)
from highrank.analysis.output import ANALYSIS_DIR, read_npy, record_tag, text_table, write_json
from highrank.analysis.rows import RowSource
from highrank.analysis.spectrum import plot_spectrum
from highrank.runs.locks import exclusive
from highrank.util.atomic import atomic_file, write_text_atomic
from highrank.util.machine import available_memory as available_memory_bytes  # plan_gram's probe
from highrank.util.progress import progress_bar, progress_note

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


# ---- matrices on disk: singular values from the Gram matrix ----------------------------------
#
# For an m x n matrix A with m >= n, the singular values of A are the square roots of the
# eigenvalues of the n x n Gram matrix G = A^T A = sum over row blocks B of B^T B. G is
# accumulated in float64 from float32 row blocks read one at a time, so memory is n^2 doubles
# plus a block, whatever m is (PTB test, n = 10,000: 0.8 GB; WikiText-2, n = 33,278: 8.9 GB),
# and twice that while torch's eigenvalue solver works on its copy of G.
#
# A wide matrix (m < n: fewer contexts than words, e.g. 8,192 contexts of a model with a
# 49,152-token vocabulary) has the same nonzero singular values as A^T, so G is taken on the
# smaller side instead: G = A A^T (m x m), G[I, J] = A_I A_J^T over pairs of row blocks
# (:func:`_accumulate_row_gram`). The Press threshold uses m + n + 1 and s_max, so it does
# not depend on the side. Before anything is accumulated, :func:`plan_gram` states the memory
# the chosen side and backend need and refuses, in one line, what would not fit in the
# machine's available memory (49,152^2 doubles alone are 19 GB).
#
# Precision. Forming G squares the condition number, which is why it must be float64: a
# float64 eigenvalue solver is accurate to about c * n * eps64 * s_max^2 in lambda, i.e. an
# error of about c * n * eps64 * s_max^2 / (2 s) in a singular value s. At the Press threshold
# s = tau = 0.5 * sqrt(m + n + 1) * eps32 * s_max (PTB test: 1.8e-5 * s_max) that is a
# relative error of c * n * eps64 / (2 * (tau / s_max)^2) ~ 2e-3 * c for n = 10,000: far
# finer than the threshold resolves. (A float32 Gram matrix would err by sqrt(eps32) *
# s_max = 3.5e-4 * s_max, twenty times the threshold: useless.) Singular values below about
# sqrt(n * eps64) * s_max (1e-6 * s_max for n = 10,000: :func:`gram_resolution`, kept in the
# report as "resolution") are not resolved: the computed ones are rounding noise. They count
# towards neither the Press rank nor, measurably, the epsilon-effective ranks.
# tests/analysis/test_rank_streamed.py plants singular values at 1/2 and 2x the threshold.

GRAM_BACKENDS = ("auto", "scipy", "torch")
SCIPY_MAX_N = 20_000
MEMORY_HEADROOM = 0.9  # a plan must fit in this share of the available memory


def streamed_singular_values(
    path: str | os.PathLike,
    *,
    block_rows: int = 2048,
    backend: str = "auto",
    device: str | torch.device = "cpu",
    state_dir: str | os.PathLike | None = None,
    checkpoint_seconds: float = 600.0,
    progress: bool = False,
    details: dict[str, Any] | None = None,
) -> np.ndarray:
    """Singular values (descending, float64) of the 2-D float32 ``.npy`` matrix at ``path``,
    which is read in blocks of ``block_rows`` rows and never held whole: ``min(m, n)`` values,
    from G = A^T A when rows >= columns, else from G = A A^T (see :func:`plan_gram`).

    Args:
        backend: ``"torch"`` (any ``device``, e.g. ``"cuda"``: float64 matrix products
            into the upper triangle of G, then ``torch.linalg.eigvalsh``, which copies G:
            peak memory ~ two G), ``"scipy"`` (CPU: BLAS ``dsyrk`` (n <= :data:`SCIPY_MAX_N`)
            or ``dgemm``, then LAPACK ``dsyevd`` overwriting G: peak ~ one G) or ``"auto"``
            (torch, or scipy when only scipy's plan fits in memory).
        state_dir: where the partial Gram matrix is saved every ``checkpoint_seconds``; a
            later call with the same ``state_dir`` and an unchanged matrix file resumes from
            there (with either backend). The folder is removed once the values are computed.
        progress: the memory plan, a tqdm bar with a time estimate, and an estimate for the
            eigenvalue step (on stderr).
        details: if given, receives ``gram_backend`` (the one used), ``memory_plan`` (its
            line), ``gram_seconds`` and ``eigen_seconds``.

    Raises :class:`GramMemoryError` before any work when the plan does not fit in memory.

    Only float32 matrices: the Gram method resolves singular values down to about
    1e-6 * s_max, enough for float32's Press threshold but not for float64's (~1e-14 *
    s_max); use :func:`rank_report` on a float64 matrix in memory.
    """
    shape, dtype, _ = npy_layout(path)
    if len(shape) != 2 or min(shape) == 0:
        raise ValueError(f"{path} holds an array of shape {shape}; expected a non-empty matrix")
    if dtype != np.float32:
        raise ValueError(
            f"{path} holds {dtype} values; the streamed rank needs float32 (its precision is "
            "not enough for a float64 Press threshold): use rank_report on the matrix in memory"
        )
    plan = plan_gram(shape, block_rows=block_rows, backend=backend, device=device)
    if progress:
        progress_note(plan.describe())
    plan.check()
    accumulate = _accumulate_column_gram if plan.side == "columns" else _accumulate_row_gram
    began = time.perf_counter()
    gram = accumulate(
        path, shape, block_rows, plan.backend, device, state_dir, checkpoint_seconds, progress
    )
    middle = time.perf_counter()
    values = _gram_eigenvalues(gram, plan.backend, progress)
    if details is not None:
        details["gram_backend"] = plan.backend
        details["memory_plan"] = plan.describe()
        details["gram_seconds"] = round(middle - began, 2)
        details["eigen_seconds"] = round(time.perf_counter() - middle, 2)
    if state_dir is not None:
        _GramCheckpoint(state_dir, path, plan.side).remove()
    return np.sqrt(np.clip(values, 0.0, None))[::-1].copy()


def rank_report_file(
    path: str | os.PathLike, epsilons: Iterable[float] = EFFECTIVE_RANK_EPSILONS, **options
) -> dict[str, object]:
    """:func:`rank_report` of the float32 ``.npy`` matrix at ``path``, computed by
    :func:`streamed_singular_values` (``options`` go there); the Press threshold uses
    float32's eps, exactly as for the matrix in memory. Adds the Gram matrix's side,
    backend, memory plan and the seconds of its two steps."""
    shape, dtype, _ = npy_layout(path)
    details: dict[str, Any] = {}
    values = streamed_singular_values(path, details=details, **options)
    return {
        "shape": list(shape),
        "dtype": str(dtype),
        "press_rank": press_rank_from_singular_values(values, shape, dtype),
        "press_threshold": press_threshold(shape, float(values[0]), dtype),
        "resolution": gram_resolution(min(shape), float(values[0])),
        "effective_rank": {str(eps): effective_rank(values, eps) for eps in epsilons},
        "gram_side": gram_side(shape),
        **details,
        "singular_values": values,
    }


# ---- the memory plan -------------------------------------------------------------------------


class GramMemoryError(ValueError):
    """The Gram matrix of a matrix on disk would not fit in the available memory."""


def gram_side(shape: tuple[int, int]) -> str:
    """``"columns"`` (G = A^T A, n x n) when rows >= columns, else ``"rows"`` (G = A A^T)."""
    return "columns" if shape[0] >= shape[1] else "rows"


@dataclass(frozen=True)
class GramPlan:
    """The memory the streamed rank of an ``m x n`` float32 matrix needs: G (k x k float64,
    k = min(m, n)), plus the row blocks and their float64 copies while G is accumulated, or
    plus torch's copy of G while the eigenvalues are computed (scipy overwrites G)."""

    shape: tuple[int, int]
    backend: str  # "torch" or "scipy"
    device: str
    gram_bytes: int
    work_bytes: int  # blocks and temporaries while G is accumulated
    eigen_bytes: int  # extra memory of the eigenvalue step
    available_bytes: int | None  # MemAvailable (free GPU memory on CUDA); None: unknown

    @property
    def side(self) -> str:
        return gram_side(self.shape)

    @property
    def peak_bytes(self) -> int:
        return self.gram_bytes + max(self.work_bytes, self.eigen_bytes)

    @property
    def fits(self) -> bool:
        return self.available_bytes is None or self.peak_bytes <= (
            MEMORY_HEADROOM * self.available_bytes
        )

    def describe(self) -> str:
        """One line: the Gram matrix, the peak memory and what the machine has."""
        k = min(self.shape)
        product = "A^T A" if self.side == "columns" else "A A^T"
        where = "free on the GPU" if torch.device(self.device).type == "cuda" else "MemAvailable"
        have = "unknown" if self.available_bytes is None else _gb(self.available_bytes)
        return (
            f"rank of a {self.shape[0]:,} x {self.shape[1]:,} matrix: Gram matrix {product}, "
            f"{k:,} x {k:,} float64 = {_gb(self.gram_bytes)}; peak about "
            f"{_gb(self.peak_bytes)} with the {self.backend} backend ({where}: {have})"
        )

    def check(self) -> None:
        """Raise :class:`GramMemoryError` (one line) when the plan does not fit."""
        if self.fits:
            return
        raise GramMemoryError(
            f"{self.describe()}: it does not fit in {MEMORY_HEADROOM:.0%} of the available "
            f"memory; use fewer contexts (--max-contexts, which also takes the Gram matrix on "
            "the contexts' side below the vocabulary size) or a machine with more memory"
        )


def plan_gram(
    shape: tuple[int, int],
    *,
    block_rows: int = 2048,
    backend: str = "auto",
    device: str | torch.device = "cpu",
    available_bytes: int | None = -1,
) -> GramPlan:
    """The :class:`GramPlan` of the streamed rank of a float32 matrix of ``shape``.

    ``backend="auto"`` is torch unless only scipy's plan (no copy of G) fits, on the CPU.
    ``available_bytes`` defaults to :func:`available_memory_bytes` of ``device``.
    """
    resolved = resolve_backend(backend, device)
    if available_bytes == -1:
        available_bytes = available_memory_bytes(device)
    m, n = int(shape[0]), int(shape[1])

    def plan(name: str) -> GramPlan:
        return GramPlan(
            (m, n), name, str(device), *_gram_bytes(m, n, block_rows, name), available_bytes
        )

    chosen = plan(resolved)
    if backend == "auto" and not chosen.fits and torch.device(device).type == "cpu":
        scipy_plan = plan("scipy")
        scipy_possible = scipy_plan.side == "rows" or n <= SCIPY_MAX_N
        if scipy_possible and scipy_plan.fits:
            return scipy_plan
    return chosen


def _gram_bytes(m: int, n: int, block_rows: int, backend: str) -> tuple[int, int, int]:
    """``(G, accumulation work, eigenvalue step)`` bytes; see :class:`GramPlan`."""
    k = min(m, n)
    gram = 8 * k * k
    if m >= n:  # a float32 block read, its float64 copy
        work = 12 * min(block_rows, m) * n
    else:  # the panel and a block (float32), their float64 column chunks, the product
        rows = min(block_rows, m)
        chunk = min(_RowGramUpdate.COLUMNS, n)
        work = 8 * rows * n + 16 * rows * chunk + 8 * rows * rows
    return gram, work, gram if backend == "torch" else 0


def _gb(count: int) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e8 else f"{count / 1e6:.1f} MB"


def gram_resolution(n: int, s_max: float) -> float:
    """``sqrt(n * eps64) * s_max``: singular values below this are not resolved by an n x n
    float64 Gram matrix (see "Precision" above); they are rounding noise, not spectrum."""
    return math.sqrt(n * np.finfo(np.float64).eps) * s_max


def resolve_backend(backend: str, device: str | torch.device) -> str:
    """The Gram backend to use: ``backend`` checked against ``device``, ``"auto"`` resolved."""
    if backend not in GRAM_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(GRAM_BACKENDS)}; got {backend!r}")
    if backend == "scipy" and torch.device(device).type != "cpu":
        raise ValueError(f"backend 'scipy' runs on the CPU only; got device {device!r}")
    return "torch" if backend == "auto" else backend


def _accumulate_column_gram(
    path, shape, block_rows, backend, device, state_dir, checkpoint_seconds, progress
):
    """G = A^T A (n x n, float64) over row blocks, resuming from ``state_dir`` if it holds
    a checkpoint of the same file."""
    rows, cols = shape
    checkpoint = _GramCheckpoint(state_dir, path, "columns") if state_dir is not None else None
    start, saved = checkpoint.load() if checkpoint else (0, None)
    gram = _GramUpdate(cols, backend, device, saved)
    del saved  # the update owns (a copy of) it now
    last_save = time.monotonic()
    bar = progress_bar(
        total=rows,
        initial=start,
        desc="Gram matrix",
        unit="row",
        unit_scale=True,
        disable=not progress,
    )
    with bar:
        for first, block in logprob_matrix.iter_row_blocks(path, block_rows, start):
            _check_finite_block(block, path, first)
            gram.add(block)
            bar.update(block.shape[0])
            done = first + block.shape[0]
            # Also after the last block: a crash in the eigenvalue step then resumes there.
            if checkpoint and time.monotonic() - last_save > checkpoint_seconds:
                checkpoint.save(done, gram.numpy(), gram.triangle)
                last_save = time.monotonic()
    return gram.result()


def _check_finite_block(block: np.ndarray, path, first_row: int) -> None:
    if not np.isfinite(block).all():
        row = first_row + int(np.argwhere(~np.isfinite(block))[0, 0])
        raise ValueError(
            f"{path}: row {row} holds NaN or infinite entries, so the rank is undefined; "
            "fix the model or delete the matrix file so that it is written again"
        )


class _GramUpdate:
    """G += B^T B for float32 blocks B ``(b, n)``, accumulated in float64; only the upper
    triangle (``G[i, j]``, ``i <= j``) is formed, half the flops of a full product.

    torch (the default, any device): column panels ``G[:e, s:e] += B[:, :e]^T B[:, s:e]``
    with ``addmm_`` (MKL on the CPU, cuBLAS on a GPU). scipy: BLAS ``dsyrk`` on a
    Fortran-ordered G in place; the multithreaded OpenBLAS that SciPy wheels ship crashes in
    ``dsyrk`` from about n = 25,000 (measured: 24,000 ran, 30,000 segfaulted), so it is
    refused above :data:`SCIPY_MAX_N`. A saved G from either backend continues in either.
    """

    PANEL = 2048  # columns per panel of the torch update (1024-4096 measured alike)

    def __init__(self, n: int, backend: str, device, saved: tuple | None) -> None:
        self.backend, self.device, self.n = backend, torch.device(device), n
        self.triangle = "upper"
        if backend == "scipy" and n > SCIPY_MAX_N:
            raise ValueError(
                f"backend 'scipy' is limited to n <= {SCIPY_MAX_N:,} (OpenBLAS's threaded dsyrk "
                f"crashes at larger n); this Gram matrix has n = {n:,}: use backend 'torch'"
            )
        self.gram = _new_gram(n, backend, self.device, saved)

    def add(self, block: np.ndarray) -> None:
        if self.backend == "scipy":
            from scipy.linalg.blas import dsyrk

            # block.T is an (n, b) Fortran-ordered view: C := B^T B + C, upper triangle.
            wide = block.astype(np.float64).T
            self.gram = dsyrk(1.0, wide, beta=1.0, c=self.gram, trans=0, lower=0, overwrite_c=1)
            return
        rows = torch.from_numpy(block).to(self.device, torch.float64)  # (b, n)
        for start in range(0, self.n, self.PANEL):
            end = min(start + self.PANEL, self.n)
            self.gram[:end, start:end].addmm_(rows[:, :end].T, rows[:, start:end])

    def numpy(self) -> np.ndarray:
        return self.gram if self.backend == "scipy" else self.gram.cpu().numpy()

    def result(self):
        return self.gram


def _new_gram(n: int, backend: str, device: torch.device, saved: tuple | None):
    """A zero n x n float64 G (Fortran-ordered NumPy for scipy, a tensor on ``device`` for
    torch), or the saved one of a checkpoint (either triangle layout holds the upper)."""
    matrix = None if saved is None else saved[0]
    if backend == "scipy":
        return np.zeros((n, n), order="F") if matrix is None else np.asfortranarray(matrix)
    if matrix is None:
        return torch.zeros(n, n, dtype=torch.float64, device=device)
    return torch.from_numpy(matrix).to(device)


def _accumulate_row_gram(
    path, shape, block_rows, backend, device, state_dir, checkpoint_seconds, progress
):
    """G = A A^T (m x m, float64) of a wide A (m < n), never holding more of A than a panel
    and a block of ``block_rows`` rows: for each panel I, G[I, J] = A_I A_J^T for I itself
    and every block J after it (the upper triangle), so panel I reads the m - start(I) rows
    from it on. The checkpoint (rows of G done) is taken at panel ends only, so the rows of
    G after it are still zero and a resumed run recomputes them whole."""
    rows = shape[0]
    checkpoint = _GramCheckpoint(state_dir, path, "rows") if state_dir is not None else None
    start, saved = checkpoint.load() if checkpoint else (0, None)
    gram = _RowGramUpdate(rows, backend, device, saved)
    del saved  # the update owns (a copy of) it now
    last_save = time.monotonic()
    work = sum(rows - first for first in range(start, rows, block_rows))  # rows paired
    bar = progress_bar(total=work, desc="Gram matrix A A^T", unit="row", disable=not progress)
    with bar:
        for first, panel in logprob_matrix.iter_row_blocks(path, block_rows, start):
            _check_finite_block(panel, path, first)
            gram.start_panel(first, panel)
            gram.add(first, panel)  # the diagonal block
            done = first + panel.shape[0]
            for other, block in logprob_matrix.iter_row_blocks(path, block_rows, done):
                _check_finite_block(block, path, other)
                gram.add(other, block)
                bar.update(block.shape[0])
            bar.update(panel.shape[0])
            # Also after the last panel: a crash in the eigenvalue step then resumes there.
            if checkpoint and time.monotonic() - last_save > checkpoint_seconds:
                checkpoint.save(done, gram.numpy(), "upper")
                last_save = time.monotonic()
    return gram.result()


class _RowGramUpdate:
    """The blocks ``G[I, J] = A_I A_J^T`` (float64) of a panel ``A_I (p, n)`` and a block
    ``A_J (b, n)`` of float32 rows, over :attr:`COLUMNS` columns at a time so that the
    float64 copies stay small. torch: ``addmm_`` into G (MKL on the CPU, cuBLAS on a GPU);
    scipy: NumPy's float64 ``@`` (BLAS ``dgemm``) into a Fortran-ordered G, which LAPACK's
    eigenvalue solver then overwrites. Either continues a checkpoint of the other."""

    COLUMNS = 4096

    def __init__(self, m: int, backend: str, device, saved: tuple | None) -> None:
        self.backend, self.device = backend, torch.device(device)
        self.triangle = "upper"
        self.gram = _new_gram(m, backend, self.device, saved)
        self.first, self.panel = 0, None

    def start_panel(self, first: int, panel: np.ndarray) -> None:
        self.first = first
        self.panel = panel if self.backend == "scipy" else torch.from_numpy(panel).to(self.device)

    def add(self, first: int, block: np.ndarray) -> None:
        p, b, n = self.panel.shape[0], block.shape[0], block.shape[1]
        rows, cols = slice(self.first, self.first + p), slice(first, first + b)
        if self.backend == "scipy":
            product = np.zeros((p, b))
            for s in range(0, n, self.COLUMNS):
                left = self.panel[:, s : s + self.COLUMNS].astype(np.float64)  # (p, c)
                right = block[:, s : s + self.COLUMNS].astype(np.float64)  # (b, c)
                product += left @ right.T
            self.gram[rows, cols] = product
            return
        target = self.gram[rows, cols].zero_()  # a view of G
        right_all = torch.from_numpy(block).to(self.device)
        for s in range(0, n, self.COLUMNS):
            left = self.panel[:, s : s + self.COLUMNS].double()  # (p, c)
            target.addmm_(left, right_all[:, s : s + self.COLUMNS].double().T)

    def numpy(self) -> np.ndarray:
        return self.gram if self.backend == "scipy" else self.gram.cpu().numpy()

    def result(self):
        return self.gram


def _gram_eigenvalues(gram, backend: str, progress: bool) -> np.ndarray:
    """Eigenvalues (ascending, float64) of the symmetric G; scipy overwrites G."""
    n = gram.shape[0]
    if progress:
        progress_note(
            f"eigenvalues of the {n:,} x {n:,} Gram matrix: {_eigen_estimate(n, backend)}"
        )
    if backend == "scipy":
        from scipy.linalg import eigh

        return eigh(
            gram,
            lower=False,
            eigvals_only=True,
            overwrite_a=True,
            check_finite=False,
            driver="evd",
        )
    return torch.linalg.eigvalsh(gram, UPLO="U").cpu().numpy()  # makes one copy of G


def _eigen_estimate(n: int, backend: str) -> str:
    """A rough time for the eigenvalues of an n x n matrix: a smaller one timed (after a
    warm-up call, whose library start-up would otherwise dominate) and scaled by n^3. On this
    project's 2-core CPU it overestimates 2-3x (about 24 min predicted for n = 33,278, where
    the eigenvalue step and the final checkpoint took 8.9 min)."""
    probe = min(n, 3000)
    sample = np.random.default_rng(0).standard_normal((probe, probe))
    sample = sample + sample.T
    _eigenvalues_of(sample[:64, :64].copy(), backend)  # warm-up
    began = time.perf_counter()
    _eigenvalues_of(sample, backend)
    minutes = (time.perf_counter() - began) * (n / probe) ** 3 / 60
    where = "on the CPU" if backend == "scipy" else "if on the CPU"
    return f"about {minutes:.1f} min {where} (rough: scaled from n = {probe})"


def _eigenvalues_of(matrix: np.ndarray, backend: str) -> None:
    if backend == "scipy":
        from scipy.linalg import eigh

        eigh(matrix, eigvals_only=True, overwrite_a=True, driver="evd")
    else:
        torch.linalg.eigvalsh(torch.from_numpy(matrix))


class _GramCheckpoint:
    """A partial Gram matrix on disk: ``gram-<rows done>.npy`` plus ``gram.json`` naming it,
    saying which triangle and side (``columns``: A^T A after that many rows of A; ``rows``:
    A A^T with that many rows of G complete) it holds, and fingerprinting the source matrix
    (path, size, modification time). Each file is written under a fixed temporary name, flushed and
    renamed, the JSON last, and the folder synced before an older matrix is deleted: a crash
    at any point leaves a consistent pair, and no stray temporary file survives the next save.
    """

    def __init__(self, state_dir, source, side: str = "columns") -> None:
        self.directory, self.side = Path(state_dir), side
        stat = Path(source).stat()
        self.fingerprint = {
            "source": str(Path(source).resolve()),
            "bytes": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
        }

    @property
    def record_path(self) -> Path:
        return self.directory / "gram.json"

    def load(self) -> tuple[int, tuple[np.ndarray, str] | None]:
        """``(rows done, (G, triangle))``, or ``(0, None)`` when there is no checkpoint."""
        if not self.record_path.is_file():
            return 0, None
        try:
            record = json.loads(self.record_path.read_text(encoding="utf-8"))
            matrix = read_npy(self.directory / record["file"])
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(
                f"the Gram checkpoint in {self.directory} cannot be read ({error}); delete the "
                "folder to start over"
            ) from None
        if record.get("fingerprint") != self.fingerprint:
            raise ValueError(
                f"{self.record_path} is a checkpoint of {record.get('fingerprint')}, not of "
                f"{self.fingerprint}: the matrix changed since; delete {self.directory} to "
                "start over"
            )
        if record.get("side", "columns") != self.side:  # older checkpoints: A^T A only
            raise ValueError(
                f"{self.record_path} holds a Gram matrix of the {record.get('side')} side, but "
                f"this matrix's Gram matrix is taken on the {self.side} side; delete "
                f"{self.directory} to start over"
            )
        return int(record["rows_done"]), (matrix, record.get("triangle", "full"))

    def save(self, rows_done: int, gram: np.ndarray, triangle: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(".gram-*.npy*.tmp"):  # left by a crash mid-save
            stale.unlink()
        name = f"gram-{rows_done}.npy"
        with atomic_file(self.directory / name) as file:
            np.save(file, gram)
        record = {
            "fingerprint": self.fingerprint,
            "rows_done": rows_done,
            "file": name,
            "triangle": triangle,
            "side": self.side,
        }
        write_text_atomic(self.record_path, json.dumps(record))
        for old in self.directory.glob("gram-*.npy"):
            if old.name != name:
                old.unlink()

    def remove(self) -> None:
        """Delete the checkpoint and its folder (when nothing else is in it)."""
        if not self.directory.is_dir():
            return
        for path in [
            self.record_path,
            *self.directory.glob("gram-*.npy"),
            *self.directory.glob(".*.tmp"),
        ]:
            path.unlink(missing_ok=True)
        if not any(self.directory.iterdir()):
            self.directory.rmdir()


# ---- the rank of a row source: matrix, rank, records ------------------------------------------
#
# :func:`analyze_rank` takes any :class:`~highrank.analysis.rows.RowSource`. Its records go
# to the source's folder (``RUN_DIR/analysis/`` for a run, ``out`` for a causal LM on a text),
# ``TAG`` being the source's tag (``test-best[-logits][-first<N>]``, or
# ``<model>-<text stem>[-w<W>][-bos][-first<N>]``):
#
# * ``rank-TAG.json``: the record (shape, Press rank and threshold, effective ranks, timings);
# * ``rank-TAG.singular_values.npy``: every singular value, descending (float64);
# * ``logprob-TAG.npy`` (+ ``.json``, ``.contexts.npz``): the matrix, kept with
#   ``keep_matrix`` (PTB test: 3.3 GB) and otherwise deleted once its rank is known.
#
# An interrupted analysis resumes: the matrix is only deleted after success and is reused
# (without loading the model) when its side record has the same settings and file
# fingerprints, and the Gram matrix is checkpointed in ``rank-TAG.state/``. Before the forward
# passes it states (with ``progress``) the memory the Gram matrix will need (on the smaller
# side: ``A A^T`` when there are fewer contexts than words) and refuses, in one line, what
# would not fit, or what the disk cannot hold.


def analyze_rank(
    source: RowSource,
    *,
    max_contexts: int | None = None,
    out: str | os.PathLike | None = None,
    kind: str = "log_prob",
    batch_size: int = 1,
    bptt: int | None = None,
    keep_matrix: bool = False,
    backend: str = "auto",
    device: str = "cpu",
    block_rows: int = 2048,
    checkpoint_seconds: float = 600.0,
    progress: bool = False,
) -> dict[str, Any]:
    """Write (or reuse) the log-prob matrix of ``source``'s first ``max_contexts`` rows,
    compute its rank, save and return the record (see the comment above).

    ``out``: the folder of a causal LM's records (a run's go to ``RUN_DIR/analysis``).
    ``kind``, ``batch_size``, ``bptt``: how a run's split is read (``logits``: the head's
    transformed logits; ``bptt`` None: the run's own segment length)."""
    resolve_backend(backend, device)  # a bad pair fails now, not after the matrix is written
    source.check()
    tag = source.tag(kind=kind, max_contexts=max_contexts, batch_size=batch_size, bptt=bptt)
    folder = source.folder(out)
    source.check_record(folder / f"rank-{tag}.json")
    matrix_path = folder / f"logprob-{tag}.npy"
    settings = source.matrix_settings(
        kind=kind, batch_size=batch_size, bptt=bptt, max_contexts=max_contexts
    )
    options = {"backend": backend, "device": device, "block_rows": block_rows}
    folder.mkdir(parents=True, exist_ok=True)
    # One process per record: the matrix, its temporary and the Gram state have fixed names.
    with exclusive(folder / f"rank-{tag}.lock", f"the rank record {tag} of {source.name}"):
        side, seconds = _ensure_matrix(source, matrix_path, settings, progress, options)
        record = source.matrix_description(side, settings, seconds, folder)
        began = time.perf_counter()
        report = rank_report_file(
            matrix_path,
            state_dir=folder / f"rank-{tag}.state",
            checkpoint_seconds=checkpoint_seconds,
            progress=progress,
            **options,
        )
        rank_seconds = time.perf_counter() - began
        values = report.pop("singular_values")
        values_path = folder / f"rank-{tag}.singular_values.npy"
        np.save(values_path, values)
        record = {
            **record,
            **report,
            "s_max": float(values[0]),
            "singular_values_file": values_path.name,
            "rank_seconds": round(rank_seconds, 2),
            "backend": backend,
            "device": device,
        }
        write_json(folder / f"rank-{tag}.json", record)
        if not keep_matrix:
            for path in (matrix_path, matrix_path.with_suffix(".json"), contexts_path(matrix_path)):
                path.unlink(missing_ok=True)
        return record


def _ensure_matrix(
    source: RowSource, matrix_path: Path, settings: dict, progress: bool, options: dict
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(side record, seconds)`` of the matrix at ``matrix_path``: reused when it was
    written with ``settings``, written otherwise (the memory of its Gram matrix and the disk
    space checked first); ``seconds``: ``matrix_reused``, and those of loading the model and
    of the forward passes (with the writing), this time."""
    if matrix_path.is_file() and matrix_path.with_suffix(".json").is_file():
        existing = matrix_record(matrix_path)
        if source.matrix_matches(existing, settings):
            return existing, {"matrix_reused": True, "load_seconds": 0.0, "matrix_seconds": 0.0}
    began = time.perf_counter()
    source.load(progress=progress)
    load_seconds = time.perf_counter() - began
    rows = source.n_contexts(settings["max_contexts"])
    if settings.get("batch_size", 1) > 1:  # a run read in columns: whole columns only
        rows = count_contexts(len(source.ids), settings["batch_size"])
        rows = rows if settings["max_contexts"] is None else min(rows, settings["max_contexts"])
    plan = plan_gram((rows, source.width), **options)
    check_disk_space(matrix_path, (rows, source.width))
    if progress:
        progress_note(source.writing_note(settings, plan.describe()), file=sys.stdout)
    plan.check()  # before the forward passes, not after them
    began = time.perf_counter()
    side = source.write_matrix(matrix_path, settings, progress=progress)
    seconds = {
        "matrix_reused": False,
        "load_seconds": round(load_seconds, 2),
        "matrix_seconds": round(time.perf_counter() - began, 2),
    }
    return side, seconds


def analyze_run(
    run_dir: str | os.PathLike,
    *,
    split: str = "test",
    which: str = "best",
    data_dir: str | None = None,
    **options,
) -> dict[str, Any]:
    """:func:`analyze_rank` of a trained run on ``split`` (``options`` as it takes them;
    ``device`` also places the model)."""
    source = RowSource.from_run(
        run_dir, split, which=which, data_dir=data_dir, device=options.get("device", "cpu")
    )
    return analyze_rank(source, **options)


def analyze_hf(
    model_path: str | os.PathLike,
    text_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    window: int | None = None,
    bos: bool = False,
    batch_windows: int | None = None,
    **options,
) -> dict[str, Any]:
    """:func:`analyze_rank` of a Hugging Face causal LM (a model folder or a ``.gguf`` file)
    on a text, read as :mod:`highrank.analysis.hf_contexts` says; records go to ``out``."""
    source = RowSource.from_causal_lm(
        model_path,
        text_path,
        window=window,
        bos=bos,
        device=options.get("device", "cpu"),
        batch_windows=batch_windows,
    )
    return analyze_rank(source, out=out, **options)


def run_label(record: dict[str, Any]) -> str:
    """``<run folder> (<head>, <tag>)``: how a record is named in tables and legends;
    ``<model> (<text file>, <contexts> contexts, window <W>)`` for a Hugging Face model."""
    if "model" in record:
        return (
            f"{record['model_name']} ({Path(record['text']).name}, "
            f"{record['shape'][0]:,} contexts, window {record['window']})"
        )
    tag = record_tag(
        record["split"], record["which"], kind=record["kind"],
        max_contexts=record["max_contexts"], batch_size=record.get("batch_size", 1),
    )
    return f"{Path(record['run_dir']).name} ({record['head']}, {tag})"


def summary_table(records: list[dict[str, Any]], *, markdown: bool = False) -> str:
    """One row per run: contexts x vocabulary, Press rank, effective ranks, s_max, seconds
    (loading a --hf model, writing the matrix, its rank)."""
    epsilons = [str(eps) for eps in EFFECTIVE_RANK_EPSILONS]
    headers = [
        "run",
        "matrix",
        "Press rank",
        *[f"eff. rank {e}" for e in epsilons],
        "s_max",
        "seconds",
    ]
    rows = [
        [
            run_label(r),
            f"{r['shape'][0]:,} x {r['shape'][1]:,}",
            r["press_rank"],
            *[r["effective_rank"][e] for e in epsilons],
            r["s_max"],
            r.get("load_seconds", 0.0) + r["matrix_seconds"] + r["rank_seconds"],
        ]
        for r in records
    ]
    return text_table(headers, rows, markdown=markdown)


def write_spectrum(records: list[dict[str, Any]], path: Path) -> Path:
    """The spectrum plot of rank records, whose singular values were saved beside them in
    ``<run_dir>/analysis/`` (``run_dir`` as the record says, or as the reader found it)."""
    curves, thresholds, floors = {}, {}, []
    for record in records:
        label = run_label(record)
        folder = Path(record.get("out_dir") or Path(record["run_dir"]) / ANALYSIS_DIR)
        curves[label] = read_npy(folder / record["singular_values_file"])
        thresholds[label] = record["press_threshold"] / record["s_max"]
        if "resolution" in record:
            floors.append(record["resolution"] / record["s_max"])
    floor = max(floors, default=None)
    return plot_spectrum(curves, path, press_thresholds=thresholds, resolution=floor)
