"""The synthetic known-rank demo: the true matrix, the fit, the files, determinism."""

from __future__ import annotations

import json
import math

import pytest
import torch

from highrank.analysis.rank import press_rank
from highrank.demo import (
    PLOT_FILE,
    RESULTS_FILE,
    DemoSettings,
    build_model,
    demo_knobs,
    fit_head,
    format_table,
    mean_entropy,
    mean_kl,
    reading,
    run_demo,
    true_log_probs,
)
from highrank.heads import PAPER_HEADS

# d + 2 = 4 < r = 8: the softmax bound binds. Every head fits in well under a second.
TINY = DemoSettings(rank=8, dim=2, vocab=24, contexts=16, steps=40, seed=3)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    return out, run_demo(TINY, out, progress=False)


# ---- the true language ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("contexts", "vocab", "rank"), [(16, 24, 8), (40, 30, 30), (64, 32, 2), (256, 256, 32)]
)
def test_true_matrix_has_press_rank_r_and_normalised_rows(contexts, vocab, rank):
    settings = DemoSettings(rank=rank, dim=2, vocab=vocab, contexts=contexts)
    target = true_log_probs(settings)
    assert target.shape == (contexts, vocab) and target.dtype == torch.float64
    assert press_rank(target.float()) == rank
    assert press_rank(target) == rank
    assert torch.isfinite(target).all() and (target.exp() > 0).all()
    torch.testing.assert_close(
        torch.logsumexp(target, dim=1), torch.zeros(contexts, dtype=torch.float64)
    )


def test_default_truth_is_neither_uniform_nor_one_hot():
    target = true_log_probs(DemoSettings())
    entropy = mean_entropy(target)
    assert 0.25 * math.log(256) < entropy < 0.75 * math.log(256)
    assert 0.1 < float(target.exp().max(dim=1).values.mean()) < 0.8


def test_true_matrix_depends_only_on_the_seed():
    a = true_log_probs(TINY)
    torch.manual_seed(12345)  # the global generator must not matter
    assert torch.equal(a, true_log_probs(TINY))
    other = DemoSettings(rank=8, dim=2, vocab=24, contexts=16, seed=4)
    assert not torch.equal(a, true_log_probs(other))


def test_mean_kl_is_zero_for_the_truth_and_positive_otherwise():
    target = true_log_probs(TINY)
    assert float(mean_kl(target, target)) == 0.0
    uniform = torch.full_like(target, -math.log(TINY.vocab))
    assert float(mean_kl(target, uniform)) > 0.1


# ---- the run and its files -----------------------------------------------------------------


def test_results_json_has_the_settings_and_every_head(tiny_run):
    out, results = tiny_run
    on_disk = json.loads((out / RESULTS_FILE).read_text())
    assert on_disk["settings"]["rank"] == TINY.rank
    assert on_disk["settings"]["heads"] == list(PAPER_HEADS)
    assert on_disk["true_rank"] == TINY.rank == on_disk["true_press_rank"]
    assert on_disk["softmax_rank_bound"] == TINY.dim + 2
    assert on_disk["machine"]["cpu"] and on_disk["machine"]["torch_threads"] == TINY.threads
    assert list(on_disk["heads"]) == list(PAPER_HEADS)
    for entry in on_disk["heads"].values():
        assert isinstance(entry["kl"], float) and entry["kl"] > 0
        assert isinstance(entry["rank"], int) and 1 <= entry["rank"] <= TINY.contexts
        assert isinstance(entry["params"], int) and entry["params"] > TINY.contexts * TINY.dim
        assert isinstance(entry["seconds"], float) and entry["seconds"] >= 0
        steps, kls = entry["curve"]["step"], entry["curve"]["kl"]
        assert steps[0] == 1 and steps[-1] == TINY.steps and len(steps) == len(kls)
        assert all(isinstance(v, float) for v in kls)
    assert on_disk["heads"]["mos"]["knobs"]["latent_dropout"] == 0.0


def test_plot_is_a_non_empty_png(tiny_run):
    out, _ = tiny_run
    data = (out / PLOT_FILE).read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000


def test_table_and_reading_name_every_head_and_the_bound(tiny_run):
    _, results = tiny_run
    table = format_table(results)
    assert all(name in table for name in PAPER_HEADS)
    assert "d + 2 = 4" in reading(results)


