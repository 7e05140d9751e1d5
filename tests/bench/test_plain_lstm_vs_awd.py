"""Smoke tests of benchmarks/studies/plain_lstm_vs_awd.py and benchmarks/studies/plain_lstm.py
on a tiny synthetic corpus (the real numbers come from the script on Penn Treebank)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.studies import plain_lstm
from highrank.data import load_corpus
from highrank.models import build_model, count_parameters
from tests.conftest import TRAIN_WORDS, write_corpus

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "ptb" / "small-softmax.toml"
TINY = ["model.d_embed=8", "model.d_hidden=12", "train.batch_size=4", "train.bptt=6"]


@pytest.fixture
def corpus(tmp_path) -> Path:
    """train / valid / test of 120 / 20 / 20 random 3-9 word lines over a 30-word vocabulary."""
    return write_corpus(tmp_path / "corpus", words=TRAIN_WORDS, lines=(120, 20, 20))


def load_script():
    from benchmarks.studies import plain_lstm_vs_awd

    return plain_lstm_vs_awd


def test_script_writes_the_json_and_prints_the_table(corpus, tmp_path, capsys):
    out = tmp_path / "result.json"
    argv = ["--data-dir", str(corpus), "--steps", "2", "--repeats", "2", "--warmup", "1"]
    argv += ["--threads", "1", "--out", str(out), *(f"--set={o}" for o in TINY)]
    assert load_script().main(argv) == 0
    result = json.loads(out.read_text())
    ours, plain = result["models"]["ours"], result["models"]["plain"]
    assert result["same_parameter_count"] and ours["parameters"] == plain["parameters"]
    assert result["eval_loss_difference"] < 1e-5  # the same function, from the same weights
    for row in (ours, plain):
        assert len(row["tokens_per_s"]) == 2 and row["median_tokens_per_s"] > 0
    assert result["ratio_of_medians"] > 0 and result["median_of_round_ratios"] > 0
    assert result["settings"]["layer_sizes"] == [12, 8] and result["settings"]["threads"] == 1
    assert {"cpu", "torch", "torch_threads"} <= result["machine"].keys()
    assert "one nn.LSTM per layer" in plain["description"]
    assert result["command"].startswith("python -m benchmarks.studies.plain_lstm_vs_awd --data-dir")
    printed = capsys.readouterr().out
    assert "| ours (highrank AWD-LSTM) |" in printed and "Ours / plain:" in printed


def test_script_refuses_a_missing_corpus(tmp_path, capsys):
    assert load_script().main(["--data-dir", str(tmp_path / "nowhere")]) == 2
    assert "pass --data-dir" in capsys.readouterr().err


def test_the_benchmark_config_switches_every_regularizer_off(corpus):
    config = plain_lstm.benchmark_config(RECIPE, corpus)
    m = config.model
    assert (m.dropout_embedding, m.dropout_input, m.weight_drop) == (0, 0, 0)
    assert (m.ar_alpha, m.tar_beta) == (0, 0)
    assert (m.dropout_hidden, m.dropout_output) == (0.25, 0.4)  # the plain model's dropouts
    with pytest.raises(ValueError, match="tied softmax"):
        plain_lstm.benchmark_config(RECIPE, corpus, ["head.name=mos"])


@pytest.mark.parametrize("d_hidden, stacked", [(12, False), (8, True)])
def test_plain_model_has_our_sizes_and_computes_our_function(corpus, d_hidden, stacked):
    overrides = [f"model.d_hidden={d_hidden}", *TINY[:1], *TINY[2:], "model.n_layers=3"]
    config = plain_lstm.benchmark_config(RECIPE, corpus, overrides)
    ours = build_model(config, len(load_corpus(corpus).vocab))
    plain = plain_lstm.build_plain(config, ours)
    assert plain.stacked == stacked and len(plain.lstms) == (1 if stacked else 3)
    assert count_parameters(plain) == count_parameters(ours)
    tokens = torch.randint(0, 31, (6, 4))
    window = (tokens, torch.roll(tokens, -1, dims=0))
    assert plain_lstm.eval_loss_difference(ours, plain, window) < 1e-5
