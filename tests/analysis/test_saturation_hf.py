"""Saturation and the gradient bottleneck of Hugging Face causal LMs (--hf): a tiny random
Llama with its lm_head, and with a highrank head attached."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
pytest.importorskip("tokenizers", reason="the hf extra (tokenizers) is not installed")

from highrank.analysis.gradient_bottleneck import analyze_gradient_bottleneck_hf  # noqa: E402
from highrank.analysis.head_inputs import iter_causal_lm_head_inputs  # noqa: E402
from highrank.analysis.hf_contexts import load_text_contexts  # noqa: E402
from highrank.analysis.saturation import analyze_saturation_hf, anisotropy  # noqa: E402
from highrank.cli import main  # noqa: E402
from tests.analysis.test_hf_contexts import save_tiny_model, write_text  # noqa: E402


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama-saturation")
    return save_tiny_model(root / "model", "llama"), write_text(root / "text.txt")


def test_head_inputs_reproduce_the_logits(llama):
    loaded = load_text_contexts(*llama, window=20, progress=False)
    hidden, targets = next(iter_causal_lm_head_inputs(loaded, max_contexts=15))
    assert hidden.shape == (15, 16) and torch.equal(targets, loaded.ids[1:16])
    with torch.no_grad():
        logits = loaded.model(input_ids=loaded.ids[None, :15]).logits[0]
        again = loaded.model.get_output_embeddings()(hidden)
    torch.testing.assert_close(again, logits, rtol=1e-5, atol=1e-5)


def test_saturation_of_a_causal_lm(llama):
    record = analyze_saturation_hf(*llama, window=20, max_contexts=30, top_k=(1, 4))
    point = record["checkpoints"][0]
    loaded = load_text_contexts(*llama, window=20, progress=False)
    weight = loaded.model.get_output_embeddings().weight.detach().numpy()
    np.testing.assert_allclose(
        point["singular_values"], np.linalg.svd(weight, compute_uv=False), rtol=1e-5
    )
    hidden = torch.cat([h for h, _ in iter_causal_lm_head_inputs(loaded, max_contexts=30)])
    assert point["anisotropy"]["mean_cosine"] == pytest.approx(
        anisotropy(hidden)["mean_cosine"]
    )
    assert point["anisotropy"]["n_contexts"] == 30 and point["head"] == "lm_head"


def test_gradient_bottleneck_of_a_causal_lm_matches_least_squares(llama, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["analyze", "gradient-bottleneck", "--hf", str(llama[0]), "--text", str(llama[1])]
    assert main([*argv, "--window", "20", "--max-tokens", "12", "--out", str(out)]) == 0
    assert "mean share" in capsys.readouterr().out
    record = json.loads((out / "gradient-bottleneck.json").read_text())["inputs"][0]
    loaded = load_text_contexts(*llama, window=20, progress=False)
    with torch.no_grad():
        logits = loaded.model(input_ids=loaded.ids[None, :12]).logits[0].double()
    g = torch.softmax(logits, -1) - torch.nn.functional.one_hot(loaded.ids[1:13], 20).double()
    w = loaded.model.get_output_embeddings().weight.detach().double()
    wc = w - w.mean(dim=0)
    fitted = wc @ torch.linalg.lstsq(wc, g.T).solution
    shares = fitted.square().sum(0) / g.square().sum(1)
    assert record["share"]["mean"] == pytest.approx(float(shares.mean()), abs=1e-6)
    assert record["n_tokens"] == 12 and record["method"].startswith("closed")


def test_an_attached_mos_head_goes_through_its_jacobian(llama, tmp_path):
    import transformers

    from highrank.integrations.hf import attach_head

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(llama[0])
    folder = tmp_path / "mos"
    attach_head(base, "mos", n_components=2).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(llama[0]).save_pretrained(folder)
    record = analyze_gradient_bottleneck_hf(folder, llama[1], window=20, max_tokens=8)
    assert record["head"] == "mos" and record["method"].startswith("Jacobian")
    assert 0.0 < record["share"]["mean"] <= 1.0 and "share_w" not in record
    saturation = analyze_saturation_hf(folder, llama[1], window=20, max_contexts=10)
    assert saturation["checkpoints"][0]["head"] == "mos"


def test_an_attached_head_that_reads_its_context_is_refused_in_one_line(llama, tmp_path, capsys):
    """MFS and CPR read the body's layers and the context's tokens besides a hidden state:
    the instruments on head inputs say so in one line; rank reads the model's own rows."""
    import transformers

    from highrank.integrations.hf import attach_head

    base = transformers.AutoModelForCausalLM.from_pretrained(llama[0])
    folder = tmp_path / "cpr"
    attach_head(base, "cpr", reranker_k1=10, reranker_k2=4).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(llama[0]).save_pretrained(folder)
    for verb in ("gradient-bottleneck", "saturation"):
        capsys.readouterr()
        words = ["analyze", verb, "--hf", str(folder), "--text", str(llama[1]), "--window", "20"]
        words += ["--out", str(tmp_path / verb)]
        assert main([*words, "--max-contexts", "8", "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "SoftmaxCPR head reads hidden, layers" in err, err
    out = tmp_path / "rank"
    words = ["analyze", "rank", "--hf", str(folder), "--text", str(llama[1]), "--out", str(out)]
    assert main([*words, "--window", "20", "--max-contexts", "16", "--no-progress"]) == 0
