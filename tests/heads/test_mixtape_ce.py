"""The fused Mixtape loss (``heads/kernels/mixtape_ce.py``): loss and every gradient against float64
references.

Two independent references:

* the function ``mixtape_cross_entropy_sum`` against the Mixtape equations written out for
  every token and context in float64 (a (N, V, 4) prior tensor, no gate sharing, no tree
  factorisation), differentiated by autograd;
* the module, ``Mixtape.loss`` with chunks (the fused path), against the same module cast to
  float64 on its generic path (``reference_paths()``: autograd on ``Mixtape._logits_rows``),
  for every parameter of the head and the hidden states, with dropout masks and seeded gate
  noise drawn in the same order.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from highrank.heads.functional import sigmoid_tree
from highrank.heads.kernels import reference_paths
from highrank.heads.kernels.mixtape_ce import mixtape_cross_entropy_sum
from highrank.heads.mixtape import Mixtape

IGNORE = -100
N, D, GATE_DIM, VOCAB = 30, 5, 3, 40
DIFFERENTIABLE = (
    "contexts",
    "features",
    "shared_pre",
    "token_gate",
    "token_gate_bias",
    "weight",
    "bias",
)


# ---- the function against the equations ----------------------------------------------------


def _function_inputs(n_frequent, dtype=torch.float64, n=N, vocab=VOCAB):
    """Random inputs of realistic scale (tanh activations, decoder rows of norm ~1)."""
    generator = torch.Generator().manual_seed(1)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator, dtype=torch.float64)).to(dtype)

    inputs = {
        "contexts": torch.tanh(randn(n, 4, D, scale=2.0)),
        "features": torch.tanh(randn(n, 3, GATE_DIM, scale=2.0)),
        "shared_pre": randn(n, 3),
        "token_gate": randn(n_frequent, GATE_DIM),
        "token_gate_bias": randn(n_frequent, 3, scale=0.5),
        "weight": randn(vocab, D),
        "bias": randn(vocab, scale=0.5),
    }
    target = torch.randint(0, vocab, (n,), generator=generator)
    target[::4] = IGNORE  # the first row and every fourth ignored
    return inputs, target


def _equations_loss(inputs, target, label_smoothing):
    """Summed loss from Mixtape's equations: a prior per token and context, then one softmax.

    pre_{i,x,j} = v_x . t_{i,j} + s_{i,j} + b_{x,j} for x < S, s_{i,j} otherwise;
    z_{i,x} = sum_k pi_k(pre_{i,x}) (h_{i,k} . w_x) + b_x.
    """
    h, t, s = inputs["contexts"], inputs["features"], inputs["shared_pre"]
    n_frequent, vocab = inputs["token_gate"].shape[0], inputs["weight"].shape[0]
    frequent_pre = torch.einsum("njg,xg->nxj", t, inputs["token_gate"]) + inputs["token_gate_bias"]
    rare_pre = torch.zeros(h.shape[0], vocab - n_frequent, 3, dtype=h.dtype)
    pre = torch.cat((frequent_pre, rare_pre), dim=1) + s.unsqueeze(1)  # (N, V, 3)
    prior = sigmoid_tree(pre)  # (N, V, 4)
    component_logits = torch.einsum("nkd,xd->nxk", h, inputs["weight"])  # (N, V, 4)
    logits = (prior * component_logits).sum(-1) + inputs["bias"]
    return F.cross_entropy(
        logits, target, ignore_index=IGNORE, label_smoothing=label_smoothing, reduction="sum"
    )


def _gradients(loss_fn, inputs, target, upstream=1.0):
    leaves = {name: x.detach().clone().requires_grad_(True) for name, x in inputs.items()}
    loss = loss_fn(leaves, target)
    (upstream * loss).backward()
    return loss.detach(), {name: leaves[name].grad for name in DIFFERENTIABLE}


def _fused(chunk_size, label_smoothing, **options):
    def loss(leaves, target):
        ordered = [leaves[name] for name in DIFFERENTIABLE]
        return mixtape_cross_entropy_sum(
            *ordered, target, chunk_size, label_smoothing=label_smoothing, **options
        )

    return loss


def _assert_close(got, expected, atol, rtol):
    loss, grads = got
    ref_loss, ref_grads = expected
    torch.testing.assert_close(loss.double(), ref_loss, atol=atol, rtol=rtol)
    for name in DIFFERENTIABLE:
        assert grads[name] is not None, name
        torch.testing.assert_close(
            grads[name].double(),
            ref_grads[name],
            atol=atol,
            rtol=rtol,
            msg=lambda m, name=name: f"d loss / d {name}: {m}",
        )


# S = 0 (gate sharing only), 12 of 40 (both blocks), 40 (vector gating only); chunks of 1, 7
# and 13 tokens (neither divides 30: a short last chunk), 30 (one chunk) and 64 (more than N).
@pytest.mark.parametrize("n_frequent", [0, 12, VOCAB])
@pytest.mark.parametrize("chunk_size", [1, 7, 13, 30, 64])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_function_matches_the_equations_in_float64(n_frequent, chunk_size, label_smoothing):
    inputs, target = _function_inputs(n_frequent)
    expected = _gradients(lambda x, t: _equations_loss(x, t, label_smoothing), inputs, target)
    got = _gradients(_fused(chunk_size, label_smoothing), inputs, target)
    _assert_close(got, expected, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("n_frequent", [0, 12, VOCAB])
def test_function_in_float32_matches_the_float64_equations(n_frequent):
    inputs, target = _function_inputs(n_frequent)
    expected = _gradients(lambda x, t: _equations_loss(x, t, 0.1), inputs, target)
    narrow = {name: x.float() for name, x in inputs.items()}
    loss, grads = _gradients(_fused(7, 0.1), narrow, target)
    assert loss.dtype == torch.float32
    assert all(grads[name].dtype == torch.float32 for name in DIFFERENTIABLE)
    _assert_close((loss, grads), expected, atol=1e-5, rtol=1e-5)


def test_backward_scales_every_gradient_by_the_upstream_gradient():
    inputs, target = _function_inputs(12)
    expected = _gradients(lambda x, t: _equations_loss(x, t, 0.0), inputs, target, upstream=-2.5)
    got = _gradients(_fused(7, 0.0), inputs, target, upstream=-2.5)
    _assert_close(got, expected, atol=1e-12, rtol=1e-10)


def test_every_target_ignored_gives_zero_loss_and_zero_gradients():
    inputs, target = _function_inputs(12)
    loss, grads = _gradients(_fused(7, 0.1), inputs, torch.full_like(target, IGNORE))
    assert loss.item() == 0.0
    for name in DIFFERENTIABLE:
        assert not grads[name].any(), name


def test_only_the_inputs_that_need_a_gradient_get_one():
    inputs, target = _function_inputs(12)
    frozen = {name: x.detach() for name, x in inputs.items()}
    contexts = frozen["contexts"].clone().requires_grad_(True)
    frozen["contexts"] = contexts
    mixtape_cross_entropy_sum(*(frozen[name] for name in DIFFERENTIABLE), target, 7).backward()
    leaves = {name: x.detach().clone().requires_grad_(True) for name, x in inputs.items()}
    _equations_loss(leaves, target, 0.0).backward()
    torch.testing.assert_close(contexts.grad, leaves["contexts"].grad, atol=1e-12, rtol=1e-10)


def test_gate_noise_is_seeded_and_changes_the_loss():
    inputs, target = _function_inputs(12)
    args = (*(inputs[name] for name in DIFFERENTIABLE), target, 7)
    torch.manual_seed(3)
    first = mixtape_cross_entropy_sum(*args, gate_noise=0.5)
    torch.manual_seed(3)
    again = mixtape_cross_entropy_sum(*args, gate_noise=0.5)
    assert first.item() == again.item()
    assert first.item() != mixtape_cross_entropy_sum(*args).item()


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [
        ("contexts", (N, 3, D), r"contexts has shape \(30, 3, 5\); expected \(30, 4, 5\)"),
        ("features", (N, 3, 2), r"features has shape \(30, 3, 2\); expected \(30, 3, 3\)"),
        ("shared_pre", (N, 4), r"shared_pre has shape \(30, 4\); expected \(30, 3\)"),
        ("token_gate_bias", (12, 2), r"token_gate_bias has shape \(12, 2\); expected \(12, 3\)"),
        ("weight", (VOCAB, D + 1), r"weight has shape \(40, 6\); expected \(40, 5\)"),
        ("bias", (VOCAB + 1,), r"bias has shape \(41,\); expected \(40,\)"),
    ],
)
def test_a_mis_shaped_input_is_one_clear_error(name, shape, message):
    inputs, target = _function_inputs(12)
    inputs[name] = torch.zeros(shape, dtype=torch.float64)
    with pytest.raises(ValueError, match=message):
        mixtape_cross_entropy_sum(*(inputs[n] for n in DIFFERENTIABLE), target, 7)


def test_more_token_gates_than_tokens_is_one_clear_error():
    inputs, target = _function_inputs(VOCAB)
    inputs["token_gate"] = torch.zeros(VOCAB + 1, GATE_DIM, dtype=torch.float64)
    inputs["token_gate_bias"] = torch.zeros(VOCAB + 1, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="41 frequent token gates for a vocabulary of 40"):
        mixtape_cross_entropy_sum(*(inputs[n] for n in DIFFERENTIABLE), target, 7)


# ---- the module: fused chunks against the generic path in float64 -------------------------


def _generic_run(head: Mixtape, hidden, target, seed=0, dtype=torch.float64, **options):
    """``_module_run`` of a copy of the head in ``dtype`` on the generic chunked path
    (``reference_paths()``: autograd on ``_logits_rows``)."""
    with reference_paths():
        return _module_run(copy.deepcopy(head).to(dtype), hidden, target, seed, **options)


def _module_inputs(shape=(10, 3), d_in=12, vocab_size=50):
    generator = torch.Generator().manual_seed(2)
    hidden = 2.0 * torch.randn(*shape, d_in, generator=generator)
    target = torch.randint(0, vocab_size, shape, generator=generator)
    target.view(-1)[::4] = IGNORE
    return hidden, target


def _module_run(head, hidden, target, seed=0, **options):
    """Loss and the gradients of the hidden states and of every parameter, after seeding
    the RNG (dropout masks and gate noise)."""
    head.zero_grad()
    hidden = hidden.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)
    loss = head.loss(hidden, target, **options)
    loss.backward()
    grads = {name: p.grad for name, p in head.named_parameters() if p.requires_grad}
    return loss.detach(), hidden.grad, grads


def _assert_module_close(got, expected, atol, rtol):
    loss, hidden_grad, grads = got
    ref_loss, ref_hidden_grad, ref_grads = expected
    torch.testing.assert_close(loss.double(), ref_loss.double(), atol=atol, rtol=rtol)
    torch.testing.assert_close(hidden_grad.double(), ref_hidden_grad.double(), atol=atol, rtol=rtol)
    assert set(grads) == set(ref_grads)
    for name, ref_grad in ref_grads.items():
        if grads[name] is None:
            # S = 0: the gate parameters take no part; the generic chunks give them zeros.
            assert ref_grad is None or not ref_grad.any(), name
            continue
        torch.testing.assert_close(
            grads[name].double(),
            ref_grad.double(),
            atol=atol,
            rtol=rtol,
            msg=lambda m, name=name: f"d loss / d {name}: {m}",
        )


def _uses_the_fused_path(monkeypatch):
    """Fail if ``Mixtape.loss`` falls back to the generic gradient-in-forward chunks."""

    def refuse(*args, **kwargs):
        raise AssertionError("the generic chunked path ran instead of the fused one")

    monkeypatch.setattr("highrank.heads.kernels.chunking.gradient_in_forward_nll", refuse)


# frequent_fraction 0 (S = 0), 0.3 (S = 15 of 50) and 1 (S = V); chunks of 1, 4 and 7 tokens
# for N = 30 (4 and 7 leave a short last chunk); eval mode (no randomness).
@pytest.mark.parametrize("frequent_fraction", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("chunk_size", [1, 4, 7])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_module_loss_matches_the_float64_generic_path(
    make_head, monkeypatch, frequent_fraction, chunk_size, label_smoothing
):
    head = make_head("mixtape", frequent_fraction=frequent_fraction).eval()
    hidden, target = _module_inputs()
    options = {"reduction": "sum", "label_smoothing": label_smoothing}
    expected = _generic_run(head, hidden.double(), target, **options, chunk_size=None)
    _uses_the_fused_path(monkeypatch)
    got = _module_run(head.double(), hidden.double(), target, **options, chunk_size=chunk_size)
    _assert_module_close(got, expected, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("frequent_fraction", [0.0, 0.3, 1.0])
def test_float32_module_loss_matches_the_float64_generic_path(
    make_head, monkeypatch, frequent_fraction
):
    head = make_head("mixtape", frequent_fraction=frequent_fraction).eval()
    hidden, target = _module_inputs()
    options = {"label_smoothing": 0.1}  # reduction "mean"
    expected = _generic_run(head, hidden.double(), target, **options, chunk_size=None)
    _uses_the_fused_path(monkeypatch)
    got = _module_run(head, hidden, target, **options, chunk_size=7)
    assert got[0].dtype == torch.float32
    _assert_module_close(got, expected, atol=1e-5, rtol=1e-5)


# Training mode: dropout masks on the gate features and the contexts, Gaussian gate noise.
# The generic path with the same chunks draws the same noise (per chunk: the shared, then
# the frequent pre-activations), so the two agree exactly in float64 as in float32.
@pytest.mark.parametrize("frequent_fraction", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("time_dim", [None, 0])
def test_training_noise_and_dropout_equal_the_generic_path_draws(
    make_head, monkeypatch, frequent_fraction, dtype, time_dim
):
    head = make_head(
        "mixtape",
        stochastic=True,
        frequent_fraction=frequent_fraction,
        gate_noise=0.5,
        dropout_time_dim=time_dim,
    ).to(dtype)
    hidden, target = _module_inputs()
    hidden = hidden.to(dtype)
    options = {"reduction": "sum", "label_smoothing": 0.1, "chunk_size": 7}
    expected = _generic_run(head, hidden, target, seed=5, dtype=dtype, **options)
    _uses_the_fused_path(monkeypatch)
    got = _module_run(head, hidden, target, seed=5, **options)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    _assert_module_close(got, expected, atol=tolerance, rtol=tolerance)
    # The randomness matters: another seed draws other noise and masks.
    assert _module_run(head, hidden, target, seed=6, **options)[0] != got[0]


def test_weight_normalised_gate_features_get_their_direction_gradient(make_head, monkeypatch):
    head = make_head("mixtape", gate_weight_norm=True).eval()
    hidden, target = _module_inputs()
    expected = _generic_run(head, hidden.double(), target, chunk_size=None)
    assert "gate_features.parametrizations.weight.original1" in expected[2]
    _uses_the_fused_path(monkeypatch)
    got = _module_run(head, hidden, target, chunk_size=7)
    _assert_module_close(got, expected, atol=1e-5, rtol=1e-5)


def test_tied_decoder_weight_gets_the_fused_gradient(make_head, monkeypatch):
    embedding = torch.nn.Embedding(50, 12)
    head = make_head("mixtape", tied_weight=embedding.weight).eval()
    hidden, target = _module_inputs()
    expected = _generic_run(head, hidden.double(), target, chunk_size=None)
    _uses_the_fused_path(monkeypatch)
    got = _module_run(head, hidden, target, chunk_size=7)
    _assert_module_close(got, expected, atol=1e-5, rtol=1e-5)
    assert embedding.weight.grad is head.weight.grad


def test_gate_sharing_only_leaves_the_unused_gate_parameters_without_gradient(make_head):
    # S = 0: v_x, b_{x,j}, U_j and c_j take no part in the loss; as on the whole-batch path,
    # they get no gradient (None) rather than a zero one, so no optimiser step touches them.
    head = make_head("mixtape", frequent_fraction=0.0).eval()
    hidden, target = _module_inputs()
    whole = _module_run(head, hidden, target, chunk_size=None)[2]
    fused = _module_run(head, hidden, target, chunk_size=7)[2]
    unused = {"token_gate", "token_gate_bias", "gate_features.weight", "gate_features.bias"}
    for name in unused:
        assert whole[name] is None and fused[name] is None, name
    assert all(fused[name] is not None for name in set(fused) - unused)


def test_frozen_parameters_and_hidden_states_are_left_alone(make_head):
    head = make_head("mixtape").eval()
    head.weight.requires_grad_(False)
    head.token_gate.requires_grad_(False)
    hidden, target = _module_inputs()
    loss = head.loss(hidden, target, chunk_size=7)  # hidden needs no gradient either
    loss.backward()
    assert head.weight.grad is None and head.token_gate.grad is None
    assert head.bias.grad is not None and head.components.weight.grad is not None


def test_bf16_autocast_gradients_are_float32_exact_up_to_the_bf16_activations(
    make_head, monkeypatch
):
    # Under autocast the linear layers run in bf16; the fused loss itself runs in float32 on
    # those activations. The reference: the generic path in float64 on the same bf16-rounded
    # hidden states; what differs is the bf16 rounding of the activations, a few per cent.
    head = make_head("mixtape").eval()
    hidden, target = _module_inputs()
    hidden = hidden.bfloat16().float()
    expected = _generic_run(head, hidden.double(), target, chunk_size=None)
    _uses_the_fused_path(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _module_run(head, hidden, target, chunk_size=7)
    assert got[0].dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in got[2].values())
    _assert_module_close(got, expected, atol=0.02, rtol=0.05)


def test_compiled_fused_loss_matches_eager_in_training_mode(make_head):
    # One opaque custom operator under torch.compile; the same seeded draws as eager mode.
    torch._dynamo.reset()
    head = make_head("mixtape", stochastic=True, gate_noise=0.5)
    hidden, target = _module_inputs()

    def loss(hidden, target):
        return head.loss(hidden, target, chunk_size=7, label_smoothing=0.1)

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    expected = _module_run_with(loss, head, hidden, target)
    got = _module_run_with(compiled, head, hidden, target)
    _assert_module_close(got, expected, atol=1e-6, rtol=1e-6)


def _module_run_with(loss_fn, head, hidden, target):
    head.zero_grad()
    hidden = hidden.detach().clone().requires_grad_(True)
    torch.manual_seed(4)
    loss = loss_fn(hidden, target)
    loss.backward()
    return loss.detach(), hidden.grad, {n: p.grad for n, p in head.named_parameters()}


def test_the_generic_reference_does_not_run_the_fused_loss(make_head, monkeypatch):
    # The references above run under reference_paths(); they must then really be the generic
    # path.
    def refuse(*args, **kwargs):
        raise AssertionError("the fused loss ran in the generic reference")

    monkeypatch.setattr("highrank.heads.kernels.mixtape_ce.mixtape_cross_entropy_sum", refuse)
    head = make_head("mixtape")
    hidden, target = _module_inputs()
    with reference_paths():
        head.loss(hidden, target, chunk_size=7).backward()
        assert head.auto_chunk_tokens() == 256  # GENERIC_AUTO_CHUNK_TOKENS
    with pytest.raises(AssertionError, match="the fused loss ran"):
        make_head("mixtape").loss(hidden, target, chunk_size=7)
