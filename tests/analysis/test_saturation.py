"""Known answers of the LM-head saturation instrument (highrank.analysis.saturation)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from highrank.analysis.saturation import (
    SaturationError,
    analyze_saturation_run,
    anisotropy,
    anisotropy_of_blocks,
    context_statistics,
    entropy_effective_rank,
    spectrum_record,
    top_mass,
)


def matrix_with_spectrum(values, rows=40, seed=0) -> np.ndarray:
    """W = U diag(s) V^T with random orthonormal U (rows x r), V (r x r)."""
    rng = np.random.default_rng(seed)
    r = len(values)
    u, _ = np.linalg.qr(rng.standard_normal((rows, r)))
    v, _ = np.linalg.qr(rng.standard_normal((r, r)))
    return (u * np.asarray(values)) @ v.T


def test_spectrum_of_a_constructed_matrix():
    s = np.array([4.0, 2.0, 1.0, 1.0, 0.0])
    record = spectrum_record(matrix_with_spectrum(s), top_k=(1, 2, 10))
    np.testing.assert_allclose(record["singular_values"], s, atol=1e-12)
    energy = s**2 / (s**2).sum()  # 16, 4, 1, 1, 0 of 22
    assert record["top_mass"] == pytest.approx(
        {"1": energy[0], "2": energy[:2].sum(), "10": 1.0}
    )
    assert record["press_rank"] == 4
    # 1 - eps of 22: eps = 1e-3 needs all four nonzero values
    assert record["effective_rank"]["0.001"] == 4
    q = s[:4] / s.sum()
    assert record["entropy_effective_rank"] == pytest.approx(np.exp(-(q * np.log(q)).sum()))


def test_flat_spectrum_has_full_entropy_rank_and_linear_top_mass():
    s = np.ones(8)
    assert entropy_effective_rank(s) == pytest.approx(8.0)
    assert top_mass(s, [2, 4]) == pytest.approx({"2": 0.25, "4": 0.5})


def test_spectrum_of_a_float32_tensor():
    w = torch.from_numpy(matrix_with_spectrum([3.0, 1.0], rows=10)).float()
    record = spectrum_record(w)
    assert record["dtype"] == "float32"
    np.testing.assert_allclose(record["singular_values"], [3.0, 1.0], rtol=1e-5)


def test_bad_matrix_and_top_k_are_refused():
    with pytest.raises(SaturationError, match="2-D"):
        spectrum_record(np.zeros(3))
    with pytest.raises(SaturationError, match="positive"):
        top_mass(np.ones(3), [0])


def test_identical_states_have_anisotropy_one():
    h = torch.randn(1, 6).repeat(50, 1) * torch.rand(50, 1).add(0.1)  # same direction
    assert anisotropy(h)["mean_cosine"] == pytest.approx(1.0)


def test_orthogonal_states_have_anisotropy_zero():
    assert anisotropy(torch.eye(7) * 3.0)["mean_cosine"] == pytest.approx(0.0, abs=1e-15)


def test_anisotropy_equals_the_pairwise_mean_and_streams():
    h = torch.randn(30, 5) + 0.7
    u = h / h.norm(dim=1, keepdim=True)
    cos = u @ u.T
    exact = (cos.sum() - cos.diagonal().sum()) / (30 * 29)
    record = anisotropy_of_blocks(iter([(h[:11], None), (h[11:], None)]))
    assert record["mean_cosine"] == pytest.approx(float(exact), abs=1e-6)
    assert record["n_contexts"] == 30


def test_zero_states_are_skipped_and_too_few_refused():
    h = torch.cat([torch.zeros(2, 3), torch.eye(3)])
    record = anisotropy(h)
    assert record["zero_states_skipped"] == 2 and record["n_contexts"] == 3
    with pytest.raises(SaturationError, match="at least 2"):
        anisotropy(torch.zeros(4, 3))


@pytest.mark.parametrize("name", ["mos", "moc", "mixtape", "mlp_softmax"])
def test_saturated_tanh_units_are_counted_by_hand(name):
    """The share of a head's context-forming tanh units with |tanh(a)| > 0.95, over blocks,
    against the pre-activations written by hand: units at a = +-3 count, at 0.1 do not."""
    from highrank.heads import build_head

    head = build_head(name, d_in=2, vocab_size=7)
    layer = head.components if name == "mixtape" else head.latent
    with torch.no_grad():
        layer.weight.zero_()
        layer.bias.zero_()
        layer.weight[:, 0] = 1.0  # every unit reads g's first coordinate: a = g_0
    g = torch.tensor([[3.0, 5.0], [0.1, 5.0], [-3.0, 0.0], [0.1, -1.0]])
    blocks = iter([(g[:3], None), (g[3:], None)])
    found = context_statistics(blocks, head)["tanh_contexts"]
    assert found["share_saturated"] == pytest.approx(0.5)  # 2 of 4 rows, every unit alike
    expected_abs = float(torch.tanh(torch.tensor([3.0, 0.1, 3.0, 0.1], dtype=torch.float64)).mean())
    assert found["mean_abs"] == pytest.approx(expected_abs)
    assert found["units"] == layer.out_features


def test_a_head_without_tanh_contexts_reports_none_and_the_same_anisotropy():
    from highrank.heads import build_head

    hidden = torch.randn(5, 3)
    found = context_statistics(iter([(hidden, None)]), build_head("softmax", d_in=3, vocab_size=7))
    assert found["tanh_contexts"] is None
    assert found["anisotropy"] == anisotropy(hidden)


def test_a_run_gives_one_point_per_checkpoint(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (run / "checkpoints" / "last.pt").rename(run / "checkpoints" / "extra.pt")
    shutil.copy(tiny_run / "checkpoints" / "last.pt", run / "checkpoints" / "last.pt")
    record = analyze_saturation_run(run, max_contexts=50)
    names = sorted(p["checkpoint"] for p in record["checkpoints"])
    assert names == sorted(p.name for p in (run / "checkpoints").glob("*.pt"))
    point = record["checkpoints"][0]
    assert point["shape"][1] == 8  # E: V x d_embed of the tiny run
    assert point["anisotropy"]["n_contexts"] == 50
    assert -1.0 <= point["anisotropy"]["mean_cosine"] <= 1.0


def test_cli_writes_the_curve_and_refuses_mixed_inputs(tiny_run, tmp_path, capsys):
    from highrank.cli import main

    run = shutil.copytree(tiny_run, tmp_path / "run")
    out = tmp_path / "out"
    argv = ["analyze", "saturation", str(run), "--max-contexts", "30", "--top-k", "1,3"]
    assert main([*argv, "--no-progress", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "top-3 energy" in printed and "anisotropy" in printed
    # other top-k shares than the default are named by them (never over the default record)
    assert (run / "analysis" / "saturation-test-first30-top1+3.json").is_file()
    assert not (run / "analysis" / "saturation-test-first30.json").exists()
    assert (out / "saturation.json").is_file() and (out / "saturation.md").is_file()
    assert main(["analyze", "saturation", str(run), "--hf", "m.gguf"]) == 2
    assert "not both" in capsys.readouterr().err


def test_a_run_whose_config_is_garbage_is_refused_as_eval_refuses_it(tiny_run, tmp_path, capsys):
    """Issue 29: `analyze saturation` measured a run folder whose config.toml is garbage,
    while `eval` refused it."""
    from highrank.cli import main

    run = shutil.copytree(tiny_run, tmp_path / "run")
    (run / "config.toml").write_text("garbage [[[\n")
    assert main(["eval", str(run), "--no-progress"]) == 2
    refused = capsys.readouterr().err.strip()
    assert f"{run / 'config.toml'}: invalid TOML" in refused
    assert main(["analyze", "saturation", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and refused.split("error: ", 1)[1] in err[0]
    assert not (run / "analysis").exists() or not list((run / "analysis").glob("saturation*"))
