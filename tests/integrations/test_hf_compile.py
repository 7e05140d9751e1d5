"""``torch.compile(model, fullgraph=True)`` captures the forward with labels whole (issue 32
item 4): the loss once read ``bool(valid.any())`` on the host, a graph break. Dynamo's
"eager" backend traces as any backend does (a graph break is an error under fullgraph) and
skips Inductor's code generation, minutes on a CPU; "aot_eager" adds AOT autograd, the
backward graph of a compiled training step."""

from __future__ import annotations

import math

import pytest
import torch

from .conftest import VOCAB

hf = pytest.importorskip("highrank.integrations.hf", reason="the hf extra is not installed")

HEADS = ["softmax", "moc", "mos", "mixtape", "sigsoftmax", "gss", "plif", "mlp_softmax"]


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("head", HEADS)
def test_the_forward_with_labels_compiles_without_a_graph_break(attached, token_batch, head):
    model = attached("gpt2", head)  # eval mode: the same values as eager
    ids, labels = token_batch  # ignored labels inside and at the end of sequences
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    loss = compiled(ids, labels=labels).loss
    loss.backward()
    compiled_grads = grads(model)
    model.zero_grad()
    expected = model(ids, labels=labels).loss
    expected.backward()
    torch.testing.assert_close(loss, expected)
    assert compiled_grads.keys() == grads(model).keys()
    for name, grad in grads(model).items():
        torch.testing.assert_close(compiled_grads[name], grad, msg=name)


def test_all_ignored_labels_keep_their_meaning_under_compile(attached, token_batch):
    """As in eager mode (and transformers' own loss): a mean over no token is nan; with
    ``num_items_in_batch`` (Trainer under accumulation) the sum over none is 0, with a graph."""
    model = attached("llama", "mos")
    ids, _ = token_batch
    ignored = torch.full_like(ids, -100)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    assert math.isnan(compiled(ids, labels=ignored).loss.item())
    assert math.isnan(model(ids, labels=ignored).loss.item())
    loss = compiled(ids, labels=ignored, num_items_in_batch=5).loss
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert all(float(g.abs().max()) == 0.0 for g in grads(model).values())


def test_a_compiled_training_step_with_dropout(attached, token_batch):
    """Training mode, the head's locked dropout on, through AOT autograd: the loss and
    gradients of one step are finite and reach the head."""
    model = attached("llama", "mos", stochastic=True).train()
    ids, labels = token_batch
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = compiled(ids, labels=labels).loss
    loss.backward()
    assert math.isfinite(loss.item()) and 0 < loss.item() < 2 * math.log(VOCAB)
    head_grads = {n: g for n, g in grads(model).items() if n.startswith("head.")}
    assert head_grads and all(torch.isfinite(g).all() for g in head_grads.values())
    assert float(head_grads["head.latent.weight"].abs().max()) > 0
