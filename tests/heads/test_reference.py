"""Each head against closed forms, special cases and the rank theorem of Yang et al. (2018)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from highrank.analysis.rank import press_rank
from highrank.heads import build_head
from highrank.heads.functional import log_mixture, sigmoid_tree, sigmoid_tree_mix
from highrank.heads.kernels import reference_paths
from highrank.heads.kernels.in_place import mixture_log_prob_, sigmoid_tree_mix_


def _copy_decoder(source, destination):
    with torch.no_grad():
        destination.weight.copy_(source.weight)
        destination.bias.copy_(source.bias)


def test_softmax_equals_log_softmax_of_the_linear_decoder():
    head = build_head("softmax", d_in=6, vocab_size=11)
    hidden, target = torch.randn(9, 6), torch.randint(0, 11, (9,))
    logits = hidden @ head.weight.T + head.bias
    torch.testing.assert_close(head.log_prob(hidden), F.log_softmax(logits, -1))
    torch.testing.assert_close(head.loss(hidden, target), F.cross_entropy(logits, target))


def test_softmax_projects_when_the_embedding_is_narrower():
    head = build_head("softmax", d_in=6, vocab_size=11, d_embed=3)
    hidden = torch.randn(9, 6)
    projected = head.projection(hidden)
    expected = F.log_softmax(projected @ head.weight.T + head.bias, -1)
    torch.testing.assert_close(head.log_prob(hidden), expected)


def test_mos_with_one_component_is_a_softmax_of_its_latent_context():
    mos = build_head("mos", d_in=6, vocab_size=11, n_components=1).eval()
    softmax = build_head("softmax", d_in=6, vocab_size=11)
    _copy_decoder(mos, softmax)
    hidden, target = torch.randn(9, 6), torch.randint(0, 11, (9,))
    latent = torch.tanh(mos.latent(hidden))
    torch.testing.assert_close(mos.log_prob(hidden), softmax.log_prob(latent))
    torch.testing.assert_close(mos.loss(hidden, target), softmax.loss(latent, target))


# log_prob takes the log-space chain under autograd and mixes in place without gradients.
GRAD_MODES = pytest.mark.parametrize("grad", [True, False], ids=["autograd", "inference"])


@GRAD_MODES
def test_mos_matches_a_float64_mixture_of_probabilities(grad):
    mos = build_head("mos", d_in=6, vocab_size=11, n_components=4).eval()
    hidden = torch.randn(9, 6)
    with torch.no_grad():
        h = hidden.double()
        prior = torch.softmax(h @ mos.prior.weight.double().T, -1)  # (N, K)
        latents = torch.tanh(h @ mos.latent.weight.double().T + mos.latent.bias.double())
        latents = latents.view(9, 4, 6)
        probs = torch.softmax(latents @ mos.weight.double().T + mos.bias.double(), -1)
        expected = torch.log((prior.unsqueeze(-1) * probs).sum(1))
    with torch.set_grad_enabled(grad):
        log_p = mos.log_prob(hidden)
    assert log_p.requires_grad == grad  # the path meant
    torch.testing.assert_close(log_p.double(), expected, atol=1e-5, rtol=1e-5)


@GRAD_MODES
@pytest.mark.parametrize("low", [-40.0, -200.0])
def test_mos_log_space_survives_probabilities_below_1e_minus_8(grad, low):
    # log(p + 1e-8) would cap at -18.4, and exp(-200) underflows float32: the mixture keeps
    # the true value either way.
    mos = build_head("mos", d_in=4, vocab_size=5, n_components=2).eval()
    with torch.no_grad():
        mos.weight.zero_()
        mos.bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, low]))
    with torch.set_grad_enabled(grad):
        log_p = mos.log_prob(torch.randn(3, 4))
    expected = low - math.log(4 + math.exp(low))
    torch.testing.assert_close(log_p[:, 4], torch.full((3,), expected))


@pytest.mark.parametrize("chunk_values", [1, 500, 2**20])  # a row per chunk, a few, all
@pytest.mark.parametrize("n_components", [1, 2, 4])
def test_in_place_mixture_equals_the_float64_log_space_chain(n_components, chunk_values):
    n, k, v = 7, n_components, 60
    log_prior = F.log_softmax(4 * torch.randn(n, k), -1)
    logits = 40 * torch.randn(n, k, v)  # log-probabilities down to about -250
    logits[:, :, 3] = -math.inf  # a token no component can emit
    logits[0, 0, 5] = -math.inf  # a token one component cannot emit
    logits[1, :, 7] = logits[1, :, 7].clamp(max=-1e3)  # below the float32 floor in every k
    expected = log_mixture(log_prior.double(), F.log_softmax(logits.double(), -1))
    got = mixture_log_prob_(log_prior, logits.clone(), chunk_values)
    assert got.dtype == torch.float32 and got.shape == (n, v)
    assert torch.equal(got[:, 3], torch.full((n,), -math.inf))
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-5)


def test_moc_is_a_softmax_of_the_mixed_context():
    moc = build_head("moc", d_in=6, vocab_size=11, n_components=3).eval()
    softmax = build_head("softmax", d_in=6, vocab_size=11)
    _copy_decoder(moc, softmax)
    hidden = torch.randn(9, 6)
    prior = torch.softmax(moc.prior(hidden), -1)  # (N, K)
    latents = torch.tanh(moc.latent(hidden)).view(9, 3, 6)
    mixed = (prior.unsqueeze(-1) * latents).sum(1)
    torch.testing.assert_close(moc.log_prob(hidden), softmax.log_prob(mixed))


def test_sigsoftmax_is_exp_times_sigmoid_normalised():
    head = build_head("sigsoftmax", d_in=6, vocab_size=11)
    hidden = torch.randn(9, 6)
    with torch.no_grad():
        z = (hidden @ head.weight.T + head.bias).double()
        unnormalised = torch.exp(z) * torch.sigmoid(z)
        expected = torch.log(unnormalised / unnormalised.sum(-1, keepdim=True))
    torch.testing.assert_close(head.log_prob(hidden).double(), expected, atol=1e-6, rtol=1e-6)


def test_gss_zero_two_is_sigsoftmax_and_unit_slope_is_softmax():
    hidden = 3 * torch.randn(9, 6)
    sig = build_head("sigsoftmax", d_in=6, vocab_size=11)
    for (center, slope), reference_name in (((0.0, 2.0), "sigsoftmax"), ((-1.5, 1.0), "softmax")):
        gss = build_head("gss", d_in=6, vocab_size=11, center=center, slope=slope)
        reference = (
            sig if reference_name == "sigsoftmax" else build_head("softmax", d_in=6, vocab_size=11)
        )
        _copy_decoder(gss, reference)
        torch.testing.assert_close(gss.log_prob(hidden), reference.log_prob(hidden))


def test_gss_default_is_the_papers_ptb_choice_and_differs_from_both_special_cases():
    gss = build_head("gss", d_in=6, vocab_size=11)
    assert (gss.center, gss.slope) == (-1.5, 2.5)
    z = torch.linspace(-5, 5, 11)
    expected = 2.5 * (z + 1.5) - 1.5 - 1.5 * torch.log1p(torch.exp(z + 1.5))
    torch.testing.assert_close(gss.transform(z), expected)


def test_sigmoid_tree_gives_four_priors_that_sum_to_one():
    pre = 5 * torch.randn(100, 3)
    priors = sigmoid_tree(pre)
    g = torch.sigmoid(pre)
    expected = torch.stack(
        (
            g[:, 0] * g[:, 1],
            g[:, 0] * (1 - g[:, 1]),
            (1 - g[:, 0]) * g[:, 2],
            (1 - g[:, 0]) * (1 - g[:, 2]),
        ),
        dim=-1,
    )
    torch.testing.assert_close(priors, expected)
    torch.testing.assert_close(priors.sum(-1), torch.ones(100))
    assert (priors >= 0).all()


def test_sigmoid_tree_mix_is_the_prior_weighted_sum_even_for_saturated_gates():
    pre = torch.cat((5 * torch.randn(50, 3, 7), torch.full((1, 3, 7), 30.0)))  # (51, 3, 7)
    values = torch.randn(51, 4, 7, dtype=torch.float64)
    expected = (sigmoid_tree(pre.double().transpose(1, 2)) * values.transpose(1, 2)).sum(-1)
    torch.testing.assert_close(sigmoid_tree_mix(pre.double(), values), expected)


def test_in_place_sigmoid_tree_mix_gives_the_same_values_bit_for_bit():
    pre, values = 5 * torch.randn(6, 3, 7), torch.randn(6, 4, 7)
    expected = sigmoid_tree_mix(pre, values)
    out = torch.empty(6, 7)
    sigmoid_tree_mix_(pre.clone(), values.clone(), out=out)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize(
    ("name", "knobs"),
    [
        ("mos", {"n_components": 3}),
        ("mixtape", {"gate_dim": 3, "frequent_fraction": 0.3}),
    ],
)
def test_inference_paths_agree_with_the_general_ones(name, knobs, rows):
    """Without gradients MoS mixes in place and Mixtape assembles its logits in place;
    ``reference_paths()`` switches back to the general path (what the benchmarks compare)."""
    head = build_head(name, d_in=6, vocab_size=300, residual_contexts=True, **knobs).eval()
    hidden = 3 * torch.randn(rows, 6)
    with torch.no_grad():
        fast = head.log_prob(hidden)
        with reference_paths():
            general = head.log_prob(hidden)
    torch.testing.assert_close(fast, general, atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("name", ["softmax", "sigsoftmax", "gss", "plif", "moc", "mlp_softmax"])
def test_the_softmax_family_normalises_in_place_to_the_same_values_bit_for_bit(
    name, rows, monkeypatch
):
    """Without gradients the log_prob of a head that is one softmax over its logits (the
    softmax family, MoC, the MLP softmax) normalises them in place; the values are those of
    the general path (a new tensor) exactly, and with gradients the general path runs (the
    in-place one would break autograd)."""
    in_place_calls = []  # torch.log_softmax(..., out=): F.log_softmax does not go through it
    real = torch.log_softmax

    def spy(*args, **kwargs):
        in_place_calls.append(kwargs.get("out") is not None and kwargs["out"] is args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "log_softmax", spy)
    head = build_head(name, d_in=6, vocab_size=300, d_embed=5).eval()
    hidden = 3 * torch.randn(rows, 6)
    with torch.no_grad():
        fast = head.log_prob(hidden)
        assert in_place_calls == [True]  # the in-place path ran, writing into its input
        with reference_paths():
            general = head.log_prob(hidden)
    assert torch.equal(fast, general)
    with_grad = head.log_prob(hidden.requires_grad_())
    assert in_place_calls == [True]
    with_grad.logsumexp(-1).sum().backward()
    torch.testing.assert_close(with_grad.detach(), general, atol=1e-6, rtol=1e-6)


def _mixtape_reference(head, hidden, gate_weight=None):
    """Mixtape's equations written out for every token, in float64 (no gate-sharing trick).
    ``gate_weight``: U as a float64 matrix (default: the head's)."""
    n, v, s = hidden.shape[0], head.vocab_size, head.n_frequent
    if gate_weight is None:
        gate_weight = head.gate_features.weight.double()
    with torch.no_grad():
        g = hidden.double()
        contexts = torch.tanh(g @ head.components.weight.double().T + head.components.bias.double())
        contexts = contexts.view(n, 4, -1)
        features = torch.tanh(g @ gate_weight.T + head.gate_features.bias.double())
        features = features.view(n, 3, -1)
        shared = g @ head.context_gate.weight.double().T  # (N, 3)
        pre = shared.unsqueeze(1).expand(n, v, 3).clone()  # rare tokens: u_j . g
        pre[:, :s] += torch.einsum("njg,sg->nsj", features, head.token_gate.double())
        pre[:, :s] += head.token_gate_bias.double()
        priors = sigmoid_tree(pre)  # (N, V, 4)
        component_logits = torch.einsum("nkd,vd->nvk", contexts, head.weight.double())
        logits = (priors * component_logits).sum(-1) + head.bias.double()
        return F.log_softmax(logits, -1)


@GRAD_MODES
@pytest.mark.parametrize("rows", [1, 3, 9])  # one row, the few-row layout, the general one
@pytest.mark.parametrize("frequent_fraction", [0.0, 0.3, 1.0])
def test_mixtape_matches_its_equations_with_and_without_gate_sharing(frequent_fraction, rows, grad):
    head = build_head(
        "mixtape", d_in=6, vocab_size=20, gate_dim=3, frequent_fraction=frequent_fraction
    )
    with torch.no_grad():
        head.token_gate_bias.normal_()  # make the per-token biases matter
        head.bias.normal_()
    hidden = 2 * torch.randn(rows, 6)
    assert head.n_frequent == math.floor(frequent_fraction * 20)
    with torch.set_grad_enabled(grad):
        log_p = head.log_prob(hidden)
    assert log_p.requires_grad == grad  # the path meant
    torch.testing.assert_close(
        log_p.double(), _mixtape_reference(head, hidden), atol=1e-5, rtol=1e-5
    )


def _weight_normalised_mixtape():
    head = build_head(
        "mixtape", d_in=6, vocab_size=20, gate_dim=3, frequent_fraction=0.3, gate_weight_norm=True
    )
    with torch.no_grad():
        head.token_gate_bias.normal_()
    return head


def test_mixtape_weight_norm_is_a_constant_scale_times_the_row_direction():
    head = _weight_normalised_mixtape()
    weight = head.gate_features.parametrizations.weight
    scale, direction = weight.original0, weight.original1  # g (rows, 1), v (rows, d_in)
    assert isinstance(direction, torch.nn.Parameter)
    assert all(p is not scale for p in head.parameters())  # g is constant: a buffer
    assert "gate_features.parametrizations.weight.original0" in head.state_dict()
    expected = scale.double() * direction.double() / direction.double().norm(dim=1, keepdim=True)
    torch.testing.assert_close(head.gate_features.weight.double(), expected)
    hidden = 2 * torch.randn(9, 6)
    torch.testing.assert_close(
        head.log_prob(hidden).double(),
        _mixtape_reference(head, hidden, gate_weight=expected.detach()),
        atol=1e-5,
        rtol=1e-5,
    )


def test_mixtape_weight_norm_keeps_every_row_norm_through_training():
    heads = {"normalised": _weight_normalised_mixtape()}
    torch.manual_seed(0)
    heads["plain"] = build_head("mixtape", d_in=6, vocab_size=20, gate_dim=3, frequent_fraction=0.3)
    hidden, target = 2 * torch.randn(40, 6), torch.randint(0, 20, (40,))
    for kind, head in heads.items():
        before = head.gate_features.weight.detach().clone()
        optimizer = torch.optim.SGD(head.parameter_groups(lr=1.0), lr=1.0)
        for _ in range(5):
            optimizer.zero_grad()
            head.loss(hidden, target).backward()
            optimizer.step()
        after = head.gate_features.weight.detach()
        assert not torch.allclose(after, before)  # U was trained...
        norms_kept = torch.allclose(after.norm(dim=1), before.norm(dim=1), atol=1e-6, rtol=1e-6)
        assert norms_kept == (kind == "normalised")  # ...its row norms fixed only when normalised


def test_mixtape_weight_norm_survives_a_state_dict_round_trip_and_a_dtype_cast():
    head = _weight_normalised_mixtape()
    loaded = _weight_normalised_mixtape()
    loaded.load_state_dict(head.state_dict())
    hidden = torch.randn(5, 6)
    torch.testing.assert_close(loaded.log_prob(hidden), head.log_prob(hidden))
    narrow = loaded.to(torch.bfloat16)
    assert narrow.gate_features.parametrizations.weight.original0.dtype == torch.bfloat16
    assert narrow.log_prob(hidden.bfloat16()).dtype == torch.float32
    with pytest.raises(ValueError, match="gate_weight_norm must be true or false; got 1"):
        build_head("mixtape", d_in=6, vocab_size=20, gate_weight_norm=1)


def _plif(n_pieces=40, **knobs):
    return build_head("plif", d_in=4, vocab_size=7, n_pieces=n_pieces, low=-2.0, high=2.0, **knobs)


def test_plif_is_the_identity_when_every_slope_is_one():
    head = _plif()
    with torch.no_grad():
        head.slope_logits.fill_(math.log(math.e - 1))
    z = torch.linspace(-5, 5, 101)  # inside and beyond [-2, 2]
    torch.testing.assert_close(head.transform(z), z)


def _lmkit_plif(logits, slopes, T):
    """Ganea et al.'s PlifSmax.func as shipped in yottabytt/awd-lstm-lmkit (float64 here):
    anchored at f(-T) = 0."""
    K = slopes.numel()
    delta = 2.0 * T / K
    indices = torch.clamp(((logits + T) / delta).long(), max=K - 1, min=0)
    cumsum = torch.cumsum(slopes, -1) - slopes
    knots = -T + delta * indices.double()
    return (logits - knots) * slopes[indices] + delta * cumsum[indices]


def test_plif_is_the_reference_function_shifted_by_low():
    """Documented difference: ours is anchored at f(low) = low, the reference at f(low) = 0."""
    head = _plif().double()
    z = torch.linspace(-5, 5, 1001, dtype=torch.float64)  # inside and beyond [-2, 2]
    slopes = head.slopes().detach()
    expected = _lmkit_plif(z, slopes, T=2.0) + head.low
    torch.testing.assert_close(head.transform(z).detach(), expected, rtol=0, atol=1e-12)


def test_plif_is_strictly_increasing_continuous_and_linear_beyond_its_range():
    head = _plif()
    z = torch.linspace(-4, 4, 4001)
    f = head.transform(z).detach()
    assert (f.diff() > 0).all()
    knots = torch.linspace(-2, 2, 41)
    left, right = head.transform(knots - 1e-5).detach(), head.transform(knots + 1e-5).detach()
    max_slope = head.slopes().max().item()
    assert (right - left).abs().max() <= 2e-5 * max_slope + 1e-6  # no jump at any knot
    slopes = head.slopes().detach()
    far_right = head.transform(torch.tensor([3.0, 5.0])).detach()
    far_left = head.transform(torch.tensor([-5.0, -3.0])).detach()
    torch.testing.assert_close(far_right[1] - far_right[0], 2 * slopes[-1])
    torch.testing.assert_close(far_left[1] - far_left[0], 2 * slopes[0])


def test_plif_knot_values_are_the_integral_of_the_slopes():
    head = _plif()
    slopes = head.slopes().detach().double()
    expected = -2.0 + 0.1 * torch.cat((torch.zeros(1), slopes.cumsum(0)))  # f at the 41 knots
    knots = torch.linspace(-2, 2, 41)
    torch.testing.assert_close(head.transform(knots).detach().double(), expected, atol=1e-5, rtol=0)


def test_plif_init_and_paper_defaults():
    torch.manual_seed(0)
    head = build_head("plif", d_in=4, vocab_size=7)
    assert (head.n_pieces, head.low, head.high) == (100_000, -20.0, 20.0)
    theta = head.slope_logits.detach()
    assert abs(theta.mean().item() - math.log(math.e - 1)) < 0.02  # log(e-1) + N(0, 1)
    assert abs(theta.std().item() - 1.0) < 0.02
    groups = head.parameter_groups(lr=20.0)
    assert [g["lr"] for g in groups] == [20.0, 0.02]
    assert groups[1]["params"] == [head.slope_logits]


def test_frozen_plif_keeps_its_slopes_out_of_the_parameters():
    head = _plif(learn_slopes=False)
    assert all(p is not head.slope_logits for p in head.parameters())
    assert "slope_logits" in head.state_dict()
    assert len(head.parameter_groups(lr=1.0)) == 1


def _log_prob_matrix(head, n_contexts, d_in, scale):
    torch.manual_seed(1)
    with torch.no_grad():
        return head.eval().log_prob(scale * torch.randn(n_contexts, d_in))


D = 8


@pytest.mark.parametrize("name", ["softmax", "moc"])
def test_bottlenecked_heads_have_log_prob_rank_at_most_d_plus_2(name):
    head = build_head(
        name, d_in=D, vocab_size=200, **({"n_components": 4} if name == "moc" else {})
    )
    with torch.no_grad():
        head.weight.normal_()
        head.bias.normal_()
    rank = press_rank(_log_prob_matrix(head, 500, D, 2.0))
    assert D <= rank <= D + 2


@pytest.mark.parametrize(
    "name, knobs",
    [("mos", {"n_components": 4}), ("mixtape", {"gate_dim": 4}), ("sigsoftmax", {}), ("gss", {})],
)
def test_high_rank_heads_exceed_three_times_d(name, knobs):
    head = build_head(name, d_in=D, vocab_size=200, **knobs)
    with torch.no_grad():
        head.weight.normal_()
    rank = press_rank(_log_prob_matrix(head, 500, D, 2.0))
    assert rank > 3 * D


def test_plif_hand_written_backward_passes_gradcheck():
    head = _plif(n_pieces=30).double()
    z = (3 * torch.randn(40, dtype=torch.float64)).requires_grad_(True)  # inside and beyond
    torch.autograd.gradcheck(lambda logits, theta: head.transform(logits), (z, head.slope_logits))


def test_plif_backward_is_deterministic_with_several_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        head = build_head("plif", d_in=8, vocab_size=256, n_pieces=1000)
        hidden = torch.randn(256, 8)
        grads = set()
        for _ in range(5):
            head.zero_grad()
            head.log_prob(hidden).logsumexp(0).sum().backward()
            grads.add(head.slope_logits.grad.numpy().tobytes())
        assert len(grads) == 1
    finally:
        torch.set_num_threads(threads)
