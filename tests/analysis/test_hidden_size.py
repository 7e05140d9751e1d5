"""Hidden-size recovery: planted softmax layers give d + 2 (bias) / d + 1 (no bias); MoS and
Mixtape give no knee at d + 1 or d + 2; the same answer from a matrix in memory, a .npy on disk
(streamed Gram matrix), a rank record and a run; bad input named."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from highrank.analysis.hidden_size import (
    HiddenSizeError,
    estimate_from_rank_record,
    estimate_hidden_size,
    estimate_hidden_size_file,
    matches_hidden_size,
    spectrum_knee,
)
from highrank.analysis.rank import rank_report
from highrank.cli import main
from highrank.heads import build_head

N_CONTEXTS, VOCAB, D = 300, 200, 8


def head_matrix(name: str, *, seed: int = 0, scale: float = 1.0, bias: bool = True, **knobs):
    """The float32 log-prob matrix (N_CONTEXTS x VOCAB) of a random head of hidden size D on
    standard-normal hidden states; ``scale`` multiplies every parameter (larger logits)."""
    torch.manual_seed(seed)
    head = build_head(name, d_in=D, vocab_size=VOCAB, **knobs).eval()
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.mul_(scale)
        if bias:
            head.bias.normal_()
        else:
            head.bias.zero_()
        return head.log_prob(torch.randn(N_CONTEXTS, D)).numpy()


# ---- known answers ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("bias", "rank"), [(True, D + 2), (False, D + 1)])
def test_a_softmax_layer_gives_d_plus_2_with_bias_and_d_plus_1_without(seed, bias, rank):
    result = estimate_hidden_size(head_matrix("softmax", seed=seed, bias=bias))
    assert result["low_rank_knee"] and result["knee"] == rank
    assert result["hidden_size"] == {"with_bias": rank - 2, "without_bias": rank - 1}
    assert matches_hidden_size(result, D)
    assert result["gap"] > 1e3  # signal against float32 rounding noise: a cliff


def test_a_wide_matrix_and_a_float64_matrix_give_the_same_knee():
    wide = head_matrix("softmax", seed=3)[:40]  # 40 contexts x 200 tokens
    assert estimate_hidden_size(wide)["knee"] == D + 2
    assert estimate_hidden_size(wide.astype(np.float64))["knee"] == D + 2


@pytest.mark.parametrize("scale", [1.0, 3.0])
@pytest.mark.parametrize(
    ("name", "knobs"),
    [
        ("mos", {"n_components": 3, "latent_dropout": 0.0}),
        ("mixtape", {"gate_dim": 4, "frequent_fraction": 1.0}),
    ],
)
def test_mos_and_mixtape_without_gate_sharing_have_no_low_rank_knee(name, knobs, scale):
    result = estimate_hidden_size(head_matrix(name, scale=scale, **knobs))
    assert not result["low_rank_knee"] and result["hidden_size"] is None
    assert not matches_hidden_size(result, D)
    assert result["verdict"].startswith("no knee")
    assert result["press_rank"] > D + 2  # the matrix is numerically of higher rank


def test_mixtape_with_gate_sharing_has_its_knee_far_from_d():
    # The V - S rare tokens share one mixed context: their columns span at most d + 2
    # dimensions, the S = 20 frequent ones add up to 20 more, so the knee is near d + 2 + S.
    matrix = head_matrix("mixtape", gate_dim=4, frequent_fraction=0.1)
    result = estimate_hidden_size(matrix)
    assert result["knee"] not in (D + 1, D + 2) and not matches_hidden_size(result, D)
    assert D + 2 < result["knee"] <= D + 2 + 20


def test_the_mean_level_gap_s1_over_s2_is_not_taken_for_a_knee():
    # MoS's s_1 / s_2 (the mean log-probability level) is its largest ratio of all ...
    result = estimate_hidden_size(head_matrix("mos", n_components=3, latent_dropout=0.0))
    assert result["level_gap"] > result["gap"]
    # ... yet the knee search starts at k = 2.
    assert result["knee"] >= 2 and result["top_gaps"][0][0] == result["knee"]


# ---- the rule itself, on planted spectra ------------------------------------------------------


def test_spectrum_knee_on_planted_values():
    shape, floor = (100, 50), 1e-12
    # A cliff of 1e6 after value 5; the values after it are below float32's Press threshold
    # (0.5 * sqrt(151) * 2**-23 * 10 ~ 7e-6).
    values = np.array([10.0, 5, 4, 3, 2] + [2e-6] * 10)
    result = spectrum_knee(values, shape=shape, dtype="float32", floor=floor)
    assert result["low_rank_knee"] and result["knee"] == 5 and result["gap"] == pytest.approx(1e6)
    # The same cliff above the Press threshold (values after it 1e-3): no knee.
    high = np.array([10.0, 5, 4, 3, 2] + [1e-3] * 10)
    result = spectrum_knee(high, shape=shape, dtype="float32", floor=floor)
    assert result["knee"] == 5 and not result["low_rank_knee"]
    assert result["values_above_press_after_knee"] == 10
    # A steady decay by 3x per value: the largest gap is 3x, below min_gap.
    steady = 10.0 * 3.0 ** -np.arange(15)
    result = spectrum_knee(steady, shape=shape, dtype="float64", floor=floor)
    assert not result["low_rank_knee"] and result["gap"] == pytest.approx(3.0)


def test_values_below_the_floor_are_noise_and_cannot_make_a_knee():
    # Rounding noise spreading down to 1e-30 would give a gap of 1e10 among noise values.
    values = np.array([10.0, 6, 5, 4, 1e-9, 1e-9, 1e-30])
    result = spectrum_knee(values, shape=(20, 7), dtype="float32", floor=1e-8)
    assert result["knee"] == 4 and result["gap"] == pytest.approx(4 / 1e-8)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([1.0, 0.5], "at least 3"),
        ([1.0, 2.0, 0.5], "descending"),
        ([0.0, 0.0, 0.0], "zero"),
        ([1.0, np.nan, 0.0], "finite"),
    ],
)
def test_bad_spectra_are_named(values, message):
    with pytest.raises(HiddenSizeError, match=message):
        spectrum_knee(np.array(values), shape=(5, 5), dtype="float32", floor=1e-12)


def test_bad_matrices_are_named(tmp_path):
    with pytest.raises(HiddenSizeError, match="2-D float32 or float64"):
        estimate_hidden_size(np.zeros((3, 4, 5), dtype=np.float32))
    with pytest.raises(HiddenSizeError, match="NaN"):
        estimate_hidden_size(np.full((5, 5), np.nan, dtype=np.float32))
    with pytest.raises(HiddenSizeError, match="does not exist"):
        estimate_hidden_size_file(tmp_path / "missing.npy")


# ---- the same answer from disk, a rank record, a run, the command line ----------------------


def test_a_matrix_on_disk_is_streamed_and_gives_the_same_knee(tmp_path):
    matrix = head_matrix("softmax", seed=4)
    path = tmp_path / "logprob.npy"
    np.save(path, matrix)
    result = estimate_hidden_size_file(path, block_rows=64)
    assert result["knee"] == D + 2 and result["low_rank_knee"]
    wide = tmp_path / "wide.npy"
    np.save(wide, matrix[:50])  # 50 x 200: the Gram matrix on the row side
    assert estimate_hidden_size_file(wide)["knee"] == D + 2


def test_a_rank_record_is_read_with_its_singular_values_file(tmp_path):
    matrix = head_matrix("softmax", seed=5, bias=False)
    report = rank_report(matrix)
    np.save(tmp_path / "rank-x.singular_values.npy", report.pop("singular_values"))
    record = {**report, "singular_values_file": "rank-x.singular_values.npy", "head": "softmax"}
    (tmp_path / "rank-x.json").write_text(json.dumps(record))
    result = estimate_from_rank_record(tmp_path / "rank-x.json")
    assert result["knee"] == D + 1 and result["head"] == "softmax"
    (tmp_path / "rank-x.singular_values.npy").unlink()
    with pytest.raises(HiddenSizeError, match="found in none of"):
        estimate_from_rank_record(tmp_path / "rank-x.json")


@pytest.mark.parametrize("head", ["mixtape", "softmax", "moc", "LlamaForCausalLM"])
def test_a_knee_of_a_head_that_is_no_softmax_is_not_read_as_a_hidden_size(tmp_path, head):
    """Mixtape with gate sharing has an exact knee far from d: a record of such a head says
    that its knee need not be a hidden size (the same spectrum from a softmax does not)."""
    matrix = np.asarray(head_matrix("mixtape", gate_dim=4, frequent_fraction=0.1))
    values = np.linalg.svd(matrix.astype(np.float64), compute_uv=False)
    resolution = values[0] * max(matrix.shape) * np.finfo(np.float64).eps  # as in memory
    record = {"shape": list(matrix.shape), "dtype": str(matrix.dtype), "head": head,
              "singular_values": values.tolist(), "resolution": resolution}
    (tmp_path / "rank-x.json").write_text(json.dumps(record))
    result = estimate_from_rank_record(tmp_path / "rank-x.json")
    assert result["low_rank_knee"]
    assert ("not a softmax layer" in result["verdict"]) == (head == "mixtape")
    assert (result["hidden_size"] is None) == (head == "mixtape")


def test_a_run_uses_the_rank_machinery_and_names_its_d_embed(tiny_run, tmp_path, capsys):
    run = shutil.copytree(tiny_run, tmp_path / "run")
    status = main(["analyze", "hidden-size", str(run), "--no-progress", "--out", str(tmp_path)])
    assert status == 0
    record = json.loads((run / "analysis" / "hidden-size-test-best.json").read_text())
    assert (run / "analysis" / "rank-test-best.json").is_file()  # the rank record it used
    # The tiny run: a softmax head with d_embed 8 and a bias that one short epoch moved only
    # slightly from zero, so the knee is d + 2 or, with the bias below float32's Press
    # threshold, d + 1; either way it is the matrix's Press rank, and the rest is zero.
    assert record["head_d_embed"] == 8 and record["matches_d_embed"]
    assert record["knee"] in (9, 10) and record["knee"] == record["press_rank"]
    assert f"knee at {record['knee']}" in capsys.readouterr().out
    assert (tmp_path / "hidden-size.md").is_file()


def test_the_command_line_takes_matrices_and_records_and_names_bad_input(tmp_path, capsys):
    path = tmp_path / "m.npy"
    np.save(path, head_matrix("softmax", seed=6))
    assert main(["analyze", "hidden-size", str(path), "--expect", str(D), "--no-progress"]) == 0
    record = json.loads((tmp_path / "hidden-size-m.json").read_text())
    assert record["knee"] == D + 2 and record["matches_expected"]
    assert f"the knee at {D + 2} agrees with --expect {D}" in capsys.readouterr().out  # a verdict
    assert main(["analyze", "hidden-size", str(path), "--expect", str(D + 5)]) == 0
    assert f"does NOT agree with --expect {D + 5}" in capsys.readouterr().out
    mos = tmp_path / "mos.npy"  # a new user's walk: "the knee at 3 does NOT agree" of no knee
    np.save(mos, head_matrix("mos", seed=6, n_components=3))
    assert main(["analyze", "hidden-size", str(mos), "--expect", str(D)]) == 0
    assert f"no knee, so not a softmax of hidden size {D}" in capsys.readouterr().out
    few = tmp_path / "few.npy"
    np.save(few, head_matrix("softmax", seed=6)[: D + 1])
    assert main(["analyze", "hidden-size", str(few), "--expect", str(D)]) == 0
    assert f"too few singular values ({D + 1}: contexts or vocabulary) to test --expect {D}" in (
        capsys.readouterr().out)
    edge = tmp_path / "edge.npy"  # a knee at the spectrum's end: too few contexts to tell
    np.save(edge, head_matrix("softmax", seed=6)[: D + 3])
    assert main(["analyze", "hidden-size", str(edge)]) == 0
    assert f"the knee is among the spectrum's last values ({D + 2} of {D + 3})" in (
        capsys.readouterr().out)
    (tmp_path / "notes.txt").write_text("x")
    assert main(["analyze", "hidden-size", str(tmp_path / "notes.txt")]) == 2
    assert "expected a run directory, a .npy" in capsys.readouterr().err


def test_a_hugging_face_model_gives_its_hidden_size_plus_one(tmp_path, monkeypatch):
    transformers = pytest.importorskip(
        "transformers", reason="the hf extra (transformers) is not installed"
    )
    pytest.importorskip("tokenizers", reason="the hf extra (tokenizers) is not installed")
    from tokenizers import Tokenizer, models, pre_tokenizers

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    words = ["[UNK]", *"the a of cat dog sat on mat ran far near house".split()]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    # GPT-2: lm_head tied to the embedding, no bias: a knee at n_embd + 1 = 5 of 13 values.
    # Two changes to the random init make all n_embd directions visible in float32: the
    # final LayerNorm centres its output, so with its initial shift beta = 0 the hidden
    # states span only n_embd - 1 dimensions; and embeddings of std 0.02 give logits so
    # small that the last direction lies below float32's Press threshold (both measured:
    # knee 4). A trained model has neither.
    config = transformers.GPT2Config(vocab_size=len(words), n_embd=4, n_layer=1, n_head=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.transformer.ln_f.bias.normal_()
        model.transformer.wte.weight.normal_()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    rng = np.random.default_rng(0)
    (tmp_path / "text.txt").write_text(" ".join(rng.choice(words[1:], size=120)) + "\n")
    out = tmp_path / "out"
    argv = ["analyze", "hidden-size", "--hf", str(tmp_path / "model"), "--text"]
    text = [str(tmp_path / "text.txt"), "--window", "40"]
    assert main([*argv, *text, "--out", str(out), "--expect", "4", "--no-progress"]) == 0
    record = json.loads(next(out.glob("hidden-size-*.json")).read_text())
    assert record["knee"] == 5 and record["low_rank_knee"] and record["matches_expected"]
    assert record["hidden_size"] and "not a softmax layer" not in record["verdict"]  # lm_head
    assert record["model"] == str((tmp_path / "model").resolve())
    assert record["shape"] == [119, 13] and next(out.glob("rank-*.json")).is_file()
    assert main(["analyze", "hidden-size", "--hf", str(tmp_path / "model")]) == 2
