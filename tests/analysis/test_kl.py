"""Expected pairwise KL: the divergence against closed forms, the pair sampler, the streamed
(memory-bounded) computation against a brute force over a matrix in memory, and the CLI."""

from __future__ import annotations

import json
import math
import shutil
import warnings

import numpy as np
import pytest
import torch

from highrank.analysis.contexts import load_run_split
from highrank.analysis.kl import (
    KLError,
    expected_pairwise_kl,
    kl_divergence,
    matrix_pairwise_kl,
    matrix_row_blocks,
    model_pairwise_kl,
    pair_kl_values,
    run_pairwise_kl,
    sample_pairs,
    summarize,
)
from highrank.analysis.logprob_matrix import write_log_prob_matrix
from highrank.analysis.output import run_record_path
from highrank.cli import main
from highrank.config import load_config
from highrank.models import build_model

V = 17


def log_softmax_rows(n: int, vocab: int = V, seed: int = 0, scale: float = 2.0) -> np.ndarray:
    """``(n, vocab)`` float32 normalised log-probabilities of random logits."""
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    return torch.log_softmax(logits, dim=1).numpy()


def log(probabilities) -> np.ndarray:
    """Natural log with log(0) = -inf, quietly."""
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(probabilities, dtype=np.float64))


def brute_force(matrix: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """KL of each pair from the whole matrix in memory: the simple path."""
    return kl_divergence(matrix[pairs[:, 0]], matrix[pairs[:, 1]])


# ---- the divergence ----------------------------------------------------------------------------


def test_kl_of_a_distribution_with_itself_is_zero():
    rows = log_softmax_rows(6)
    np.testing.assert_array_equal(kl_divergence(rows, rows), np.zeros(6))
    as_tensor = torch.from_numpy(rows)
    np.testing.assert_array_equal(kl_divergence(as_tensor, as_tensor), np.zeros(6))


def test_kl_of_two_bernoullis_matches_the_hand_computation():
    p, q = np.log([0.5, 0.5]), np.log([0.25, 0.75])
    # KL(p || q) = 0.5 ln(0.5 / 0.25) + 0.5 ln(0.5 / 0.75) = 0.5 ln(4 / 3).
    assert kl_divergence(p, q) == pytest.approx(0.5 * math.log(4 / 3), rel=1e-14)
    # KL(q || p) = 0.25 ln(0.25 / 0.5) + 0.75 ln(0.75 / 0.5): not symmetric.
    expected = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert kl_divergence(q, p) == pytest.approx(expected, rel=1e-14)


def test_kl_of_two_categoricals_matches_the_hand_computation():
    # p = (1/2, 1/4, 1/4), q = (1/4, 1/4, 1/2):
    # 1/2 ln 2 + 1/4 ln 1 + 1/4 ln(1/2) = 1/4 ln 2, in both directions.
    p, q = np.log([0.5, 0.25, 0.25]), np.log([0.25, 0.25, 0.5])
    result = kl_divergence(np.stack([p, q]), np.stack([q, p]))
    np.testing.assert_allclose(result, [0.25 * math.log(2)] * 2, rtol=1e-14)
    assert result.dtype == np.float64


def test_kl_of_a_softmax_from_the_uniform_is_log_v_minus_its_entropy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    log_p = torch.log_softmax(logits, dim=1)
    entropy = -(log_p.exp() * log_p).sum(1).numpy()
    uniform = torch.full_like(log_p, -math.log(50))
    np.testing.assert_allclose(kl_divergence(log_p, uniform), math.log(50) - entropy, rtol=1e-12)


def test_zero_probabilities_in_p_add_nothing_and_raise_no_warning():
    p = log([0.5, 0.5, 0.0])  # -inf for the last word
    q = log([0.5, 0.25, 0.25])
    both_zero = log([0.5, 0.5, 0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a NaN from 0 * inf or -inf - -inf would warn
        assert kl_divergence(p, q) == pytest.approx(0.5 * math.log(2), rel=1e-14)
        assert kl_divergence(p, both_zero) == 0.0  # p = q = 0 on the last word: 0, not NaN


def test_zero_probability_in_q_where_p_is_positive_gives_inf():
    p = log([0.5, 0.25, 0.25])
    q = log([0.5, 0.5, 0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kl_divergence(p, q) == math.inf


def test_kl_rejects_rows_of_different_shapes():
    with pytest.raises(ValueError, match="one shape"):
        kl_divergence(np.zeros((2, 3)), np.zeros((2, 4)))


# ---- the pairs ---------------------------------------------------------------------------------


def test_pairs_are_reproducible_in_range_and_never_pair_a_context_with_itself():
    pairs = sample_pairs(40, 5000, seed=7)
    assert pairs.shape == (5000, 2) and pairs.dtype == np.int64
    np.testing.assert_array_equal(pairs, sample_pairs(40, 5000, seed=7))
    assert not np.array_equal(pairs, sample_pairs(40, 5000, seed=8))
    assert pairs.min() == 0 and pairs.max() == 39
    assert np.all(pairs[:, 0] != pairs[:, 1])
    two = sample_pairs(2, 100, seed=0)  # with two contexts only (0, 1) and (1, 0) exist
    assert {tuple(p) for p in two.tolist()} == {(0, 1), (1, 0)}


def test_pairs_are_uniform_over_the_ordered_pairs_of_distinct_contexts():
    # n = 3: six ordered pairs, each with probability 1/6; 60,000 draws give each count a
    # standard deviation of sqrt(60000 * 1/6 * 5/6) ~ 91, so 5 sigma is ~460.
    pairs = sample_pairs(3, 60_000, seed=1)
    codes, counts = np.unique(pairs[:, 0] * 3 + pairs[:, 1], return_counts=True)
    assert codes.tolist() == [1, 2, 3, 5, 6, 7]  # every (i, j) with i != j, no (i, i)
    assert np.all(np.abs(counts - 10_000) < 460)


@pytest.mark.parametrize(("n_contexts", "n_pairs"), [(1, 10), (0, 10), (5, 0)])
def test_sample_pairs_rejects_too_few_contexts_or_pairs(n_contexts, n_pairs):
    with pytest.raises(KLError, match="n_contexts >= 2|positive"):
        sample_pairs(n_contexts, n_pairs, seed=0)


# ---- streamed versus in memory -----------------------------------------------------------------


@pytest.mark.parametrize("block_rows", [1, 7, 300])
def test_streamed_values_equal_the_brute_force_over_the_whole_matrix(block_rows):
    matrix = log_softmax_rows(200)
    pairs = sample_pairs(200, 400, seed=2)
    all_rows = ((np.arange(s, s + block_rows)[: 200 - s], matrix[s : s + block_rows])
                for s in range(0, 200, block_rows))  # fmt: skip
    values, _ = pair_kl_values(all_rows, pairs)
    np.testing.assert_allclose(values, brute_force(matrix, pairs), rtol=1e-12)
    only_needed, _ = pair_kl_values(matrix_row_blocks(matrix, np.unique(pairs), 5), pairs)
    np.testing.assert_allclose(only_needed, brute_force(matrix, pairs), rtol=1e-12)


def test_expected_kl_is_the_brute_force_mean_std_and_standard_error_over_the_same_pairs():
    matrix = log_softmax_rows(150)
    result = matrix_pairwise_kl(matrix, n_pairs=500, seed=3)
    values = brute_force(matrix, sample_pairs(150, 500, seed=3))
    assert result["mean"] == pytest.approx(values.mean(), rel=1e-12)
    assert result["std"] == pytest.approx(values.std(ddof=1), rel=1e-10)
    assert result["stderr"] == pytest.approx(values.std(ddof=1) / math.sqrt(500), rel=1e-10)
    assert result["pairs"] == 500 and result["seed"] == 3 and result["n_contexts"] == 150
    assert result["distinct_contexts"] == len(np.unique(sample_pairs(150, 500, seed=3)))
    assert result["infinite_pairs"] == 0
    assert matrix_pairwise_kl(torch.from_numpy(matrix), n_pairs=500, seed=3) == result


def test_a_matrix_on_disk_is_read_at_the_needed_rows_and_gives_the_same_result(tmp_path):
    matrix = log_softmax_rows(120)
    np.save(tmp_path / "m.npy", matrix)
    in_memory = matrix_pairwise_kl(matrix, n_pairs=300, seed=4, max_contexts=90)
    on_disk = matrix_pairwise_kl(tmp_path / "m.npy", n_pairs=300, seed=4, max_contexts=90)
    assert on_disk == in_memory
    assert on_disk["n_contexts"] == 90
    values = brute_force(matrix[:90], sample_pairs(90, 300, seed=4))
    assert on_disk["mean"] == pytest.approx(values.mean(), rel=1e-12)


def test_rows_are_dropped_once_their_pairs_are_scored():
    # 3,000 contexts and 100 pairs: ~200 distinct rows, but a row waits only until its
    # partner arrives, so far fewer are held at once (about S / 2 = 50 for spread pairs).
    matrix = log_softmax_rows(3000, vocab=5)
    pairs = sample_pairs(3000, 100, seed=5)
    blocks = ((np.arange(s, s + 10), matrix[s : s + 10]) for s in range(0, 3000, 10))
    values, peak = pair_kl_values(blocks, pairs)
    np.testing.assert_allclose(values, brute_force(matrix, pairs), rtol=1e-12)
    assert peak < 0.5 * len(np.unique(pairs))


def test_the_model_path_equals_the_written_matrix(tmp_path):
    torch.manual_seed(0)
    small = ["model.d_embed=8", "model.d_hidden=12", "model.n_layers=2", "head.name=mos"]
    model = build_model(load_config(None, small), vocab_size=V)
    with torch.no_grad():  # at init the contexts barely differ (pairwise KL ~1e-8: rounding);
        for parameter in model.parameters():  # larger weights make KLs ~0.1 to compare
            parameter.mul_(8)
    ids = torch.randint(0, V, (150,), generator=torch.Generator().manual_seed(1))
    write_log_prob_matrix(tmp_path / "m.npy", model, ids, bptt=7)
    for cap in (None, 60):
        streamed = model_pairwise_kl(model, ids, n_pairs=200, seed=6, max_contexts=cap, bptt=7)
        written = matrix_pairwise_kl(tmp_path / "m.npy", n_pairs=200, seed=6, max_contexts=cap)
        assert streamed["n_contexts"] == written["n_contexts"] == (cap or 149)
        assert streamed["mean"] > 0.05  # far above float32 rounding
        assert streamed["mean"] == pytest.approx(written["mean"], rel=1e-5)
        assert streamed["std"] == pytest.approx(written["std"], rel=1e-4)


def test_infinite_divergences_are_counted_and_make_the_mean_infinite():
    matrix = log([[0.5, 0.5], [1.0, 0.0], [0.25, 0.75]])
    pairs = np.array([[0, 1], [1, 0], [0, 2]])  # KL(row0 || row1) = inf: row1 has a zero
    values, _ = pair_kl_values(matrix_row_blocks(matrix, np.arange(3)), pairs)
    assert values[0] == math.inf and np.isfinite(values[1:]).all()
    summary = summarize(values)
    assert summary["mean"] == math.inf and summary["infinite_pairs"] == 1
    assert math.isnan(summary["std"])


def test_a_source_that_ends_early_or_goes_backwards_is_an_error():
    matrix = log_softmax_rows(20)
    pairs = np.array([[0, 19], [3, 4]])
    with pytest.raises(KLError, match="need contexts up to 19"):
        pair_kl_values(matrix_row_blocks(matrix[:10], np.arange(10)), pairs)
    backwards = [(np.array([5]), matrix[5:6]), (np.array([2]), matrix[2:3])]
    with pytest.raises(ValueError, match="ascending"):
        pair_kl_values(backwards, np.array([[5, 9]]))
    with pytest.raises(KLError, match=r"skipped context\(s\) \[3, 4\]"):
        pair_kl_values([(np.array([5]), matrix[5:6])], pairs)
    with pytest.raises(KLError, match="n_contexts >= 2"):
        expected_pairwise_kl(lambda needed: [], 1, n_pairs=5)


# ---- a trained run and the command line --------------------------------------------------------


@pytest.fixture
def run_dir(tiny_run, tmp_path):
    """A private copy of the session's tiny run (the CLI writes into its analysis folder)."""
    return shutil.copytree(tiny_run, tmp_path / "run")


def test_run_pairwise_kl_records_the_protocol(run_dir):
    split = load_run_split(run_dir, "test")
    record = run_pairwise_kl(split, n_pairs=50, seed=1)
    assert record["head"] == "softmax" and record["split"] == "test"
    assert record["pairs"] == 50 and record["seed"] == 1 and record["rows_from"] == "model"
    assert set(record["protocol"]) == {"contexts", "pairs", "kl", "std", "stderr"}
    assert record["mean"] >= 0.0 and math.isfinite(record["stderr"])


def test_cli_prints_the_table_and_writes_the_records(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["analyze", "kl", str(run_dir), "--pairs", "80", "--seed", "2", "--no-progress"]
    assert main([*args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mean KL" in printed and "s.e." in printed and "softmax" in printed
    # a sample other than the default is named by it: it never replaces the default record
    assert not run_record_path(run_dir, "kl", "test-best").exists()
    record = json.loads(run_record_path(run_dir, "kl", "test-best-pairs80-seed2").read_text())
    assert record["pairs"] == 80 and record["seed"] == 2 and record["checkpoint"] == "best"
    assert "protocol" in record and record["mean"] >= 0.0
    summary = json.loads((out / "kl.json").read_text())
    assert summary["runs"][0]["mean"] == record["mean"]
    assert "| softmax |" in (out / "kl.md").read_text()
    # The library on the same run and seed gives the same number.
    again = run_pairwise_kl(load_run_split(run_dir, "test"), n_pairs=80, seed=2)
    assert again["mean"] == pytest.approx(record["mean"], rel=1e-12)


def test_cli_reads_a_written_matrix_instead_of_the_model(run_dir, capsys):
    split = load_run_split(run_dir, "test")
    path = run_dir / "analysis" / "logprob-test-best.npy"
    metadata = {"split": "test", "which": "best"}
    write_log_prob_matrix(path, split.model, split.ids, metadata=metadata)
    args = ["analyze", "kl", str(run_dir), "--pairs", "60", "--no-progress"]
    assert main([*args, "--matrix", str(path)]) == 0
    from_matrix = json.loads(run_record_path(run_dir, "kl", "test-best-pairs60-seed0").read_text())
    assert from_matrix["rows_from"] == str(path)
    assert main(args) == 0
    from_model = json.loads(run_record_path(run_dir, "kl", "test-best-pairs60-seed0").read_text())
    assert from_matrix["mean"] == pytest.approx(from_model["mean"], rel=1e-5)
    capsys.readouterr()
    # The matrix's record says test: asking for valid is refused, naming the key.
    assert main([*args, "--matrix", str(path), "--split", "valid"]) == 2
    assert "split='test'" in capsys.readouterr().err


def test_cli_errors_are_one_line_with_exit_status_2(run_dir, tmp_path, capsys):
    args = ["analyze", "kl", str(run_dir), "--no-progress"]
    assert main([*args, "--max-contexts", "1"]) == 2
    assert "n_contexts >= 2" in capsys.readouterr().err
    assert main([*args, "--matrix", "a.npy", "--matrix", "b.npy"]) == 2
    assert "one matrix per run directory" in capsys.readouterr().err
    assert main([*args, "--matrix", str(tmp_path / "missing.npy")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["analyze", "kl", str(tmp_path / "nowhere"), "--no-progress"]) == 2
    assert "error" in capsys.readouterr().err
