"""Rank of matrices on disk (Gram matrix in float64): agreement with numpy.linalg.svd, planted
ranks, noise either side of the Press threshold, resuming, and the tiny-model theorems."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from highrank.analysis.logprob_matrix import write_log_prob_matrix
from highrank.analysis.rank import (
    _GramCheckpoint,
    press_threshold,
    rank_report,
    rank_report_file,
    streamed_singular_values,
)
from highrank.config import load_config
from highrank.models import build_model

BACKENDS = ("scipy", "torch")


def _planted(m: int, n: int, values, seed: int = 0) -> np.ndarray:
    """float32 U diag(values) V^T with random orthonormal U (m x k), V (n x k)."""
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.standard_normal((m, len(values))))
    v, _ = np.linalg.qr(rng.standard_normal((n, len(values))))
    return ((u * np.asarray(values)) @ v.T).astype(np.float32)


def _save(tmp_path, matrix: np.ndarray, name: str = "a.npy"):
    np.save(tmp_path / name, matrix)
    return tmp_path / name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("m", "n"), [(600, 150), (150, 400), (200, 200)])
def test_singular_values_agree_with_numpy_svd(tmp_path, backend, m, n):
    matrix = np.random.default_rng(m).standard_normal((m, n)).astype(np.float32)
    matrix[:, 0] -= 5.0  # a dominant direction, like the mean log-prob of a real matrix
    values = streamed_singular_values(_save(tmp_path, matrix), block_rows=64, backend=backend)
    expected = np.linalg.svd(matrix.astype(np.float64), compute_uv=False)
    np.testing.assert_allclose(values, expected, rtol=1e-9, atol=1e-9 * expected[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("m", "n", "r"), [(700, 120, 9), (90, 300, 31), (400, 400, 400)])
def test_press_rank_of_a_planted_rank_is_exact_and_matches_the_in_memory_report(
    tmp_path, backend, m, n, r
):
    rng = np.random.default_rng(r)
    matrix = (rng.standard_normal((m, r)) @ rng.standard_normal((r, n))).astype(np.float32)
    report = rank_report_file(_save(tmp_path, matrix), block_rows=100, backend=backend)
    in_memory = rank_report(matrix)
    assert report["press_rank"] == in_memory["press_rank"] == r
    assert report["effective_rank"] == in_memory["effective_rank"]
    assert report["shape"] == [m, n] and report["dtype"] == "float32"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_components_near_the_threshold_are_counted_as_numpy_counts_them(tmp_path, backend, factor):
    """The precision check: 10 strong components and 20 planted at ``factor`` times the float32
    Press threshold (1.8e-5 * s_max here). The Gram method must resolve them: count 10 below
    the threshold, 30 above it, exactly as numpy's float32 SVD does."""
    m, n = 3000, 200
    tau = press_threshold((m, n), 1.0, np.float32)
    values = [1.0] * 10 + [factor * tau] * 20
    matrix = _planted(m, n, values)
    report = rank_report_file(_save(tmp_path, matrix), block_rows=512, backend=backend)
    expected = 10 if factor < 1 else 30
    assert report["press_rank"] == expected == rank_report(matrix)["press_rank"]
    # and the planted small values themselves come back, to a few per cent: they lie above
    # the resolution of the method, which lies well below the threshold
    recovered = report["singular_values"][10:30] / report["singular_values"][0]
    np.testing.assert_allclose(recovered, factor * tau, rtol=0.05)
    assert report["resolution"] == pytest.approx(np.sqrt(n * np.finfo(np.float64).eps))
    assert report["resolution"] < 0.5 * tau


def test_tiny_noise_above_the_threshold_jumps_the_rank_to_full(tmp_path):
    """The known jump: a rank-5 float32 matrix has Press rank 5; noise of relative size 1e-4
    (above the ~1.2e-5 threshold) makes it full rank, and 1e-7 noise does not."""
    rng = np.random.default_rng(3)
    low = rng.standard_normal((800, 5)) @ rng.standard_normal((5, 100))
    scale = np.linalg.norm(low, 2) / np.sqrt(800)  # noise singular values ~ sigma sqrt(m)
    ranks = {}
    for noise in (0.0, 1e-7, 1e-4):
        matrix = (low + noise * scale * rng.standard_normal(low.shape)).astype(np.float32)
        ranks[noise] = rank_report_file(_save(tmp_path, matrix, f"{noise}.npy"))["press_rank"]
    assert ranks == {0.0: 5, 1e-7: 5, 1e-4: 100}


