"""The head contract (ARCHITECTURE.md), checked for every head in HEADS."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from highrank.heads import HEADS, build_head
from tests.conftest import head_inputs

HEAD_NAMES = list(HEADS)
SHAPES = [(24,), (3, 8)]  # leading shapes: [N, d] and [B, T, d]
HEADS_WITH_TRAINING_NOISE = {"moc", "mos", "mixtape", "mlp_softmax"}
# Heads that read their sequence (heads/sequence.py) take the other inputs they read:
# head_inputs(head, hidden) makes them for every call below.


def _inputs(lead, d_in=12, vocab_size=50, scale=1.0):
    hidden = scale * torch.randn(*lead, d_in)
    target = torch.randint(0, vocab_size, lead)
    return hidden, target


@pytest.mark.parametrize("lead", SHAPES)
@pytest.mark.parametrize("name", HEAD_NAMES)
def test_log_prob_is_normalised_float32(make_head, name, lead):
    head = make_head(name, stochastic=True)  # training mode: dropout and noise on
    hidden, _ = _inputs(lead)
    log_p = head.log_prob(hidden, **head_inputs(head, hidden))
    assert log_p.shape == (*lead, 50)
    assert log_p.dtype == torch.float32
    torch.testing.assert_close(log_p.logsumexp(-1), torch.zeros(lead), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_large_hidden_states_give_finite_output_and_gradients(make_head, name):
    head = make_head(name)
    hidden, target = _inputs((3, 8), scale=100.0)
    hidden.requires_grad_(True)
    inputs = head_inputs(head, hidden)
    log_p = head.log_prob(hidden, **inputs)
    assert torch.isfinite(log_p).all()
    torch.testing.assert_close(log_p.logsumexp(-1), torch.zeros(3, 8), atol=1e-5, rtol=0)
    head.loss(hidden, target, **inputs).backward()
    assert torch.isfinite(hidden.grad).all()


@pytest.mark.parametrize("lead", SHAPES)
@pytest.mark.parametrize("name", HEAD_NAMES)
def test_loss_is_negative_gathered_log_prob(make_head, name, lead):
    head = make_head(name).eval()
    hidden, target = _inputs(lead)
    inputs = head_inputs(head, hidden)
    gathered = -head.log_prob(hidden, **inputs).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(head.loss(hidden, target, reduction="none", **inputs), gathered)
    torch.testing.assert_close(head.loss(hidden, target, **inputs), gathered.mean())
    torch.testing.assert_close(head.loss(hidden, target, reduction="sum", **inputs), gathered.sum())
    torch.testing.assert_close(head(hidden, target, **inputs), gathered.mean())
    torch.testing.assert_close(head(hidden, **inputs), head.log_prob(hidden, **inputs))


def _loss_and_grads(head, hidden, target, chunk_size):
    head.zero_grad()
    hidden = hidden.clone().requires_grad_(True)
    loss = head.loss(hidden, target, chunk_size=chunk_size, **head_inputs(head, hidden))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in head.named_parameters()}
    return loss.detach(), hidden.grad, grads


@pytest.mark.parametrize("chunk_size", [6, 7, 1])  # divides N = 24, does not, single rows
@pytest.mark.parametrize("name", HEAD_NAMES)
def test_chunked_loss_matches_unchunked_in_value_and_gradients(make_head, name, chunk_size):
    head = make_head(name).eval()
    hidden, target = _inputs((24,))
    loss, hidden_grad, grads = _loss_and_grads(head, hidden, target, None)
    c_loss, c_hidden_grad, c_grads = _loss_and_grads(head, hidden, target, chunk_size)
    torch.testing.assert_close(c_loss, loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(c_hidden_grad, hidden_grad, atol=1e-6, rtol=1e-5)
    for param_name, grad in grads.items():
        torch.testing.assert_close(c_grads[param_name], grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["moc", "mos", "mixtape"])
def test_chunked_loss_keeps_the_dropout_masks_of_the_unchunked_one(make_head, name):
    # Locked-dropout masks are drawn once, before chunking, so a seeded chunked run and a
    # seeded unchunked run see the same masks. (Mixtape's gate noise is drawn per chunk,
    # so it is off here.)
    head = make_head(name, stochastic=True, **({"gate_noise": 0.0} if name == "mixtape" else {}))
    hidden, target = _inputs((4, 6))
    torch.manual_seed(1)
    loss, hidden_grad, grads = _loss_and_grads(head, hidden, target, None)
    torch.manual_seed(1)
    c_loss, c_hidden_grad, c_grads = _loss_and_grads(head, hidden, target, 5)
    torch.testing.assert_close(c_loss, loss)
    torch.testing.assert_close(c_hidden_grad, hidden_grad, atol=1e-6, rtol=1e-5)
    for param_name, grad in grads.items():
        torch.testing.assert_close(c_grads[param_name], grad, atol=1e-6, rtol=1e-5)


def test_chunked_recomputation_replays_mixtape_gate_noise(make_head):
    # With noise drawn inside each chunk, backward must recompute the chunk with the *same*
    # noise: the gradient then matches finite differences of the very loss that was returned.
    head = make_head("mixtape", gate_noise=0.5).double()
    hidden, target = _inputs((10,))
    hidden = hidden.double().requires_grad_(True)
    torch.manual_seed(3)
    head.loss(hidden, target, chunk_size=3, reduction="sum").backward()
    direction = torch.randn_like(hidden)
    step = 1e-6
    values = []
    for sign in (1.0, -1.0):
        torch.manual_seed(3)
        values.append(
            head.loss(hidden + sign * step * direction, target, chunk_size=3, reduction="sum")
        )
    numeric = (values[0] - values[1]) / (2 * step)
    torch.testing.assert_close(
        (hidden.grad * direction).sum(), numeric.detach(), rtol=1e-5, atol=1e-7
    )


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_gradients_reach_every_parameter(make_head, name):
    head = make_head(name, stochastic=True)
    hidden, target = _inputs((3, 8))
    head.loss(hidden, target, **head_inputs(head, hidden)).backward()
    for param_name, param in head.named_parameters():
        assert param.grad is not None, f"{name}.{param_name} got no gradient"
        assert param.grad.abs().sum() > 0, f"{name}.{param_name} got an all-zero gradient"


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_bf16_autocast_keeps_float32_normalised_output(make_head, name):
    head = make_head(name)
    hidden, target = _inputs((3, 8))
    inputs = head_inputs(head, hidden)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        log_p = head.log_prob(hidden, **inputs)
        loss = head.loss(hidden, target, **inputs)
    assert log_p.dtype == torch.float32 and loss.dtype == torch.float32
    torch.testing.assert_close(log_p.logsumexp(-1), torch.zeros(3, 8), atol=1e-5, rtol=0)
    # bf16 matmuls cost precision, not correctness: close to the float32 result.
    torch.testing.assert_close(loss, head.loss(hidden, target, **inputs), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_tying_shares_one_parameter(make_head, name):
    embedding = nn.Embedding(50, 12)
    head = make_head(name, tied_weight=embedding.weight)
    assert head.weight is embedding.weight
    model = nn.ModuleDict({"embedding": embedding, "head": head})
    shared = [p for p in model.parameters() if p is embedding.weight]
    assert len(shared) == 1  # counted once, not twice
    hidden, target = _inputs((3, 8))
    head.loss(hidden, target, **head_inputs(head, hidden)).backward()
    assert embedding.weight.grad is not None and embedding.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_tying_with_a_projection_when_sizes_differ(make_head, name):
    embedding = nn.Embedding(50, 6)
    head = make_head(name, tied_weight=embedding.weight)  # d_in 12, d_embed 6
    assert head.d_embed == 6
    hidden, _ = _inputs((5,))
    torch.testing.assert_close(
        head.log_prob(hidden, **head_inputs(head, hidden)).logsumexp(-1),
        torch.zeros(5),
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_eval_turns_dropout_and_noise_off(make_head, name):
    head = make_head(name, stochastic=True)
    hidden, _ = _inputs((3, 8))
    inputs = head_inputs(head, hidden)
    train_a, train_b = head.log_prob(hidden, **inputs), head.log_prob(hidden, **inputs)
    head.eval()
    eval_a, eval_b = head.log_prob(hidden, **inputs), head.log_prob(hidden, **inputs)
    torch.testing.assert_close(eval_a, eval_b, atol=0, rtol=0)
    if name in HEADS_WITH_TRAINING_NOISE:
        assert not torch.allclose(train_a, train_b), "training mode should draw fresh noise"
        assert not torch.allclose(train_a, eval_a)
    else:
        torch.testing.assert_close(train_a, eval_a, atol=0, rtol=0)


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_deterministic_under_a_seed(make_head, name):
    outputs = []
    for _ in range(2):
        torch.manual_seed(7)
        head = make_head(name, stochastic=True)
        hidden, target = _inputs((3, 8))
        inputs = head_inputs(head, hidden)
        outputs.append((head.log_prob(hidden, **inputs), head.loss(hidden, target, **inputs)))
    torch.testing.assert_close(outputs[0][0], outputs[1][0], atol=0, rtol=0)
    torch.testing.assert_close(outputs[0][1], outputs[1][1], atol=0, rtol=0)


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_bad_input_gets_a_clear_error(make_head, name):
    head = make_head(name)
    with pytest.raises(ValueError, match=r"d_in=12"):
        head.log_prob(torch.randn(4, 11))
    hidden = torch.randn(4, 12)
    inputs = head_inputs(head, hidden)
    with pytest.raises(ValueError, match=r"target has shape \(5,\); expected \(4,\)"):
        head.loss(hidden, torch.zeros(5, dtype=torch.long), **inputs)
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        head.loss(hidden, torch.tensor([0, 1, 2, 50]), **inputs)
    with pytest.raises(TypeError, match="integer token ids"):
        head.loss(hidden, torch.zeros(4), **inputs)
    with pytest.raises(ValueError, match="reduction"):
        head.loss(hidden, torch.zeros(4, dtype=torch.long), reduction="avg", **inputs)
    with pytest.raises(ValueError, match="chunk_size"):
        head.loss(hidden, torch.zeros(4, dtype=torch.long), chunk_size=0, **inputs)


def test_build_head_rejects_unknown_names_and_knobs():
    with pytest.raises(ValueError, match="choose one of: softmax, moc, mos, mixtape"):
        build_head("mos2", d_in=4, vocab_size=10)
    with pytest.raises(TypeError, match=r"no knob\(s\) n_experts; valid knobs: .*n_components=15"):
        build_head("mos", d_in=4, vocab_size=10, n_experts=3)


def test_tied_weight_of_the_wrong_shape_is_rejected():
    with pytest.raises(ValueError, match=r"tied_weight has shape \(9, 4\); expected \(10, "):
        build_head("softmax", d_in=4, vocab_size=10, tied_weight=nn.Parameter(torch.ones(9, 4)))


def test_softmax_loss_uses_cross_entropy_semantics():
    head = build_head("softmax", d_in=5, vocab_size=7)
    hidden, target = torch.randn(6, 5), torch.randint(0, 7, (6,))
    expected = F.cross_entropy(F.linear(hidden, head.weight, head.bias), target)
    torch.testing.assert_close(head.loss(hidden, target), expected)


@pytest.mark.parametrize("name", ["moc", "mos", "mixtape"])
@pytest.mark.parametrize("time_dim", [0, 1])
def test_locked_dropout_shares_one_mask_over_the_time_axis(make_head, name, time_dim):
    head = make_head(name, stochastic=True, dropout_time_dim=time_dim)
    if name == "mixtape":
        head.gate_noise = 0.0  # noise is per token by design; only the masks are locked
    step = torch.randn(5, 12)
    hidden = torch.stack([step] * 4, dim=time_dim)  # the same states at every time step
    log_p = head.log_prob(hidden)
    first = log_p.select(time_dim, 0)
    for t in range(1, 4):
        torch.testing.assert_close(log_p.select(time_dim, t), first)
    # ... while different sequences get different masks.
    independent = make_head(name, stochastic=True, dropout_time_dim=None)
    independent.load_state_dict(head.state_dict())
    if name == "mixtape":
        independent.gate_noise = 0.0
    free = independent.log_prob(hidden)
    assert not torch.allclose(free.select(time_dim, 0), free.select(time_dim, 1))


def test_dropout_time_dim_outside_the_input_is_a_clear_error(make_head):
    head = make_head("mos", stochastic=True, dropout_time_dim=2)
    with pytest.raises(ValueError, match=r"dropout_time_dim=2 is not a time axis"):
        head.log_prob(torch.randn(3, 4, 12))
    # Flat (N, d) input has no time axis: locking over N would give every token one mask.
    flat = make_head("mos", stochastic=True, dropout_time_dim=0)
    with pytest.raises(ValueError, match=r"dropout_time_dim=0 is not a time axis"):
        flat.log_prob(torch.randn(6, 12))
    flat.eval().log_prob(torch.randn(6, 12))  # no masks in eval: fine
    with pytest.raises(ValueError, match="dropout_time_dim must be an integer"):
        make_head("mos", dropout_time_dim="0")


@pytest.mark.parametrize(
    "knobs, message",
    [
        ({"n_components": True}, "n_components must be a positive integer"),
        ({"n_components": 0}, "n_components must be a positive integer"),
        ({"latent_dropout": 1.0}, r"latent_dropout must be a number in \[0, 1\)"),
    ],
)
def test_bad_knobs_are_rejected_when_the_head_is_built(make_head, knobs, message):
    with pytest.raises(ValueError, match=message):
        make_head("mos", **knobs)


def test_mixtape_frequent_count_survives_floating_point_rounding(make_head):
    assert make_head("mixtape", vocab_size=100, frequent_fraction=0.29).n_frequent == 29
    with pytest.raises(ValueError, match="frequent_fraction"):
        make_head("mixtape", frequent_fraction=True)


def test_chunked_loss_under_inference_mode(make_head):
    head = make_head("mos").eval()
    hidden, target = torch.randn(10, 12), torch.randint(0, 50, (10,))
    with torch.inference_mode():
        chunked = head.loss(hidden, target, chunk_size=3)
        plain = head.loss(hidden, target)
    torch.testing.assert_close(chunked, plain)


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_a_head_cast_to_bf16_still_gives_float32_normalised_output(make_head, name):
    head = make_head(name, stochastic=True).to(torch.bfloat16)  # training: dropout masks on
    hidden, target = _inputs((3, 8))
    hidden = hidden.to(torch.bfloat16).requires_grad_(True)
    inputs = head_inputs(head, hidden)
    log_p = head.log_prob(hidden, **inputs)
    assert log_p.dtype == torch.float32
    torch.testing.assert_close(log_p.logsumexp(-1), torch.zeros(3, 8), atol=1e-5, rtol=0)
    for chunk_size in (None, 5):  # whole batch, and the chunked (fused or generic) path
        head.zero_grad()
        inputs = head_inputs(head, hidden)  # a fresh graph for each backward
        loss = head.loss(hidden, target, chunk_size=chunk_size, label_smoothing=0.1, **inputs)
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
        loss.backward()
        for param_name, param in head.named_parameters():
            assert param.grad.dtype == torch.bfloat16, param_name
            assert torch.isfinite(param.grad).all(), param_name
    # Same values as the float32 head holding the same (bf16-rounded) numbers, up to bf16
    # rounding of the intermediate activations.
    head.eval()
    wide = copy.deepcopy(head).float()
    wide_hidden = hidden.float()
    for chunk_size in (None, 5):
        torch.testing.assert_close(
            head.loss(hidden, target, chunk_size=chunk_size, **inputs),
            wide.loss(wide_hidden, target, chunk_size=chunk_size, **head_inputs(wide, wide_hidden)),
            atol=0.05,
            rtol=0.02,
        )


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_integer_or_mismatched_hidden_dtype_is_one_clear_error(make_head, name):
    head = make_head(name)
    cls = type(head).__name__
    with pytest.raises(TypeError, match=rf"{cls}: hidden has dtype torch.int64; expected float"):
        head.log_prob(torch.ones(4, 12, dtype=torch.long))
    with pytest.raises(TypeError, match=rf"{cls}: hidden has dtype torch.float64 but the head"):
        head.loss(torch.randn(4, 12, dtype=torch.float64), torch.zeros(4, dtype=torch.long))
    narrow = copy.deepcopy(head).to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"torch.float32 but the head's parameters are torch.bf"):
        narrow.log_prob(torch.randn(4, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts both sides: allowed
        narrow_hidden = torch.randn(4, 12, dtype=torch.bfloat16)
        inputs = head_inputs(head, narrow_hidden)
        assert head.log_prob(narrow_hidden, **inputs).dtype == torch.float32


def test_plif_with_a_nan_input_returns_nan_instead_of_failing(make_head):
    head = make_head("plif")
    hidden = torch.randn(3, 12)
    hidden[1, 0] = float("nan")
    log_p = head.log_prob(hidden)
    assert log_p[1].isnan().all()
    assert torch.isfinite(log_p[[0, 2]]).all()  # other rows untouched
    assert head.loss(hidden, torch.zeros(3, dtype=torch.long)).isnan()
