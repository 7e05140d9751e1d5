"""``ignore_index`` and ``label_smoothing`` on every loss path, as ``F.cross_entropy`` defines them.

The reference is written from the head's float64 log-probabilities (checked against closed
forms in test_reference.py), independently of the loss code:

    loss_i = (1 - eps) * -log p(x_i) + eps * mean_v -log p(v)    (0 where x_i is ignored)

and "mean" divides by the number of tokens not ignored.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from highrank.heads import HEADS
from tests.conftest import head_inputs

HEAD_NAMES = list(HEADS)
IGNORE = -100


def _inputs(n=30, d_in=12, vocab_size=50, ignore_index=IGNORE, scale=2.0):
    hidden = scale * torch.randn(n, d_in)
    target = torch.randint(0, vocab_size, (n,))
    target[::4] = ignore_index  # a quarter of the tokens ignored, the first among them
    return hidden, target


def _reference_losses(log_p, target, ignore_index, eps):
    kept = target != ignore_index
    nll = -log_p.gather(-1, torch.where(kept, target, 0).unsqueeze(-1)).squeeze(-1)
    smoothing = -log_p.mean(-1)
    return torch.where(kept, (1 - eps) * nll + eps * smoothing, 0.0), kept


def _reduce(losses, kept, reduction):
    if reduction == "mean":
        return losses.sum() / kept.sum()
    return losses.sum() if reduction == "sum" else losses


def _backward(loss, weights):
    """Scalar losses backpropagate 1; per-token losses a random weight per token, so that a
    path that mixes up tokens shows in the gradients."""
    (loss * weights).sum().backward() if loss.dim() else loss.backward()


def _run(head, hidden, target, weights, **options):
    head.zero_grad()
    hidden = hidden.clone().requires_grad_(True)
    loss = head.loss(hidden, target, **options, **head_inputs(head, hidden))
    _backward(loss, weights)
    return loss.detach(), hidden.grad, {n: p.grad.clone() for n, p in head.named_parameters()}


def _run_reference(head, hidden, target, weights, *, reduction, ignore_index, eps):
    reference = copy.deepcopy(head).double()
    hidden = hidden.double().requires_grad_(True)
    log_p = reference.log_prob(hidden, **head_inputs(reference, hidden))
    losses, kept = _reference_losses(log_p, target, ignore_index, eps)
    loss = _reduce(losses, kept, reduction)
    _backward(loss, weights.double())
    grads = {n: p.grad for n, p in reference.named_parameters()}
    return loss.detach(), hidden.grad, grads


def _assert_matches_reference(result, reference):
    loss, hidden_grad, grads = result
    ref_loss, ref_hidden_grad, ref_grads = reference
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(hidden_grad.double(), ref_hidden_grad, atol=1e-4, rtol=1e-4)
    for name, ref_grad in ref_grads.items():
        torch.testing.assert_close(grads[name].double(), ref_grad, atol=1e-4, rtol=1e-4, msg=name)


# chunk_size None: the whole batch; 7: gradients computed in forward for scalar losses (fused
# closed form for softmax, MoC, MoS), activation checkpointing for per-token losses.
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("chunk_size", [None, 7])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", HEAD_NAMES)
def test_every_path_matches_a_float64_reference(make_head, name, reduction, chunk_size, eps):
    head = make_head(name).eval()
    hidden, target = _inputs()
    weights = torch.rand(30)
    options = {"reduction": reduction, "ignore_index": IGNORE, "label_smoothing": eps}
    result = _run(head, hidden, target, weights, chunk_size=chunk_size, **options)
    reference = _run_reference(
        head, hidden, target, weights, reduction=reduction, ignore_index=IGNORE, eps=eps
    )
    _assert_matches_reference(result, reference)
    if reduction == "none":
        assert (result[0][target == IGNORE] == 0).all()


@pytest.mark.parametrize("chunk_size", [None, 7])
def test_weight_normalised_mixtape_matches_a_float64_reference(make_head, chunk_size):
    head = make_head("mixtape", gate_weight_norm=True).eval()
    hidden, target = _inputs()
    weights = torch.rand(30)
    options = {"ignore_index": IGNORE, "label_smoothing": 0.1}
    result = _run(head, hidden, target, weights, chunk_size=chunk_size, **options)
    reference = _run_reference(
        head, hidden, target, weights, reduction="mean", ignore_index=IGNORE, eps=0.1
    )
    _assert_matches_reference(result, reference)
    assert "gate_features.parametrizations.weight.original1" in result[2]  # v is trained


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_chunked_equals_unchunked_with_smoothing_and_ignored_targets(make_head, name):
    head = make_head(name).eval()
    hidden, target = _inputs()
    weights = torch.rand(30)
    options = {"ignore_index": IGNORE, "label_smoothing": 0.2}
    whole = _run(head, hidden, target, weights, chunk_size=None, **options)
    for chunk_size in (1, 7, 29):
        chunked = _run(head, hidden, target, weights, chunk_size=chunk_size, **options)
        torch.testing.assert_close(chunked[0], whole[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(chunked[1], whole[1], atol=1e-6, rtol=1e-5)
        for param_name, grad in whole[2].items():
            torch.testing.assert_close(chunked[2][param_name], grad, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # the gradient-free chunk loop
        options.update(head_inputs(head, hidden))
        for reduction in ("mean", "none"):
            plain = head.loss(hidden, target, reduction=reduction, chunk_size=None, **options)
            looped = head.loss(hidden, target, reduction=reduction, chunk_size=7, **options)
            torch.testing.assert_close(looped, plain)


@pytest.mark.parametrize("name", ["moc", "mos", "mixtape"])
def test_training_mode_chunked_equals_unchunked_with_smoothing(make_head, name):
    # Dropout masks are drawn before chunking, so seeded runs agree on every path.
    head = make_head(name, stochastic=True, **({"gate_noise": 0.0} if name == "mixtape" else {}))
    hidden, target = _inputs()
    weights = torch.rand(30)
    options = {"ignore_index": IGNORE, "label_smoothing": 0.1}
    torch.manual_seed(1)
    whole = _run(head, hidden.view(5, 6, 12), target.view(5, 6), weights, **options)
    torch.manual_seed(1)
    chunked = _run(head, hidden.view(5, 6, 12), target.view(5, 6), weights, chunk_size=4, **options)
    torch.testing.assert_close(chunked[0], whole[0])
    torch.testing.assert_close(chunked[1], whole[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [None, 4, "auto"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.3, 1.0])
def test_softmax_is_f_cross_entropy(make_head, eps, reduction, chunk_size):
    head = make_head("softmax")
    hidden, target = _inputs(ignore_index=3)  # an ignore_index inside the vocabulary
    logits = F.linear(hidden, head.weight, head.bias)
    options = {"reduction": reduction, "ignore_index": 3, "label_smoothing": eps}
    expected = F.cross_entropy(logits, target, **options)
    torch.testing.assert_close(
        head.loss(hidden, target, chunk_size=chunk_size, **options), expected
    )


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("name", HEAD_NAMES)
def test_all_ignored_or_empty_batch_behaves_as_f_cross_entropy(make_head, name, eps):
    head = make_head(name).eval()
    logits = torch.randn(4, 50)
    cases = [(torch.randn(4, 12), torch.full((4,), IGNORE)), (torch.randn(0, 12), target_0())]
    for hidden, target in cases:
        for reduction in ("mean", "sum", "none"):
            options = {"reduction": reduction, "label_smoothing": eps}
            expected = F.cross_entropy(logits[: len(target)], target, **options)
            for chunk_size in (None, 3):
                inputs = head_inputs(head, hidden)
                got = head.loss(hidden, target, chunk_size=chunk_size, **options, **inputs)
                torch.testing.assert_close(got, expected, equal_nan=True)
    hidden = torch.randn(4, 12)
    ignored = torch.full((4,), IGNORE)
    assert head.loss(hidden, ignored, **head_inputs(head, hidden)).isnan()  # documented: nan


def target_0():
    return torch.zeros(0, dtype=torch.long)


def test_mixture_smoothing_survives_probabilities_that_underflow_float32(make_head):
    # Logits spread over hundreds of nats: p(v) of the unlikely words is far below float32's
    # smallest number, but the smoothing term needs log p(v) of every word.
    head = make_head("mos").eval()
    with torch.no_grad():
        head.weight.mul_(300.0)
    hidden, target = _inputs(scale=3.0)
    weights = torch.rand(30)
    for chunk_size in (None, 7):
        result = _run(head, hidden, target, weights, chunk_size=chunk_size, label_smoothing=0.1)
        reference = _run_reference(
            head, hidden, target, weights, reduction="mean", ignore_index=IGNORE, eps=0.1
        )
        assert torch.isfinite(result[0]) and result[0] > 10  # a large, finite loss
        torch.testing.assert_close(result[0].double(), reference[0], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(result[1].double(), reference[1], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"label_smoothing": 1.5}, r"label_smoothing must be a number in \[0, 1\]; got 1.5"),
        ({"label_smoothing": -0.1}, r"label_smoothing must be a number in \[0, 1\]"),
        ({"label_smoothing": "0.1"}, r"label_smoothing must be a number in \[0, 1\]"),
        ({"ignore_index": 1.0}, "ignore_index must be an integer token id; got 1.0"),
        ({"ignore_index": True}, "ignore_index must be an integer token id"),
    ],
)
def test_bad_loss_options_are_one_clear_error(make_head, options, message):
    head = make_head("softmax")
    with pytest.raises(ValueError, match=message):
        head.loss(torch.randn(4, 12), torch.zeros(4, dtype=torch.long), **options)


def test_out_of_range_targets_name_the_ignore_index(make_head):
    head = make_head("mos")
    target = torch.tensor([0, IGNORE, 50, -1])
    with pytest.raises(ValueError, match=r"\[0, 50\) or equal ignore_index=-100; got \[50, -1\]"):
        head.loss(torch.randn(4, 12), target)
    with pytest.raises(ValueError, match=r"got \[-100\]"):  # -100 is an id when not ignored
        head.loss(torch.randn(4, 12), target.clamp(max=49), ignore_index=-1)


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_the_loss_never_reads_a_value_on_the_host(make_head, name):
    # On the meta device tensors have shapes but no values: any host read (int(), .item(),
    # a data-dependent shape) raises. The target check must then run on the device.
    head = make_head(name).to("meta")
    hidden = torch.randn(4, 6, 12, device="meta", requires_grad=True)
    target = torch.randint(0, 50, (4, 6), device="meta")
    for chunk_size in (None, 5):  # whole, and chunked (fused or generic)
        inputs = head_inputs(head, hidden)
        loss = head.loss(hidden, target, chunk_size=chunk_size, label_smoothing=0.1, **inputs)
        loss.backward()
        assert loss.shape == () and hidden.grad.shape == hidden.shape


def test_check_target_ids_validates_outside_the_hot_path(make_head):
    head = make_head("softmax")
    head.check_target_ids(torch.tensor([0, 49, IGNORE]))
    head.check_target_ids(torch.tensor([0, 7]), ignore_index=7)
    with pytest.raises(ValueError, match=r"Softmax: target ids must lie in \[0, 50\).*got \[50\]"):
        head.check_target_ids(torch.tensor([0, 50]))