def _crash_after_saves(monkeypatch, saves: int) -> None:
    """Make the ``saves``-th checkpoint save end the run as Ctrl-C would, after saving."""
    calls = {"n": 0}
    real_save = _GramCheckpoint.save

    def save_then_crash(self, *args):
        real_save(self, *args)
        calls["n"] += 1
        if calls["n"] == saves:
            raise KeyboardInterrupt

    monkeypatch.setattr(_GramCheckpoint, "save", save_then_crash)


@pytest.mark.parametrize(
    ("first", "then"), [("scipy", "scipy"), ("scipy", "torch"), ("torch", "scipy")]
)
def test_an_interrupted_run_resumes_from_its_checkpoint_with_the_same_values(
    tmp_path, monkeypatch, first, then
):
    """Crash after the third checkpoint (300 rows), resume, possibly with the other backend
    (scipy keeps only the upper triangle of G; torch mirrors it)."""
    matrix = np.random.default_rng(0).standard_normal((1000, 60)).astype(np.float32)
    path, state = _save(tmp_path, matrix), tmp_path / "state"
    expected = streamed_singular_values(path, block_rows=100)

    with monkeypatch.context() as patch:
        _crash_after_saves(patch, 3)
        with pytest.raises(KeyboardInterrupt):
            streamed_singular_values(
                path, block_rows=100, state_dir=state, checkpoint_seconds=0, backend=first
            )
    assert sorted(p.name for p in state.iterdir()) == ["gram-300.npy", "gram.json"]
    (state / ".gram-400.npy.tmp").write_bytes(b"half a save")  # as a crash mid-save leaves

    import highrank.analysis.logprob_matrix as matrix_module

    rows_read = []
    real_blocks = matrix_module.iter_row_blocks

    def counting(path, block_rows, start_row=0):
        rows_read.append(start_row)
        yield from real_blocks(path, block_rows, start_row)

    monkeypatch.setattr(matrix_module, "iter_row_blocks", counting)
    values = streamed_singular_values(path, block_rows=100, state_dir=state, backend=then)
    assert rows_read == [300]  # resumed, not restarted
    np.testing.assert_allclose(values, expected, rtol=1e-10, atol=1e-12 * expected[0])
    assert not state.exists()  # checkpoint, stray temporary file and folder are removed


def test_a_float64_matrix_is_refused_with_the_reason(tmp_path):
    path = _save(tmp_path, np.ones((6, 3)), "f64.npy")
    with pytest.raises(
        ValueError, match="f64.npy holds float64 values; the streamed rank needs float32"
    ):
        rank_report_file(path)


def test_a_checkpoint_of_another_matrix_is_refused(tmp_path):
    first = _save(tmp_path, np.ones((20, 4), np.float32), "first.npy")
    _GramCheckpoint(tmp_path / "state", first).save(10, np.eye(4), "full")
    second = _save(tmp_path, np.ones((20, 4), np.float32), "second.npy")
    with pytest.raises(ValueError, match="the matrix changed since; delete .*state"):
        streamed_singular_values(second, state_dir=tmp_path / "state")


def test_bad_inputs_are_named(tmp_path):
    path = _save(tmp_path, np.ones((5, 3), np.float32))
    with pytest.raises(ValueError, match="backend must be one of auto, scipy, torch"):
        streamed_singular_values(path, backend="lapack")
    with pytest.raises(ValueError, match="'scipy' runs on the CPU only"):
        streamed_singular_values(path, backend="scipy", device="cuda")
    bad = np.ones((5, 3), np.float32)
    bad[2, 1] = np.nan
    with pytest.raises(ValueError, match="bad.npy: row 2 holds NaN or infinite entries"):
        streamed_singular_values(_save(tmp_path, bad, "bad.npy"))
    with pytest.raises(ValueError, match="shape \\(5,\\); expected a non-empty matrix"):
        streamed_singular_values(_save(tmp_path, np.ones(5, np.float32), "flat.npy"))


NO_DROPOUT = [f"model.dropout_{name}=0" for name in ("embedding", "input", "hidden", "output")]


