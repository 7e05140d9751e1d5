"""Known answers of the gradient bottleneck (highrank.analysis.gradient_bottleneck)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from highrank.analysis.gradient_bottleneck import (
    GradientBottleneckError,
    LinearBasis,
    analyze_gradient_bottleneck_run,
    head_shares,
    logit_gradients,
    summarise,
)
from highrank.heads import build_head


def random_log_probs(n, v, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=generator, dtype=torch.float64) * 2
    targets = torch.randint(0, v, (n,), generator=generator)
    return torch.log_softmax(logits, dim=-1), targets


def test_logit_gradient_is_softmax_minus_onehot_and_sums_to_zero():
    log_probs, targets = random_log_probs(5, 9)
    g = logit_gradients(log_probs, targets)
    expected = log_probs.exp() - torch.nn.functional.one_hot(targets, 9)
    torch.testing.assert_close(g, expected.double())
    torch.testing.assert_close(g.sum(dim=1), torch.zeros(5, dtype=torch.float64))


def test_target_entry_is_exact_when_p_is_nearly_one():
    log_probs = torch.tensor([[-1e-12, -30.0, -30.0]], dtype=torch.float64)
    g = logit_gradients(log_probs, torch.tensor([0]))
    assert float(g[0, 0]) == pytest.approx(-1e-12, rel=1e-6)  # 1 - p_y, not 0


def test_full_rank_wide_decoder_passes_everything():
    log_probs, targets = random_log_probs(6, 8)
    weight = torch.randn(8, 12, dtype=torch.float64)  # d >= V, full rank
    shares = LinearBasis(weight).shares(log_probs, targets)
    torch.testing.assert_close(shares["share"], torch.ones(6, dtype=torch.float64))
    torch.testing.assert_close(shares["share_w"], torch.ones(6, dtype=torch.float64))


def test_rank_one_decoder_passes_the_share_along_its_direction():
    log_probs, targets = random_log_probs(6, 10, seed=1)
    w = torch.randn(10, dtype=torch.float64)
    w = w - w.mean()  # 1^T w = 0: the two formulas agree
    weight = torch.outer(w, torch.randn(4, dtype=torch.float64))  # rank 1, V x d
    g = logit_gradients(log_probs, targets)
    expected = (g @ w) ** 2 / (w @ w) / g.square().sum(dim=1)
    shares = LinearBasis(weight).shares(log_probs, targets)
    torch.testing.assert_close(shares["share"], expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(shares["share_w"], expected, rtol=1e-5, atol=1e-7)


def test_share_depends_on_the_model_not_on_the_logit_gauge():
    log_probs, targets = random_log_probs(6, 10, seed=2)
    weight = torch.randn(10, 3, dtype=torch.float64)
    shifted = weight + torch.ones(10, 1, dtype=torch.float64) * torch.randn(1, 3).double()
    a, b = LinearBasis(weight), LinearBasis(shifted)  # the same distributions for every h
    torch.testing.assert_close(
        a.shares(log_probs, targets)["share"], b.shares(log_probs, targets)["share"]
    )
    # the literal col(W) share is not gauge-free, and never above the share
    literal = a.shares(log_probs, targets)["share_w"]
    assert bool((literal <= a.shares(log_probs, targets)["share"] + 1e-7).all())


def test_two_token_example_of_the_docstring():
    log_probs = torch.log(torch.tensor([[0.3, 0.7]], dtype=torch.float64))
    shares = LinearBasis(torch.tensor([[1.0], [0.0]])).shares(log_probs, torch.tensor([0]))
    assert float(shares["share"][0]) == pytest.approx(1.0, abs=1e-6)
    assert float(shares["share_w"][0]) == pytest.approx(0.5, abs=1e-6)


def test_softmax_closed_form_equals_its_jacobian():
    torch.manual_seed(0)
    head = build_head("softmax", d_in=5, vocab_size=30).eval()
    with torch.no_grad():
        head.weight.normal_()
        head.bias.normal_()
    hidden, targets = torch.randn(9, 5), torch.randint(0, 30, (9,))
    with torch.no_grad():
        closed = LinearBasis(head.weight).shares(head.log_prob(hidden), targets)["share"]
    jacobian = head_shares(head, hidden, targets)["share"]
    torch.testing.assert_close(closed, jacobian, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mos", "moc", "mixtape"])
def test_mixture_heads_give_shares_in_range(name):
    torch.manual_seed(0)
    head = build_head(name, d_in=4, vocab_size=40).eval()
    shares = head_shares(head, torch.randn(5, 4), torch.randint(0, 40, (5,)))["share"]
    assert bool(((shares >= -1e-9) & (shares <= 1 + 1e-9)).all())


@pytest.mark.parametrize("name", ["mos", "mixtape"])
def test_a_mixture_started_at_a_softmax_has_the_softmax_share(name):
    """residual_contexts + start_at_base make the mixture exactly softmax(E g + b): its
    Jacobian share must equal the closed form of E."""
    torch.manual_seed(5)
    head = build_head(name, d_in=6, vocab_size=30, residual_contexts=True).eval()
    head.start_at_base()
    hidden, targets = torch.randn(5, 6), torch.randint(0, 30, (5,))
    with torch.no_grad():
        head.weight.normal_()
        closed = LinearBasis(head.weight).shares(head.log_prob(hidden), targets)["share"]
    torch.testing.assert_close(
        head_shares(head, hidden, targets)["share"], closed, rtol=1e-5, atol=1e-6
    )


def test_summary_weights_by_tokens_and_by_energy():
    summary = summarise(np.array([0.0, 1.0]), np.array([1.0, 3.0]))
    assert summary["mean"] == 0.5 and summary["energy_weighted"] == 0.75
    with pytest.raises(GradientBottleneckError):
        summarise(np.array([]), np.array([]))


def test_bad_shapes_are_refused():
    with pytest.raises(GradientBottleneckError, match=r"\(n, V\)"):
        logit_gradients(torch.zeros(3), torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("head", ["softmax", "mos"])
def test_a_run(tmp_path, head):
    from tests.conftest import train_tiny_run

    run = train_tiny_run(tmp_path, head, f"head.name={head}")
    record = analyze_gradient_bottleneck_run(run, which="last", max_tokens=40)
    assert record["n_tokens"] == 40
    assert 0.0 < record["share"]["mean"] <= 1.0
    assert ("share_w" in record) == (head == "softmax")
    assert record["method"].startswith("closed" if head == "softmax" else "Jacobian")


def test_cli_writes_a_record_and_refuses_hf_without_text(tiny_run, tmp_path, capsys):
    import json
    import shutil

    from highrank.cli import main

    run = shutil.copytree(tiny_run, tmp_path / "run")
    argv = ["analyze", "gradient-bottleneck", str(run), "--which", "last", "--max-tokens", "25"]
    assert main([*argv, "--no-progress"]) == 0
    assert "mean share" in capsys.readouterr().out
    record = json.loads(
        (run / "analysis" / "gradient-bottleneck-test-last-first25.json").read_text()
    )
    assert record["n_tokens"] == 25 and record["head"] == "softmax"
    assert main(["analyze", "gradient-bottleneck", "--hf", "m.gguf"]) == 2
    assert "--text" in capsys.readouterr().err


def test_softmax_with_a_projection_uses_e_times_p_and_equals_its_jacobian():
    from highrank.analysis.gradient_bottleneck import linear_decoder

    torch.manual_seed(3)
    head = build_head("softmax", d_in=3, vocab_size=25, d_embed=6).eval()  # E P: rank <= 3
    weight = linear_decoder(head)
    assert tuple(weight.shape) == (25, 3)
    hidden, targets = torch.randn(6, 3), torch.randint(0, 25, (6,))
    with torch.no_grad():
        closed = LinearBasis(weight).shares(head.log_prob(hidden), targets)["share"]
    torch.testing.assert_close(
        closed, head_shares(head, hidden, targets)["share"], rtol=1e-5, atol=1e-6
    )
    assert linear_decoder(build_head("sigsoftmax", d_in=3, vocab_size=25)) is None


def test_pointwise_head_goes_through_the_jacobian():
    torch.manual_seed(4)
    head = build_head("sigsoftmax", d_in=4, vocab_size=30).eval()
    shares = head_shares(head, torch.randn(4, 4), torch.randint(0, 30, (4,)))["share"]
    assert bool(((shares > 0) & (shares <= 1 + 1e-9)).all())


def test_a_head_torch_func_cannot_differentiate_is_one_clear_error():
    head = build_head("plif", d_in=3, vocab_size=12).eval()
    with pytest.raises(GradientBottleneckError, match="autograd.Function"):
        head_shares(head, torch.randn(2, 3), torch.tensor([0, 1]))


def test_mos_closed_form_jacobian_equals_forward_mode():
    from torch.func import jacfwd, vmap

    from highrank.analysis.gradient_bottleneck import head_jacobians, mos_jacobians

    torch.manual_seed(6)
    head = build_head("mos", d_in=7, vocab_size=50, n_components=3, d_embed=5).eval()
    with torch.no_grad():
        head.weight.normal_()
        head.bias.normal_()
    hidden = torch.randn(4, 7)
    reference = vmap(jacfwd(lambda row: head.log_prob(row[None])[0]))(hidden)
    torch.testing.assert_close(mos_jacobians(head, hidden), reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head_jacobians(head, hidden), reference, rtol=1e-5, atol=1e-6)


def test_mos_closed_form_jacobian_of_a_float64_head_is_float64_and_exact():
    """A float64 MoS head (as the float64 checks build) gets its Jacobian in float64: the
    closed form once cast parts of it to float32 and failed on the mixed product."""
    from torch.func import jacfwd, vmap

    from highrank.analysis.gradient_bottleneck import head_jacobians, mos_jacobians

    torch.manual_seed(7)
    head = build_head("mos", d_in=7, vocab_size=50, n_components=3, d_embed=5).double().eval()
    with torch.no_grad():
        head.weight.normal_()
        head.bias.normal_()
    hidden = torch.randn(4, 7, dtype=torch.float64)
    reference = vmap(jacfwd(lambda row: head.log_prob(row[None])[0]))(hidden)
    got = mos_jacobians(head, hidden)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, reference, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(head_jacobians(head, hidden), reference, rtol=1e-10, atol=1e-12)


def test_a_best_checkpoint_that_is_a_folder_is_named_as_one(tiny_run, tmp_path, capsys):
    """Issue 29: a `best.pt` that is a folder was reported as missing ("best.pt is written at
    the end of an epoch ... pass --which last"), which misleads."""
    import shutil

    from highrank.cli import main

    run = shutil.copytree(tiny_run, tmp_path / "run")
    (run / "checkpoints" / "best.pt").unlink()
    (run / "checkpoints" / "best.pt").mkdir()
    assert main(["analyze", "gradient-bottleneck", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "best.pt is a directory, not a checkpoint file" in err[0]
    assert "written at the end of an epoch" not in err[0]