def test_same_seed_gives_identical_numbers(tiny_run, tmp_path):
    _, first = tiny_run
    again = run_demo(TINY, tmp_path, progress=False)
    for name in PAPER_HEADS:
        assert again["heads"][name]["kl"] == first["heads"][name]["kl"], name
        assert again["heads"][name]["curve"] == first["heads"][name]["curve"], name
        assert again["heads"][name]["rank"] == first["heads"][name]["rank"], name


def test_fit_leaves_the_global_torch_state_alone():
    threads = torch.get_num_threads()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    fit_head("softmax", TINY, true_log_probs(TINY))
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == threads
    assert not torch.are_deterministic_algorithms_enabled()


# ---- the bottleneck ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["softmax", "moc"])
def test_softmax_and_moc_learn_rank_at_most_d_plus_2(tiny_run, name):
    _, results = tiny_run
    assert results["heads"][name]["rank"] <= TINY.dim + 2 < TINY.rank


@pytest.mark.parametrize(("dim", "reaches_truth"), [(3, True), (2, False)])
def test_softmax_reaches_the_truth_exactly_when_d_is_at_least_r_minus_1(dim, reaches_truth):
    # Softmax logits G E^T + 1 b^T must equal the rank-(r - 1) truth up to row constants.
    settings = DemoSettings(rank=4, dim=dim, vocab=16, contexts=16, steps=400, lr=0.05)
    assert bool(settings.notes()) == reaches_truth
    kl = fit_head("softmax", settings, true_log_probs(settings)).kl
    assert kl < 1e-3 if reaches_truth else kl > 1e-2


def test_mos_beats_softmax_when_the_bound_binds():
    # Robust over seeds 0-7 (KL ratio 0.50-0.69); MoS needs a few hundred steps to pull ahead.
    settings = DemoSettings(rank=16, dim=4, vocab=64, contexts=64, steps=400, lr=0.05, seed=1)
    target = true_log_probs(settings)
    softmax = fit_head("softmax", settings, target)
    mos = fit_head("mos", settings, target)
    assert mos.rank > settings.dim + 2 >= softmax.rank
    assert mos.kl < 0.8 * softmax.kl


# ---- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"rank": 40}, ["rank=40", "contexts=16", "vocab=24"]),
        ({"rank": 0}, ["rank"]),
        ({"dim": -1}, ["dim"]),
        ({"steps": 1.5}, ["steps"]),
        ({"seed": -1}, ["seed"]),
        ({"lr": 0.0}, ["lr"]),
        ({"threads": 0}, ["threads"]),
        ({"heads": ("softmax", "nope")}, ["'nope'", "mixtape"]),
        ({"heads": ()}, ["heads"]),
        ({"heads": ("mos", "mos")}, ["twice", "mos"]),
        ({"mixtape_frequent_fraction": 0.0}, ["mixtape_frequent_fraction", "(0, 1]"]),
        ({"mixtape_frequent_fraction": 1.5}, ["mixtape_frequent_fraction", "1.5"]),
    ],
)
def test_bad_settings_name_the_field(changes, words):
    base = {"rank": 8, "dim": 2, "vocab": 24, "contexts": 16}
    with pytest.raises(ValueError) as error:
        DemoSettings(**(base | changes))
    assert all(word in str(error.value) for word in words), str(error.value)


def test_a_binding_bound_gives_no_note():
    assert TINY.notes() == []
    assert "no bottleneck" in DemoSettings(rank=8, dim=7, vocab=24, contexts=16).notes()[0]


def test_mixtape_gets_the_asked_share_of_tokens_with_their_own_gates():
    """Every token by default (synthetic ids have no frequency order); the paper's 0.1 on ask."""
    default, paper = DemoSettings(), DemoSettings(mixtape_frequent_fraction=0.1)
    assert demo_knobs("mixtape", default)["frequent_fraction"] == 1.0
    assert demo_knobs("mixtape", paper)["frequent_fraction"] == 0.1
    _, head = build_model("mixtape", paper)
    assert head.n_frequent == 25  # floor(0.1 x 256)


def test_heads_that_read_a_sequence_are_refused_in_one_line():
    from highrank.demo import check_head_names

    with pytest.raises(ValueError, match=r"^head\(s\) mfs, cpr also read the layers and tokens"):
        check_head_names(["softmax", "mfs", "cpr"])