def _markov_stream(n: int, vocab: int = 60) -> torch.Tensor:
    """A learnable stream: token t + 1 is perm[token t] with probability 0.8, else uniform."""
    generator = torch.Generator().manual_seed(0)
    successor = torch.randperm(vocab, generator=generator)
    stay, jump = (
        torch.rand(n, generator=generator),
        torch.randint(0, vocab, (n,), generator=generator),
    )
    tokens = [0]
    for i in range(n - 1):
        tokens.append(int(successor[tokens[-1]]) if stay[i] < 0.8 else int(jump[i]))
    return torch.tensor(tokens)


def _trained_tiny_model(head: str, *extra: str, decoder_bias: bool = True):
    """A tiny AWD-LSTM language model (d_last = d_embed = 6, no dropout) trained for 150 Adam
    steps on a Markov stream, so that its contexts differ (an untrained model's log-prob rows
    are nearly equal and its higher singular values sink under the float32 threshold).
    Without ``decoder_bias`` the head's bias is held at zero."""
    torch.manual_seed(0)
    sizes = ["model.d_embed=6", "model.d_hidden=16", "model.n_layers=2", "model.weight_drop=0"]
    config = load_config(None, [*sizes, *NO_DROPOUT, f"head.name={head}", *extra])
    model = build_model(config, vocab_size=60)
    if not decoder_bias:
        model.head.bias.requires_grad_(False)
    ids = _markov_stream(400)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(150):
        start = step * 10 % 370
        window = ids[start : start + 21].view(21, 1)  # (T + 1, B = 1)
        loss, _, _ = model(window[:-1], window[1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 3.9  # it learnt something: log 60 = 4.09
    return model.eval(), ids


@pytest.mark.parametrize(("decoder_bias", "expected"), [(True, 8), (False, 7)])
def test_a_tiny_softmax_model_has_log_prob_rank_exactly_d_plus_2(tmp_path, decoder_bias, expected):
    """log p = H E^T + 1 b^T - lse 1^T: rank d + 2 with a decoder bias, d + 1 without (d = 6)."""
    model, ids = _trained_tiny_model("softmax", decoder_bias=decoder_bias)
    assert torch.count_nonzero(model.head.bias) == (60 if decoder_bias else 0)
    write_log_prob_matrix(tmp_path / "m.npy", model, ids, bptt=35)
    assert rank_report_file(tmp_path / "m.npy")["press_rank"] == expected


def test_a_tiny_mos_model_exceeds_d_plus_2(tmp_path):
    model, ids = _trained_tiny_model("mos", "head.n_components=3", "head.latent_dropout=0")
    write_log_prob_matrix(tmp_path / "m.npy", model, ids, bptt=35)
    assert rank_report_file(tmp_path / "m.npy")["press_rank"] > 6 + 2


def test_scipy_is_refused_above_its_limit_and_torch_takes_over(tmp_path, monkeypatch):
    import highrank.analysis.rank as rank

    monkeypatch.setattr(rank, "SCIPY_MAX_N", 50)
    path = _save(tmp_path, np.random.default_rng(0).standard_normal((300, 60)).astype(np.float32))
    with pytest.raises(ValueError, match="limited to n <= 50 .* use backend 'torch'"):
        streamed_singular_values(path, backend="scipy")
    assert streamed_singular_values(path).shape == (60,)  # auto: torch


def test_a_crash_in_the_eigenvalue_step_resumes_without_reading_the_matrix(tmp_path, monkeypatch):
    import highrank.analysis.logprob_matrix as matrix_module
    import highrank.analysis.rank as rank

    matrix = np.random.default_rng(1).standard_normal((500, 40)).astype(np.float32)
    path, state = _save(tmp_path, matrix), tmp_path / "state"
    expected = streamed_singular_values(path, block_rows=100)
    real_eigen = rank._gram_eigenvalues

    def crash(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(rank, "_gram_eigenvalues", crash)
    with pytest.raises(KeyboardInterrupt):
        streamed_singular_values(path, block_rows=100, state_dir=state, checkpoint_seconds=0)
    assert json.loads((state / "gram.json").read_text())["rows_done"] == 500
    monkeypatch.setattr(rank, "_gram_eigenvalues", real_eigen)
    starts = []
    real_blocks = matrix_module.iter_row_blocks
    monkeypatch.setattr(
        matrix_module,
        "iter_row_blocks",
        lambda p, b, start_row=0: starts.append(start_row) or real_blocks(p, b, start_row),
    )
    values = streamed_singular_values(path, block_rows=100, state_dir=state)
    assert starts == [500]  # nothing left to read
    np.testing.assert_allclose(values, expected, rtol=1e-10, atol=1e-12 * expected[0])
