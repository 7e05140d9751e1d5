"""Rank of matrices with fewer rows than columns (contexts < vocabulary): the Gram matrix on the
smaller side, G = A A^T, against numpy's SVD, both backends; resuming its checkpoints; and the
memory plan that is stated and checked before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import highrank.analysis.logprob_matrix as matrix_module
import highrank.analysis.rank as rank
from highrank.analysis.rank import (
    GramMemoryError,
    _GramCheckpoint,
    available_memory_bytes,
    plan_gram,
    press_threshold,
    rank_report,
    rank_report_file,
    streamed_singular_values,
)
from highrank.cli import main

BACKENDS = ("scipy", "torch")


def _save(tmp_path, matrix: np.ndarray, name: str = "a.npy"):
    np.save(tmp_path / name, matrix)
    return tmp_path / name


def _random(m: int, n: int, seed: int = 0) -> np.ndarray:
    matrix = np.random.default_rng(seed).standard_normal((m, n)).astype(np.float32)
    matrix[:, 0] -= 5.0  # a dominant direction, like the mean log-prob of a real matrix
    return matrix


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("m", "n", "block_rows"),
    [(150, 400, 64), (97, 5000, 40), (1, 30, 8), (60, 61, 1000), (400, 150, 64), (300, 90, 7)],
)
def test_wide_and_tall_singular_values_agree_with_numpy_svd(tmp_path, backend, m, n, block_rows):
    """Wide (panels that do not divide m, a single row, one panel holding all) and tall."""
    matrix = _random(m, n, seed=m + n)
    path = _save(tmp_path, matrix)
    values = streamed_singular_values(path, block_rows=block_rows, backend=backend)
    expected = np.linalg.svd(matrix.astype(np.float64), compute_uv=False)
    assert values.shape == (min(m, n),)
    np.testing.assert_allclose(values, expected, rtol=1e-9, atol=1e-9 * expected[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_matrix_and_its_transpose_have_one_report(tmp_path, backend):
    """Same singular values, Press threshold (m + n + 1, s_max) and ranks on either side."""
    rng = np.random.default_rng(5)
    matrix = (rng.standard_normal((80, 13)) @ rng.standard_normal((13, 700))).astype(np.float32)
    wide = rank_report_file(_save(tmp_path, matrix, "w.npy"), block_rows=30, backend=backend)
    tall = rank_report_file(_save(tmp_path, matrix.T.copy(), "t.npy"), block_rows=30)
    assert wide["gram_side"] == "rows" and tall["gram_side"] == "columns"
    assert wide["press_rank"] == tall["press_rank"] == rank_report(matrix)["press_rank"] == 13
    assert wide["press_threshold"] == pytest.approx(tall["press_threshold"], rel=1e-9)
    assert wide["effective_rank"] == tall["effective_rank"]
    assert wide["gram_seconds"] >= 0 and wide["eigen_seconds"] >= 0
    assert wide["gram_backend"] == backend and "Gram matrix A A^T" in wide["memory_plan"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_the_row_side_resolves_components_near_the_threshold(tmp_path, backend, factor):
    """10 strong components and 20 at ``factor`` times the float32 Press threshold of a
    200 x 3000 matrix: 10 counted below it, 30 above it, as numpy's float32 SVD counts."""
    m, n = 200, 3000
    tau = press_threshold((m, n), 1.0, np.float32)
    rng = np.random.default_rng(1)
    u, _ = np.linalg.qr(rng.standard_normal((m, 30)))
    v, _ = np.linalg.qr(rng.standard_normal((n, 30)))
    matrix = ((u * np.array([1.0] * 10 + [factor * tau] * 20)) @ v.T).astype(np.float32)
    report = rank_report_file(_save(tmp_path, matrix), block_rows=64, backend=backend)
    assert report["press_rank"] == (10 if factor < 1 else 30) == rank_report(matrix)["press_rank"]
    recovered = report["singular_values"][10:30] / report["singular_values"][0]
    np.testing.assert_allclose(recovered, factor * tau, rtol=0.05)


