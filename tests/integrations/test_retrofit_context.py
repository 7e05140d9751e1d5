"""`highrank retrofit` with the heads that read their context (MFS, CPR): the modes that
train on windows (lora, full) give them the body's layers and the windows' tokens through
HighrankForCausalLM; frozen mode, which caches one final hidden state per token, refuses them
in one line."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers", reason="retrofit needs the hf extra")

from highrank.cli import main  # noqa: E402
from tests.analysis.test_hf_contexts import save_tiny_model, write_text  # noqa: E402
from tests.integrations.test_retrofit_command import command, reloaded_perplexity  # noqa: E402


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("context-heads")
    files = {split: write_text(root / f"{split}.txt", n_words=n, seed=i)
             for i, (split, n) in enumerate((("train", 200), ("valid", 60), ("test", 60)))}
    return save_tiny_model(root / "model", "llama"), files


@pytest.mark.parametrize(
    ("mode", "head"),
    [("full", "cpr"), ("full", "mfs"), ("lora", "cpr")],
)
def test_the_window_modes_retrofit_heads_that_read_their_context(texts, tmp_path, mode, head):
    if mode == "lora":
        pytest.importorskip("peft", reason="--mode lora needs peft")
    model, files = texts
    out = tmp_path / "out"
    extra = ("--knob", "reranker_k1=10", "--knob", "reranker_k2=4") if head == "cpr" else ()
    assert main(command(model, files, out, "--head", head, "--mode", mode, "--lr", "1e-2",
                        *extra)) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["training"]["complete"]
    for split in ("valid", "test"):
        assert results["trained"][split]["perplexity"] == pytest.approx(
            reloaded_perplexity(out / "model", files[split]), rel=1e-4)


def test_frozen_mode_refuses_them_in_one_line(texts, tmp_path, capsys):
    model, files = texts
    assert main(command(model, files, tmp_path / "out", "--head", "cpr")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--mode frozen caches one final hidden state per token" in err
    assert "use --mode lora or --mode full" in err
