"""highrank.train.asgd: NT/ET switch triggers, torch's ASGD averaging, averaged weights, lr."""

from __future__ import annotations

import pytest
import torch

from highrank.heads import build_head
from highrank.train.asgd import (
    FixedEpochTrigger,
    NeverTrigger,
    NonMonotoneByEpochTrigger,
    NonMonotoneTrigger,
    averaged_parameters,
    build_trigger,
    scaled_lr,
    switch_to_asgd,
)

# ---- NT-ASGD ----------------------------------------------------------------------------------


def decisions(trigger, losses) -> list[bool]:
    return [trigger.update(loss) for loss in losses]


def test_nt_switches_exactly_when_worse_than_the_best_older_than_n_epochs():
    # Epochs 1-6 get worse, but the check runs before appending: at epoch 6 the history has
    # only 5 losses (not > n), so the earliest possible switch is epoch 7.
    trigger = NonMonotoneTrigger(n=5)
    assert decisions(trigger, [5.0, 6.0, 7.0, 8.0, 9.0, 10.0]) == [False] * 6
    assert trigger.update(5.1) is True  # epoch 7: 5.1 > min(history[:-5]) = 5.0
    assert trigger.triggered
    assert trigger.history == [5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 5.1]  # switch epoch appended


def test_nt_needs_strictly_worse_and_compares_only_old_losses():
    trigger = NonMonotoneTrigger(n=2)
    # history [4, 3, 2]: min(history[:-2]) = 4; 4.0 is not > 4.0.
    assert decisions(trigger, [4.0, 3.0, 2.0, 4.0]) == [False] * 4
    # history [4, 3, 2, 4]: min(history[:-2]) = 3; 3.5 > 3 although 3.5 < the latest 4.
    assert trigger.update(3.5) is True


def test_nt_never_switches_while_improving():
    trigger = NonMonotoneTrigger(n=5)
    assert not any(decisions(trigger, [10.0 - 0.1 * i for i in range(30)]))
    assert len(trigger.history) == 30


def test_nt_history_stops_growing_after_the_switch():
    trigger = NonMonotoneTrigger(n=1)
    assert decisions(trigger, [1.0, 2.0, 3.0]) == [False, False, True]
    assert decisions(trigger, [9.0, 0.5, 9.0]) == [False, False, False]
    assert trigger.history == [1.0, 2.0, 3.0]


def test_nt_resume_from_state_dict_gives_the_same_decisions():
    losses = [5.0, 4.0, 4.5, 4.2, 4.1, 4.3, 4.05, 4.4, 4.6]
    straight = decisions(NonMonotoneTrigger(3), losses)
    first = NonMonotoneTrigger(3)
    head = decisions(first, losses[:4])
    resumed = NonMonotoneTrigger(3)
    resumed.load_state_dict(first.state_dict())
    assert head + decisions(resumed, losses[4:]) == straight
    assert any(straight)


def test_nt_refuses_bad_input():
    with pytest.raises(ValueError, match="finite"):
        NonMonotoneTrigger().update(float("nan"))
    with pytest.raises(ValueError, match="positive int"):
        NonMonotoneTrigger(0)
    with pytest.raises(ValueError, match="n=3 but this trigger has n=5"):
        NonMonotoneTrigger(5).load_state_dict(NonMonotoneTrigger(3).state_dict())
    with pytest.raises(ValueError, match="expects keys"):
        NonMonotoneTrigger().load_state_dict({"n": 5})


# ---- ET-ASGD and the policy table -------------------------------------------------------------


def test_et_switches_after_the_given_epoch_once():
    trigger = FixedEpochTrigger(3)
    assert decisions(trigger, [9.0, 1.0, 5.0, 5.0, 5.0]) == [False, False, True, False, False]
    assert trigger.triggered and trigger.epochs_seen == 3


def test_et_resume_from_state_dict():
    first = FixedEpochTrigger(4)
    decisions(first, [1.0, 1.0])
    resumed = FixedEpochTrigger(4)
    resumed.load_state_dict(first.state_dict())
    assert decisions(resumed, [1.0, 1.0, 1.0]) == [False, True, False]
    with pytest.raises(ValueError, match="epoch=4 but this trigger has epoch=5"):
        FixedEpochTrigger(5).load_state_dict(first.state_dict())