# ---- checkpoints of the row side ----------------------------------------------------------


def _crash_after_saves(monkeypatch, saves: int) -> None:
    calls = {"n": 0}
    real_save = _GramCheckpoint.save

    def save_then_crash(self, *args):
        real_save(self, *args)
        calls["n"] += 1
        if calls["n"] == saves:
            raise KeyboardInterrupt

    monkeypatch.setattr(_GramCheckpoint, "save", save_then_crash)


def _count_panel_starts(monkeypatch) -> list[int]:
    """Record the start row of every read; panels are the reads that start at a multiple of
    the panel size and are followed by the blocks after them."""
    starts: list[int] = []
    real_blocks = matrix_module.iter_row_blocks

    def counting(path, block_rows, start_row=0):
        starts.append(start_row)
        yield from real_blocks(path, block_rows, start_row)

    monkeypatch.setattr(matrix_module, "iter_row_blocks", counting)
    return starts


@pytest.mark.parametrize(
    ("first", "then"), [("torch", "torch"), ("scipy", "torch"), ("torch", "scipy")]
)
def test_an_interrupted_wide_run_resumes_at_its_last_panel(tmp_path, monkeypatch, first, then):
    """Panels of 40 rows of a 150 x 900 matrix, a checkpoint after each: crash after the
    second (rows 0-79 of G done), resume, possibly with the other backend."""
    matrix = _random(150, 900, seed=2)
    path, state = _save(tmp_path, matrix), tmp_path / "state"
    expected = streamed_singular_values(path, block_rows=40)
    with monkeypatch.context() as patch:
        _crash_after_saves(patch, 2)
        with pytest.raises(KeyboardInterrupt):
            streamed_singular_values(
                path, block_rows=40, state_dir=state, checkpoint_seconds=0, backend=first
            )
    assert sorted(p.name for p in state.iterdir()) == ["gram-80.npy", "gram.json"]
    saved = json.loads((state / "gram.json").read_text())
    assert saved["side"] == "rows" and saved["rows_done"] == 80
    starts = _count_panel_starts(monkeypatch)
    values = streamed_singular_values(path, block_rows=40, state_dir=state, backend=then)
    assert starts[0] == 80 and 0 not in starts and 40 not in starts  # resumed, not restarted
    np.testing.assert_allclose(values, expected, rtol=1e-10, atol=1e-12 * expected[0])
    assert not state.exists()


def test_a_crash_in_the_eigenvalue_step_of_the_row_side_resumes_without_reading(
    tmp_path, monkeypatch
):
    matrix = _random(90, 400, seed=3)
    path, state = _save(tmp_path, matrix), tmp_path / "state"
    expected = streamed_singular_values(path, block_rows=40)
    with monkeypatch.context() as patch:
        patch.setattr(
            rank, "_gram_eigenvalues", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt)
        )
        with pytest.raises(KeyboardInterrupt):
            streamed_singular_values(path, block_rows=40, state_dir=state, checkpoint_seconds=0)
    assert json.loads((state / "gram.json").read_text())["rows_done"] == 90
    starts = _count_panel_starts(monkeypatch)
    values = streamed_singular_values(path, block_rows=40, state_dir=state)
    assert starts == [90]  # nothing left to read
    np.testing.assert_allclose(values, expected, rtol=1e-10, atol=1e-12 * expected[0])


def test_a_checkpoint_of_the_other_side_is_refused(tmp_path):
    path = _save(tmp_path, _random(20, 50))
    _GramCheckpoint(tmp_path / "state", path).save(10, np.eye(50), "upper")  # A^T A side
    with pytest.raises(ValueError, match="columns side, but .* rows side; delete .*state"):
        streamed_singular_values(path, state_dir=tmp_path / "state")


