"""Every head compiles with ``torch.compile(fullgraph=True)``: no graph break, no host
synchronisation, on the log-probabilities and on the loss (forward and backward), whole-batch
and chunked.

The default tests trace with the ``aot_eager`` backend: Dynamo captures the whole forward
graph (``fullgraph=True`` fails on any graph break) and AOTAutograd traces the backward, but
no kernel is generated, so each head takes seconds. ``test_inductor_matches_eager`` (slow)
also generates code with the default backend, Inductor.
"""

from __future__ import annotations

import pytest
import torch

from highrank.heads import HEADS
from tests.conftest import head_inputs

HEAD_NAMES = list(HEADS)


def _inputs():
    hidden = torch.randn(2, 6, 12)
    target = torch.randint(0, 50, (2, 6))
    target[0, :2] = -100  # ignored
    return hidden, target


def _step(head, hidden, target, inputs):
    """Everything a training or evaluation step asks of a head: log-probabilities, the
    whole-batch loss, the chunked scalar loss (gradients in forward, or checkpointing), with
    ignored targets and label smoothing, and their gradients. ``inputs``: what the head reads
    besides hidden (made outside the graph: ``head_inputs`` draws from its own generator)."""
    log_p = head.log_prob(hidden, **inputs)
    whole = head.loss(hidden, target, label_smoothing=0.1, **inputs)
    chunked = head.loss(hidden, target, chunk_size=5, reduction="sum", **inputs)
    return log_p, whole, chunked


def _run(step, head, hidden, target):
    head.zero_grad()
    hidden = hidden.clone().requires_grad_(True)
    log_p, whole, chunked = step(head, hidden, target, head_inputs(head, hidden))
    (log_p.logsumexp(0).sum() + whole + chunked).backward()
    grads = [hidden.grad] + [p.grad for p in head.parameters()]
    return [log_p.detach(), whole.detach(), chunked.detach()], grads


def _compare(compiled, eager):
    for got, expected in zip(compiled[0] + compiled[1], eager[0] + eager[1], strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_fullgraph_compile_of_log_prob_and_loss(make_head, name):
    torch._dynamo.reset()
    head = make_head(name).eval()
    hidden, target = _inputs()
    step = torch.compile(_step, fullgraph=True, backend="aot_eager")
    _compare(_run(step, head, hidden, target), _run(_step, head, hidden, target))


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_fullgraph_compile_of_log_prob_without_gradients(make_head, name):
    # Without gradients the eager heads take their in-place inference paths; a traced graph
    # must not (their functorch check is opaque to Dynamo) and must give the same values.
    torch._dynamo.reset()
    head = make_head(name).eval()
    hidden, _ = _inputs()
    inputs = head_inputs(head, hidden)
    compiled = torch.compile(head.log_prob, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        expected = head.log_prob(hidden, **inputs)
        torch.testing.assert_close(compiled(hidden, **inputs), expected, atol=1e-5, rtol=1e-5)


def test_fullgraph_compile_in_training_mode(make_head):
    # Dropout masks and gate noise are drawn inside the graph (Mixtape has every kind), and
    # the weight-normalised gate features are recomputed from their parametrisation.
    torch._dynamo.reset()
    head = make_head("mixtape", stochastic=True, gate_weight_norm=True)
    hidden, target = _inputs()
    step = torch.compile(_step, fullgraph=True, backend="aot_eager")
    outputs, grads = _run(step, head, hidden, target)
    assert all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(outputs[0].logsumexp(-1), torch.zeros(2, 6), atol=1e-5, rtol=0)


def test_a_bad_target_id_is_still_reported_under_compile(make_head):
    torch._dynamo.reset()
    head = make_head("softmax")
    loss = torch.compile(head.loss, fullgraph=True, backend="aot_eager")
    hidden, target = _inputs()
    loss(hidden, target)
    target[1, 1] = 50
    with pytest.raises(RuntimeError, match=r"target ids must lie in \[0, 50\)"):
        loss(hidden, target)


@pytest.mark.slow
@pytest.mark.parametrize("name", HEAD_NAMES)
def test_inductor_matches_eager(make_head, name):
    # Generated kernels: 40-250 s per head (10.5 min for the seven; 2.3 min of CPU time) on
    # the shared 2-core machine.
    torch._dynamo.reset()
    head = make_head(name).eval()
    hidden, target = _inputs()
    step = torch.compile(_step, fullgraph=True)
    _compare(_run(step, head, hidden, target), _run(_step, head, hidden, target))