def test_nt_with_a_latest_epoch_switches_by_it_or_earlier_by_the_rule():
    improving = [5.0 - 0.1 * i for i in range(8)]  # the rule alone never fires
    assert decisions(NonMonotoneTrigger(3), improving) == [False] * 8
    assert decisions(NonMonotoneByEpochTrigger(3, latest=4), improving) == [
        False, False, False, True, False, False, False, False]  # after epoch 4, once
    # the rule firing first decides as NT-ASGD does (epoch 6 here), not the latest epoch (7)
    stalled = [5.0, 4.0, 4.5, 4.6, 4.7, 4.8, 4.9]
    assert decisions(NonMonotoneByEpochTrigger(3, latest=7), stalled) == [False] * 5 + [
        True, False]
    # resumable, and a state of another latest epoch is refused
    first = NonMonotoneByEpochTrigger(3, latest=5)
    decisions(first, improving[:3])
    resumed = NonMonotoneByEpochTrigger(3, latest=5)
    resumed.load_state_dict(first.state_dict())
    assert decisions(resumed, improving[3:]) == [False, True, False, False, False]
    with pytest.raises(ValueError, match="latest=5 but this trigger has latest=6"):
        NonMonotoneByEpochTrigger(3, latest=6).load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="positive int"):
        NonMonotoneByEpochTrigger(3, latest=0)


def test_build_trigger_for_each_policy():
    assert isinstance(build_trigger("nt-asgd", nonmono=3), NonMonotoneTrigger)
    assert build_trigger("nt-asgd", nonmono=3).n == 3
    assert build_trigger("et-asgd", switch_epoch=7).epoch == 7
    bounded = build_trigger("nt-asgd", nonmono=3, latest_switch=12)
    assert isinstance(bounded, NonMonotoneByEpochTrigger) and bounded.latest == 12
    never = build_trigger("sgd")
    assert isinstance(never, NeverTrigger) and not any(decisions(never, [3.0, 2.0, 9.0] * 5))
    with pytest.raises(ValueError, match="unknown optimizer policy 'adam'"):
        build_trigger("adam")


# ---- torch's ASGD with t0=0, lambd=0 ----------------------------------------------------------


def quadratic_step(optimizer, x: torch.Tensor) -> None:
    optimizer.zero_grad()
    (0.5 * (x * torch.tensor([1.0, 3.0], dtype=x.dtype) * x).sum()).backward()
    optimizer.step()


@pytest.mark.parametrize("foreach", [False, True])
def test_asgd_ax_is_the_mean_of_the_iterates_after_the_first(foreach):
    """torch 2.13: ASGD(t0=0, lambd=0) steps like SGD and ax_k = mean(x_2..x_k)."""
    lr, wd = 0.1, 0.01
    x = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    optimizer = torch.optim.ASGD([x], lr=lr, t0=0, lambd=0.0, weight_decay=wd, foreach=foreach)
    eta = torch.tensor(lr, dtype=torch.float32).item()  # eta is a float32 scalar
    iterates = []
    for k in range(1, 7):
        before = x.detach().clone()
        quadratic_step(optimizer, x)
        sgd = before - eta * (before * torch.tensor([1.0, 3.0], dtype=x.dtype) + wd * before)
        torch.testing.assert_close(x.detach(), sgd, rtol=1e-12, atol=0)
        iterates.append(x.detach().clone())
        ax = optimizer.state[x]["ax"]
        expected = iterates[0] if k == 1 else torch.stack(iterates[1:]).mean(0)
        torch.testing.assert_close(ax, expected, rtol=1e-6, atol=0)  # mu = 1/k in float32
    assert not torch.allclose(ax, torch.stack(iterates).mean(0), rtol=1e-3)


# ---- averaged_parameters ----------------------------------------------------------------------


def asgd_model(steps: int = 3):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = switch_to_asgd(torch.optim.SGD(model.parameters(), lr=0.5))
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 3)).pow(2).sum().backward()
        optimizer.step()
    return model, optimizer