# ---- the memory plan ----------------------------------------------------------------------


def test_the_plan_takes_the_smaller_side_and_counts_its_bytes():
    plan = plan_gram((8192, 49_152), block_rows=2048, backend="torch", available_bytes=None)
    assert plan.side == "rows" and plan.gram_bytes == 8 * 8192**2
    assert plan.eigen_bytes == plan.gram_bytes  # torch's eigvalsh copies G
    # the panel and a block (float32), their float64 chunks, the product block
    assert plan.work_bytes == 8 * 2048 * 49_152 + 16 * 2048 * 4096 + 8 * 2048**2
    assert plan.peak_bytes == plan.gram_bytes + max(plan.work_bytes, plan.eigen_bytes)
    assert plan.fits and "8,192 x 8,192 float64 = 0.54 GB" in plan.describe()
    tall = plan_gram((82_430, 10_000), block_rows=2048, backend="scipy", available_bytes=None)
    assert tall.side == "columns" and tall.gram_bytes == 8 * 10_000**2 and tall.eigen_bytes == 0


def test_a_gram_matrix_that_does_not_fit_is_refused_in_one_line():
    """49,152^2 doubles are 19.3 GB; torch needs two of them, and scipy cannot take n > 20,000."""
    plan = plan_gram((245_568, 49_152), available_bytes=23_000_000_000)
    assert plan.backend == "torch" and not plan.fits
    with pytest.raises(GramMemoryError) as error:
        plan.check()
    message = str(error.value)
    assert "\n" not in message
    assert "49,152 x 49,152 float64 = 19.33 GB" in message and "peak about 38.65 GB" in message
    assert "MemAvailable: 23.00 GB" in message and "--max-contexts" in message


def test_auto_switches_to_scipy_when_only_its_plan_fits():
    """n = 15,000: G = 1.8 GB; torch's peak 3.6 GB does not fit in 3 GB, scipy's does."""
    auto = plan_gram((100_000, 15_000), block_rows=256, available_bytes=3_000_000_000)
    assert auto.backend == "scipy" and auto.fits
    torch_plan = plan_gram((100_000, 15_000), block_rows=256, backend="torch", available_bytes=3e9)
    assert not torch_plan.fits  # asked for by name, it is not switched
    roomy = plan_gram((100_000, 15_000), block_rows=256, available_bytes=10**12)
    assert roomy.backend == "torch"


def test_the_streamed_rank_refuses_before_reading_and_states_the_plan(
    tmp_path, monkeypatch, capsys
):
    path = _save(tmp_path, _random(30, 200))
    monkeypatch.setattr(rank, "available_memory_bytes", lambda device="cpu": 10_000)
    starts = _count_panel_starts(monkeypatch)
    with pytest.raises(GramMemoryError, match="30 x 30 float64 = 0.0 MB; peak about"):
        streamed_singular_values(path, state_dir=tmp_path / "state", progress=True)
    assert starts == [] and not (tmp_path / "state").exists()
    assert "rank of a 30 x 200 matrix: Gram matrix A A^T" in capsys.readouterr().err


def test_available_memory_is_read_from_proc_meminfo():
    if not Path("/proc/meminfo").is_file():
        pytest.skip("no /proc/meminfo on this system (not Linux)")
    meminfo = Path("/proc/meminfo").read_text()
    assert "MemAvailable:" in meminfo
    assert available_memory_bytes("cpu") > 0


def test_analyze_rank_of_a_run_refuses_a_plan_that_does_not_fit(
    tiny_run, tmp_path, monkeypatch, capsys
):
    run = shutil.copytree(tiny_run, tmp_path / "run")
    monkeypatch.setattr(rank, "available_memory_bytes", lambda device="cpu": 1000)
    assert main(["analyze", "rank", str(run), "--no-progress"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("highrank analyze rank: error: rank of a ") and "\n" not in error
