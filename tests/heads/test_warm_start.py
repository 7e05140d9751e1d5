"""Warm start: every head that can (all but SigSoftmax) starts exactly at a given softmax.

``base_init_knobs`` gives a head the structure it needs (residual contexts for the mixtures,
a learned slope for GSS) and ``start_at_base`` sets it to the softmax over its decoder E and
bias b, with the replaced softmax's projection when d_in != d_embed.
"""

from __future__ import annotations

import pytest
import torch

from highrank.heads import HEADS, base_init_knobs, build_head
from tests.conftest import SMALL_KNOBS, head_inputs

CAN_START = [name for name in HEADS if HEADS[name].BASE_INIT_KNOBS is not None]


def softmax_and_warm(name: str, d_in: int, d_embed: int):
    softmax = build_head("softmax", d_in=d_in, vocab_size=50, d_embed=d_embed)
    torch.nn.init.normal_(softmax.bias)
    knobs = base_init_knobs(name, {**SMALL_KNOBS[name], "d_embed": d_embed})
    head = build_head(name, d_in=d_in, vocab_size=50, **knobs)
    with torch.no_grad():
        head.weight.copy_(softmax.weight)
        head.bias.copy_(softmax.bias)
    head.start_at_base(softmax.projection)
    return softmax, head


@pytest.mark.parametrize("d_embed", [12, 9], ids=["same-width", "projected"])
@pytest.mark.parametrize("name", CAN_START)
def test_a_warm_head_equals_the_softmax_it_replaces(name, d_embed):
    softmax, head = softmax_and_warm(name, d_in=12, d_embed=d_embed)
    hidden = 3.0 * torch.randn(40, 12)
    expected = softmax.log_prob(hidden)
    inputs = head_inputs(head, hidden)  # MFS and CPR: other layers and the context's ids
    got = head.eval().log_prob(hidden, **inputs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # dropout and gate noise act only on the zeroed residual branch: training mode agrees too
    got = head.train().log_prob(hidden, **inputs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["mos", "moc", "mixtape", "mlp_softmax"])
def test_a_projected_head_refuses_to_start_without_the_projection(name):
    knobs = base_init_knobs(name, {**SMALL_KNOBS[name], "d_embed": 9})
    head = build_head(name, d_in=12, vocab_size=50, **knobs)
    with pytest.raises(ValueError, match=r"needs that softmax's projection, got none"):
        head.start_at_base()


def test_sigsoftmax_says_in_one_line_that_it_cannot_start_at_the_base():
    with pytest.raises(ValueError, match=r"^head 'sigsoftmax' cannot start at the base model: "
                       r"f\(z\) = z \+ log sigmoid\(z\) has no knob") as caught:
        base_init_knobs("sigsoftmax", {})
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="SigSoftmax cannot start at the base softmax"):
        build_head("sigsoftmax", d_in=4, vocab_size=9).start_at_base()


def test_contradicting_knobs_and_paper_structure_are_refused():
    with pytest.raises(ValueError, match=r"starts at the base model only with "
                       r"residual_contexts=True; got residual_contexts=False"):
        base_init_knobs("mos", {"residual_contexts": False})
    with pytest.raises(ValueError, match=r"build it with residual_contexts=True"):
        build_head("mixtape", d_in=4, vocab_size=9, gate_dim=2).start_at_base()
    with pytest.raises(ValueError, match=r"fixed slope k=2.5 is not the identity"):
        build_head("gss", d_in=4, vocab_size=9).start_at_base()


def one_adam_step(head, hidden, target, lr=1e-2):
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    head.train()
    head.loss(hidden, target).backward()
    optimizer.step()
    optimizer.zero_grad()
    return head.eval()


def context_spread(head, hidden) -> float:
    """Largest difference between a component's context h_k and the first one's."""
    with torch.no_grad():
        if hasattr(head, "_prior_and_latents"):
            contexts = head._prior_and_latents(hidden, None)[1]
        else:
            contexts = head._contexts(hidden, None)
    return float((contexts - contexts[:, :1]).abs().amax())


@pytest.mark.parametrize("name", ["mos", "moc", "mixtape"])
def test_one_step_moves_the_contexts_apart(name):
    _, head = softmax_and_warm(name, d_in=12, d_embed=12)
    hidden, target = torch.randn(64, 12), torch.randint(0, 50, (64,))
    assert context_spread(head.eval(), hidden) == 0.0  # every h_k is g at the start
    one_adam_step(head, hidden, target)
    assert context_spread(head, hidden) > 1e-3, f"{name}: components equal after one step"


@pytest.mark.parametrize("name", ["mos", "mixtape"])
def test_priors_and_gates_move_from_the_second_step(name):
    """With equal components the posterior is the prior: no gradient reaches the priors and
    gates on the first step (heads/residual.py); once the contexts differ, it does."""
    _, head = softmax_and_warm(name, d_in=12, d_embed=12)
    gates = head.prior if name == "mos" else head.context_gate
    hidden, target = torch.randn(64, 12), torch.randint(0, 50, (64,))
    head.train()
    head.loss(hidden, target).backward()
    assert gates.weight.grad.abs().max() < 1e-6
    head.zero_grad()
    one_adam_step(head, hidden, target).train()
    head.loss(hidden, target).backward()
    assert gates.weight.grad.abs().max() > 1e-5
