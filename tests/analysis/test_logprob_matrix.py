"""The log-probability matrix: row order, contents, side files, atomic writing, block reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from highrank.analysis.contexts import count_contexts, iter_contexts
from highrank.analysis.logprob_matrix import (
    contexts_path,
    head_rows,
    iter_row_blocks,
    matrix_record,
    npy_layout,
    write_head_matrix,
    write_log_prob_matrix,
    write_matrix,
)
from highrank.analysis.rank import press_rank
from highrank.config import load_config
from highrank.demo import DemoSettings
from highrank.demo import build_model as build_demo_model
from highrank.evaluate import evaluate_perplexity
from highrank.heads import build_head
from highrank.models import build_model

V = 23
SMALL = ["model.d_embed=8", "model.d_hidden=12", "model.n_layers=2"]


def _model(head: str = "softmax", *extra: str):
    torch.manual_seed(0)
    return build_model(load_config(None, [*SMALL, f"head.name={head}", *extra]), vocab_size=V)


def _stream(n: int) -> torch.Tensor:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("batch_size", [1, 3])
def test_rows_are_the_evaluation_log_probs_in_the_order_of_their_positions(tmp_path, batch_size):
    model, ids = _model("mos"), _stream(101)
    record = write_log_prob_matrix(
        tmp_path / "m.npy", model, ids, batch_size=batch_size, bptt=7, metadata={"split": "x"}
    )
    matrix = np.load(tmp_path / "m.npy")
    sides = np.load(contexts_path(tmp_path / "m.npy"))
    assert matrix.shape == (count_contexts(101, batch_size), V) == tuple(record["shape"])
    assert record["split"] == "x" and matrix_record(tmp_path / "m.npy")["kind"] == "log_prob"
    np.testing.assert_array_equal(sides["targets"], ids[sides["positions"] + 1].numpy())
    np.testing.assert_allclose(np.exp(matrix).sum(1), 1.0, rtol=1e-5)
    # The NLL of each row's target is what evaluation scores at that position.
    nll = -matrix[np.arange(len(matrix)), sides["targets"]]
    result = evaluate_perplexity(model, ids, batch_size=batch_size, bptt=7, return_token_nll=True)
    np.testing.assert_allclose(nll, result.token_nll.numpy()[sides["positions"]], rtol=1e-5)
    if batch_size == 1:
        np.testing.assert_array_equal(sides["positions"], np.arange(100))


def test_max_contexts_keeps_a_prefix_and_the_model_mode_is_restored(tmp_path):
    model, ids = _model(), _stream(90)
    model.train()
    write_log_prob_matrix(tmp_path / "full.npy", model, ids, bptt=10)
    write_log_prob_matrix(tmp_path / "part.npy", model, ids, bptt=10, max_contexts=25)
    assert model.training
    full, part = np.load(tmp_path / "full.npy"), np.load(tmp_path / "part.npy")
    assert part.shape == (25, V)
    np.testing.assert_array_equal(part, full[:25])
    blocks = list(iter_contexts(model, ids, bptt=10, max_contexts=25))
    assert [len(b) for b in blocks] == [10, 10, 5]


def test_logits_kind_gives_the_transformed_logits_of_sigsoftmax(tmp_path):
    model, ids = _model("sigsoftmax"), _stream(40)
    write_log_prob_matrix(tmp_path / "z.npy", model, ids, kind="logits", bptt=9)
    z = torch.from_numpy(np.load(tmp_path / "z.npy"))
    write_log_prob_matrix(tmp_path / "p.npy", model, ids, bptt=9)
    log_probs = np.load(tmp_path / "p.npy")
    np.testing.assert_allclose(torch.log_softmax(z, -1).numpy(), log_probs, atol=1e-5)
    with pytest.raises(ValueError, match="kind='logits' needs a head of the softmax family"):
        write_log_prob_matrix(tmp_path / "w.npy", _model("mos"), ids, kind="logits")
    with pytest.raises(ValueError, match="kind must be one of log_prob, logits"):
        head_rows(model.head, torch.zeros(1, 8), "probs")


def test_demo_heads_write_their_matrix_and_it_has_the_in_memory_rank(tmp_path):
    settings = DemoSettings(contexts=64, vocab=48, rank=16, dim=4)
    for name in ("softmax", "mos"):
        contexts, head = build_demo_model(name, settings)
        path = write_head_matrix(
            tmp_path / f"{name}.npy", head, contexts.weight.detach(), block_rows=20
        )
        with torch.no_grad():
            expected = head.log_prob(contexts.weight).numpy()
        np.testing.assert_allclose(np.load(path), expected, rtol=1e-6, atol=1e-6)
        assert press_rank(np.load(path)) == press_rank(expected)


def test_an_interrupted_write_leaves_nothing_behind(tmp_path):
    def blocks():
        yield np.zeros((3, 4), np.float32)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_matrix(tmp_path / "m.npy", blocks(), (6, 4))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="2 rows written but 6 announced"):
        write_matrix(tmp_path / "m.npy", [np.zeros((2, 4))], (6, 4))
    with pytest.raises(ValueError, match=r"shape \(2, 5\) does not fit a \(6, 4\) matrix"):
        write_matrix(tmp_path / "m.npy", [np.zeros((2, 5))], (6, 4))
    assert list(tmp_path.iterdir()) == []


def test_block_reads_match_numpy_and_truncation_is_named(tmp_path):
    array = np.arange(7 * 5, dtype=np.float32).reshape(7, 5)
    np.save(tmp_path / "a.npy", array)
    assert npy_layout(tmp_path / "a.npy")[:2] == ((7, 5), np.dtype("float32"))
    got = [(first, block.copy()) for first, block in iter_row_blocks(tmp_path / "a.npy", 3, 1)]
    assert [first for first, _ in got] == [1, 4]
    np.testing.assert_array_equal(np.concatenate([b for _, b in got]), array[1:])
    data = (tmp_path / "a.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(data[:-8])
    with pytest.raises(ValueError, match="cut.npy is truncated or padded"):
        npy_layout(tmp_path / "cut.npy")
    (tmp_path / "text.npy").write_text("hello")
    with pytest.raises(ValueError, match="text.npy is not a .npy file"):
        npy_layout(tmp_path / "text.npy")
    with pytest.raises(FileNotFoundError, match="matrix file .*none.npy does not exist"):
        npy_layout(tmp_path / "none.npy")


def test_head_rows_of_every_head_are_normalised():
    hidden = torch.randn(5, 6)
    for name in ("softmax", "moc", "mos", "mixtape", "sigsoftmax", "gss", "plif"):
        head = build_head(name, d_in=6, vocab_size=30).eval()
        with torch.no_grad():
            rows = head_rows(head, hidden)
        assert rows.dtype == torch.float32 and rows.shape == (5, 30)
        torch.testing.assert_close(rows.exp().sum(-1), torch.ones(5))
