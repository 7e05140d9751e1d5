"""A head's own dropout and noise follow the switches the ecosystem uses (issue 32 item 4):
``model.eval()``, and ``p = 0`` on every ``nn.Dropout`` module, which is how TRL's trainers
disable dropout (``trl.trainer.utils.disable_dropout_in_model``, reimplemented here so that
these tests need no trl). The rates live in ``nn.Dropout`` modules (``heads/dropout.py``) that
hold no tensors: state dicts are those of before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from highrank.heads import HEADS, head_knobs
from highrank.heads.functional import locked_dropout_mask
from tests.conftest import STOCHASTIC_KNOBS


def disable_dropout_in_model(model: nn.Module) -> None:
    """TRL 1.16's ``disable_dropout_in_model``, verbatim."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0


def extra_inputs(head, hidden: torch.Tensor) -> dict:
    """What a head reads besides ``hidden`` (``head.reads``; none for most heads)."""
    if tuple(getattr(head, "reads", ("hidden",))) == ("hidden",):
        return {}
    from tests.conftest import head_inputs

    return head_inputs(head, hidden)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_p_zero_on_every_nn_dropout_makes_training_mode_deterministic(make_head, name):
    """With TRL's switch, training mode scores as eval mode does: log-probs and the loss
    (its fused, chunked training path included) of a head built with every source of
    randomness on. A rate kept as a float escaped it (MoS's latent dropout in DPO)."""
    locked = {"dropout_time_dim": 1} if "dropout_time_dim" in head_knobs(name) else {}
    head = make_head(name, stochastic=True, **locked).double()
    hidden = torch.randn(3, 5, 12, dtype=torch.float64)
    target = torch.randint(0, 50, (3, 5))
    inputs = extra_inputs(head, hidden)
    with torch.no_grad():
        expected_log_p = head.eval().log_prob(hidden, **inputs)
        expected_loss = head.loss(hidden, target, chunk_size=4, **inputs)
    disable_dropout_in_model(head.train())
    with torch.no_grad():
        torch.testing.assert_close(head.log_prob(hidden, **inputs), expected_log_p)
    for chunk_size in (4, None):
        loss = head.loss(hidden, target, chunk_size=chunk_size, **inputs)
        torch.testing.assert_close(loss, expected_loss)


@pytest.mark.parametrize("name", sorted(STOCHASTIC_KNOBS))
def test_stochastic_heads_are_random_in_training_until_switched_off(make_head, name):
    """The test above is not vacuous: the same heads draw masks or noise in training mode."""
    head = make_head(name, stochastic=True, dropout_time_dim=1).train()
    hidden = torch.randn(3, 5, 12)
    with torch.no_grad():
        assert not torch.equal(head.log_prob(hidden), head.log_prob(hidden))
        modules = [m for m in head.modules() if isinstance(m, nn.Dropout)]
        assert modules and all(m.p > 0 for m in modules)
        for module in modules:  # a submodule's own eval() switches it off too
            module.eval()
        assert torch.equal(head.log_prob(hidden), head.log_prob(hidden))


KNOB_MODULES = {
    "moc": {"latent_dropout": "latent_dropout_layer"},
    "mos": {"latent_dropout": "latent_dropout_layer"},
    "mlp_softmax": {"latent_dropout": "latent_dropout_layer"},
    "mixtape": {
        "gate_dropout": "gate_dropout_layer",
        "component_dropout": "component_dropout_layer",
        "gate_noise": "gate_noise_layer",
    },
}


@pytest.mark.parametrize("name", sorted(KNOB_MODULES))
def test_the_knobs_read_and_set_their_modules_p(make_head, name):
    head = make_head(name, stochastic=True)
    for knob, module_name in KNOB_MODULES[name].items():
        module = getattr(head, module_name)
        assert isinstance(module, nn.Dropout)
        assert getattr(head, knob) == module.p == STOCHASTIC_KNOBS[name][knob]
        setattr(head, knob, 0.25)
        assert module.p == 0.25 and getattr(head, knob) == 0.25
        with pytest.raises(ValueError, match=knob):
            setattr(head, knob, -1.0)
        assert f"{knob}=0.25" in repr(head)


def test_gate_noise_is_a_deviation_not_a_probability(make_head):
    head = make_head("mixtape", gate_noise=1.5)
    assert head.gate_noise == head.gate_noise_layer.p == 1.5
    assert "std=1.5" in repr(head.gate_noise_layer)
    with pytest.raises(TypeError, match="the head draws the noise"):
        head.gate_noise_layer(torch.zeros(2))


@pytest.mark.parametrize("name", sorted(STOCHASTIC_KNOBS))
def test_state_dicts_hold_no_dropout_entries_and_load_across_rates(make_head, name):
    """The modules hold no tensor: a state dict saved before they existed loads strictly."""
    head = make_head(name, stochastic=True)
    state = head.state_dict()
    assert not [key for key in state if "dropout" in key or "noise" in key]
    plain = make_head(name)  # every rate 0
    plain.load_state_dict(state, strict=True)
    assert state.keys() == plain.state_dict().keys()


def test_mos_masks_are_the_locked_draws_of_before(make_head):
    """The masks come from the same random draws as before: one ``locked_dropout_mask`` per
    call, locked over the time axis."""
    head = make_head("mos", stochastic=True, dropout_time_dim=1).train()
    hidden = torch.randn(2, 4, 12)
    torch.manual_seed(7)
    (mask,) = head._draw_masks(hidden)
    torch.manual_seed(7)
    width = head.n_components * head.d_embed
    expected = locked_dropout_mask((2, 4), width, 0.3, hidden.device, time_dim=1)
    assert torch.equal(mask, expected)