def test_averaged_parameters_swaps_in_ax_and_restores_exactly():
    model, optimizer = asgd_model()
    raw = {name: p.detach().clone() for name, p in model.named_parameters()}
    weight = model.weight
    with averaged_parameters(optimizer):
        assert torch.is_grad_enabled()
        for p in model.parameters():
            assert torch.equal(p, optimizer.state[p]["ax"])
        assert not torch.equal(model.weight, raw["weight"])
    assert model.weight is weight
    for name, p in model.named_parameters():
        assert torch.equal(p, raw[name])


def test_averaged_parameters_restores_on_exception():
    model, optimizer = asgd_model()
    raw = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="boom"), averaged_parameters(optimizer):
        raise RuntimeError("boom")
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), raw, strict=True))


def test_averaged_parameters_is_a_no_op_without_averages():
    model = torch.nn.Linear(3, 2)
    raw = [p.detach().clone() for p in model.parameters()]
    for optimizer in (torch.optim.SGD(model.parameters(), lr=1.0), asgd_model(steps=0)[1]):
        with averaged_parameters(optimizer):
            pass
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), raw, strict=True))


# ---- switch_to_asgd -----------------------------------------------------------------------------


def test_switch_keeps_groups_lrs_weight_decay_and_extra_keys():
    head = build_head("plif", d_in=4, vocab_size=6, n_pieces=10)
    groups = head.parameter_groups(lr=30.0)
    groups[0]["name"] = "head"
    sgd = torch.optim.SGD(groups, lr=30.0, weight_decay=1.2e-6)
    sgd.param_groups[0]["lr"] = 3.0  # e.g. after a decay: the current lr is kept
    asgd = switch_to_asgd(sgd)
    assert isinstance(asgd, torch.optim.ASGD)
    assert [g["lr"] for g in asgd.param_groups] == [3.0, 0.02]
    assert [g["weight_decay"] for g in asgd.param_groups] == [1.2e-6, 1.2e-6]
    assert all(g["t0"] == 0 and g["lambd"] == 0 for g in asgd.param_groups)
    assert asgd.param_groups[0]["name"] == "head"
    for old, new in zip(sgd.param_groups, asgd.param_groups, strict=True):
        assert all(a is b for a, b in zip(old["params"], new["params"], strict=True))
        assert "momentum" not in new


def test_switch_refuses_momentum():
    sgd = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0, momentum=0.9)
    with pytest.raises(ValueError, match="group 0 uses momentum=0.9"):
        switch_to_asgd(sgd)


# ---- scaled_lr --------------------------------------------------------------------------------


def test_scaled_lr_scales_every_group_and_restores_exactly():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(
        [{"params": [model.weight], "lr": 0.3}, {"params": [model.bias], "lr": 0.02}], lr=0.3
    )
    with scaled_lr(optimizer, 71 / 70):
        assert [g["lr"] for g in optimizer.param_groups] == [0.3 * 71 / 70, 0.02 * 71 / 70]
    assert [g["lr"] for g in optimizer.param_groups] == [0.3, 0.02]
    with pytest.raises(KeyError), scaled_lr(optimizer, 0.5):
        raise KeyError("x")
    assert [g["lr"] for g in optimizer.param_groups] == [0.3, 0.02]
    with pytest.raises(ValueError, match="positive"):
        with scaled_lr(optimizer, 0.0):
            pass


def test_scaled_lr_applies_to_this_asgd_step_not_the_next():
    x = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    optimizer = switch_to_asgd(torch.optim.SGD([x], lr=0.5))
    quadratic_step(optimizer, x)  # state exists; eta = 0.5
    eta_before = optimizer.state[x]["eta"].clone()
    with scaled_lr(optimizer, 0.25):
        pass
    assert torch.equal(optimizer.state[x]["eta"], eta_before)  # no step: eta exactly back
    for scale in (0.25, 1.0):  # a scaled step, then an unscaled one
        before = x.detach().clone()
        if scale != 1.0:
            with scaled_lr(optimizer, scale):
                quadratic_step(optimizer, x)
        else:
            quadratic_step(optimizer, x)
        grad = before * torch.tensor([1.0, 3.0], dtype=x.dtype)
        torch.testing.assert_close(x.detach(), before - 0.5 * scale * grad, rtol=1e-12, atol=0)
    assert optimizer.param_groups[0]["lr"] == 0.5
