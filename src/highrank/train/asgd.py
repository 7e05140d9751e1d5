"""SGD -> averaged SGD: the switch policies of AWD-LSTM training, kept apart from the loop.

Merity, Keskar and Socher, "Regularizing and Optimizing LSTM Language Models" (ICLR 2018), train
with plain SGD and switch once to averaged SGD (Polyak and Juditsky, 1992), evaluating and saving
the *averaged* parameters from then on. Three policies decide when (``train.optimizer``):

* ``"nt-asgd"``: :class:`NonMonotoneTrigger`, the paper's non-monotone trigger (n = 5).
* ``"et-asgd"``: :class:`FixedEpochTrigger`, a fixed epoch (200 in the rank study, which found
  it better than the non-monotone trigger).
* ``"sgd"``: :class:`NeverTrigger`, SGD throughout.

A trigger is asked once per epoch, after validation: ``trigger.update(val_loss)`` returns True on
the one call that decides the switch, and the loop then calls :func:`switch_to_asgd`. Triggers
keep their whole state in :meth:`state_dict`, so a resumed run switches at the same epoch.

Averaging uses ``torch.optim.ASGD(params, lr, t0=0, lambd=0, weight_decay=wd)`` as the reference
code does. What it does on torch 2.13 (checked by ``tests/train/test_optim.py``):

* The step is plain SGD, ``p -= eta * (grad + wd * p)``; ``eta`` is per-parameter state, set to
  the group's ``lr`` at the *end* of each step (with ``lambd=0``), so a change to
  ``group["lr"]`` reaches the parameters one step late. :func:`scaled_lr` corrects this.
* ``state["ax"]`` after k >= 2 steps is the mean of the iterates x_2..x_k: the first iterate
  after the switch is not in the average (``mu`` is 1 for both of the first two steps).
* ``eta`` and ``mu`` are float32 scalars even for float64 parameters.

:func:`averaged_parameters` swaps ``ax`` into the parameters for evaluation and saving.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from highrank.config import SWITCH_POLICIES  # the schema's values of train.optimizer

# Group keys of torch.optim.SGD that ASGD does not have; every other key is carried over.
_SGD_ONLY_KEYS = ("momentum", "dampening", "nesterov", "fused")


class SwitchTrigger(Protocol):
    """Decides, once per epoch after validation, whether to switch SGD -> averaged SGD."""

    @property
    def triggered(self) -> bool: ...

    def update(self, val_loss: float) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# ---- triggers -------------------------------------------------------------------------------


class NonMonotoneTrigger:
    """NT-ASGD (Merity et al., 2018, Algorithm 1): switch when validation stops improving.

    ``history`` holds the validation losses seen so far, appended only until the switch. The
    switch fires when ``len(history) > n`` and ``val_loss > min(history[:-n])``, i.e. the new
    loss is worse than the best loss from more than ``n`` epochs ago.

    Order, as in salesforce/awd-lstm-lm ``main.py``: the check runs *before* the current loss is
    appended, then the loss is appended (also on the epoch that switches)::

        if 't0' not in optimizer.param_groups[0] and (len(best_val_loss) > args.nonmono
                and val_loss > min(best_val_loss[:-args.nonmono])):
            optimizer = torch.optim.ASGD(...)   # switch
        best_val_loss.append(val_loss)          # (only in the not-yet-averaged branch)

    So with n = 5 the earliest switch is at the 7th call. The same rule stops finetuning (the
    MoS ``finetune.py``): there the trigger firing means "stop".
    """

    def __init__(self, n: int = 5) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"NonMonotoneTrigger n must be a positive int; got {n!r}")
        self.n = n
        self.history: list[float] = []
        self._triggered = False

    @property
    def triggered(self) -> bool:
        """True once the switch has been decided."""
        return self._triggered

    def update(self, val_loss: float) -> bool:
        """Record one epoch's validation loss; True on the call that decides the switch."""
        val_loss = _check_loss(val_loss)
        if self._triggered:
            return False
        history = self.history
        fire = len(history) > self.n and val_loss > min(history[: -self.n])
        history.append(val_loss)
        self._triggered = fire
        return fire

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "history": list(self.history), "triggered": self._triggered}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state_keys(self, state, ("n", "history", "triggered"))
        if state["n"] != self.n:
            raise ValueError(
                f"NonMonotoneTrigger state has n={state['n']!r} but this trigger has "
                f"n={self.n}; build the trigger with the run's train.nonmono"
            )
        self.history = [float(v) for v in state["history"]]
        self._triggered = bool(state["triggered"])

    def __repr__(self) -> str:
        epochs, triggered = len(self.history), self._triggered
        return f"NonMonotoneTrigger(n={self.n}, epochs={epochs}, triggered={triggered})"


class NonMonotoneByEpochTrigger(NonMonotoneTrigger):
    """NT-ASGD's trigger with a latest epoch: switch when the non-monotone rule fires, or
    after validating epoch ``latest`` (1-based, as :class:`FixedEpochTrigger`) if it has not
    fired by then. For a run bounded in epochs (``train.epochs``): averaging then has the
    epochs after ``latest`` at least, where the rule alone may fire in the last one or never
    (``train.latest_switch_epoch``)."""

    def __init__(self, n: int = 5, latest: int = 200) -> None:
        super().__init__(n)
        if isinstance(latest, bool) or not isinstance(latest, int) or latest < 1:
            raise ValueError(f"the latest switch epoch must be a positive int; got {latest!r}")
        self.latest = latest

    def update(self, val_loss: float) -> bool:
        """Record one epoch's validation loss; True on the call that decides the switch."""
        if self._triggered:
            return False
        fire = super().update(val_loss)  # the history grows by one epoch
        if not fire and len(self.history) >= self.latest:
            self._triggered = fire = True
        return fire

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "latest": self.latest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state_keys(self, state, ("n", "history", "triggered", "latest"))
        if state["latest"] != self.latest:
            raise ValueError(
                f"NonMonotoneByEpochTrigger state has latest={state['latest']!r} but this "
                f"trigger has latest={self.latest}; build it with the run's "
                "train.latest_switch_epoch"
            )
        super().load_state_dict({k: v for k, v in state.items() if k != "latest"})

    def __repr__(self) -> str:
        return (f"NonMonotoneByEpochTrigger(n={self.n}, latest={self.latest}, "
                f"epochs={len(self.history)}, triggered={self._triggered})")


class FixedEpochTrigger:
    """ET-ASGD: switch after a fixed epoch (the rank study's choice: 200).

    ``update`` is called once per epoch; it returns True on the ``epoch``-th call, i.e. after
    validating epoch ``epoch`` (1-based), so averaging starts with epoch ``epoch + 1``, the same
    decision point as :class:`NonMonotoneTrigger`.
    """

    def __init__(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 1:
            raise ValueError(f"FixedEpochTrigger epoch must be a positive int; got {epoch!r}")
        self.epoch = epoch
        self.epochs_seen = 0
        self._triggered = False

    @property
    def triggered(self) -> bool:
        return self._triggered

    def update(self, val_loss: float | None = None) -> bool:
        """Count one finished epoch (``val_loss`` is accepted for a uniform interface)."""
        if val_loss is not None:
            _check_loss(val_loss)
        if self._triggered:
            return False
        self.epochs_seen += 1
        self._triggered = self.epochs_seen >= self.epoch
        return self._triggered

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "epochs_seen": self.epochs_seen, "triggered": self._triggered}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state_keys(self, state, ("epoch", "epochs_seen", "triggered"))
        if state["epoch"] != self.epoch:
            raise ValueError(
                f"FixedEpochTrigger state has epoch={state['epoch']!r} but this trigger has "
                f"epoch={self.epoch}; build the trigger with the run's train.switch_epoch"
            )
        self.epochs_seen = int(state["epochs_seen"])
        self._triggered = bool(state["triggered"])

    def __repr__(self) -> str:
        return f"FixedEpochTrigger(epoch={self.epoch}, epochs_seen={self.epochs_seen})"


class NeverTrigger:
    """Plain SGD throughout (policy ``"sgd"``)."""

    triggered = False

    def update(self, val_loss: float | None = None) -> bool:
        if val_loss is not None:
            _check_loss(val_loss)
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state_keys(self, state, ())

    def __repr__(self) -> str:
        return "NeverTrigger()"


def build_trigger(
    policy: str, *, nonmono: int = 5, switch_epoch: int = 200, latest_switch: int | None = None
) -> SwitchTrigger:
    """The trigger of ``policy`` (one of :data:`SWITCH_POLICIES`, config ``train.optimizer``);
    ``latest_switch`` bounds NT-ASGD's switch (:class:`NonMonotoneByEpochTrigger`)."""
    if policy == "nt-asgd":
        if latest_switch is not None:
            return NonMonotoneByEpochTrigger(nonmono, latest_switch)
        return NonMonotoneTrigger(nonmono)
    if policy == "et-asgd":
        return FixedEpochTrigger(switch_epoch)
    if policy == "sgd":
        return NeverTrigger()
    raise ValueError(f"unknown optimizer policy {policy!r}; choose one of: {SWITCH_POLICIES}")


def _check_loss(val_loss: float) -> float:
    if isinstance(val_loss, bool) or not isinstance(val_loss, int | float):
        raise TypeError(f"val_loss must be a float; got {val_loss!r} ({type(val_loss).__name__})")
    if not math.isfinite(val_loss):
        raise ValueError(f"val_loss must be finite to compare epochs; got {val_loss!r}")
    return float(val_loss)


def _check_state_keys(owner: object, state: dict[str, Any], expected: tuple[str, ...]) -> None:
    if set(state) != set(expected):
        raise ValueError(
            f"{type(owner).__name__}.load_state_dict expects keys {sorted(expected)}; "
            f"got {sorted(state)}"
        )


# ---- averaged SGD -----------------------------------------------------------------------------


def switch_to_asgd(
    optimizer: torch.optim.Optimizer, *, t0: float = 0.0, lambd: float = 0.0
) -> torch.optim.ASGD:
    """An ASGD optimizer over the same parameter groups, with each group's current lr and
    weight decay (and any extra keys, e.g. PLIF's slope group with its own lr).

    ``t0=0, lambd=0`` (the reference's choice): averaging from the first step, constant lr.
    Unlike the reference, which restarts from ``args.lr``, the groups' *current* lrs are kept.
    Momentum has no ASGD counterpart, so a group with momentum is an error.
    """
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        if group.get("momentum", 0) or group.get("nesterov", False):
            raise ValueError(
                f"switch_to_asgd: param group {index} uses momentum={group.get('momentum')!r}; "
                "ASGD has no momentum, train the SGD phase with momentum=0"
            )
        new_group = {k: v for k, v in group.items() if k not in _SGD_ONLY_KEYS}
        new_group["params"] = list(group["params"])
        new_group.update(t0=t0, lambd=lambd)
        groups.append(new_group)
    return torch.optim.ASGD(groups)


def _averaged_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        p
        for group in optimizer.param_groups
        for p in group["params"]
        if "ax" in optimizer.state.get(p, {})
    ]


@contextmanager
def averaged_parameters(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Swap ASGD's averages ``state["ax"]`` into the parameters; restore the raw ones on exit.

    Use it to evaluate or save the averaged model (Merity et al., 2018: after the switch,
    validation and checkpoints use the averaged weights). The restore is an exact copy and also
    happens when the body raises. Parameters without an average (any optimizer other than
    ASGD, or a parameter that has not received a gradient yet) keep their raw values, so this is
    a no-op before the switch. Tensors are copied in place: parameter identity and views (tied
    weights) are kept. Save inside the block: a ``state_dict()`` taken inside but written
    after the block aliases the restored raw weights.
    """
    params = _averaged_params(optimizer)
    raw = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p in params:
                p.copy_(optimizer.state[p]["ax"])
        yield
    finally:
        with torch.no_grad():
            for p, value in zip(params, raw, strict=True):
                p.copy_(value)


# ---- variable-BPTT learning rate ------------------------------------------------------------


@contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[None]:
    """Multiply every group's lr by ``scale`` inside the block; restore the exact values after.

    AWD-LSTM's variable BPTT scales the lr of a step by ``seq_len / bptt`` (Merity et al.,
    2018, section 4.1). For ASGD the step reads the per-parameter ``state["eta"]``, which torch
    only refreshes from ``group["lr"]`` *after* a step, so setting the group lr alone (as the
    reference does) scales the *next* step instead. Here ``eta`` is set as well, so the scale
    hits this step, and on exit ``eta`` is what torch would hold had the lr not been scaled.
    """
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
        raise ValueError(f"scaled_lr scale must be a positive number; got {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scaled_lr scale must be finite; got {scale!r}")
    saved_lrs = [group["lr"] for group in optimizer.param_groups]
    saved_etas = _save_etas(optimizer)
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale
    _refresh_etas(optimizer)
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs, strict=True):
            group["lr"] = lr
        _restore_etas(optimizer, saved_etas)


def _asgd_states(optimizer: torch.optim.Optimizer) -> Iterator[tuple[dict, torch.Tensor, dict]]:
    """(group, parameter, state) for every parameter with ASGD state."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if "eta" in state and "step" in state:
                yield group, p, state


def _save_etas(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, tuple[torch.Tensor, float]]:
    return {
        p: (state["eta"].clone(), float(state["step"])) for _, p, state in _asgd_states(optimizer)
    }


def _asgd_eta(group: dict, step: float) -> float:
    """torch's ASGD step size after ``step`` steps: lr / (1 + lambd * lr * step) ** alpha."""
    lr = float(group["lr"])
    return lr / ((1 + group["lambd"] * lr * step) ** group["alpha"])


def _refresh_etas(optimizer: torch.optim.Optimizer) -> None:
    for group, _, state in _asgd_states(optimizer):
        state["eta"].fill_(_asgd_eta(group, float(state["step"])))


def _restore_etas(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Back to the unscaled eta: the saved tensor if no step was taken, else recomputed."""
    for group, p, state in _asgd_states(optimizer):
        old = saved.get(p)
        if old is not None and old[1] == float(state["step"]):
            state["eta"].copy_(old[0])
        else:
            state["eta"].fill_(_asgd_eta(group, float(state["step"])))


__all__ = [
    "SWITCH_POLICIES",
    "FixedEpochTrigger",
    "NeverTrigger",
    "NonMonotoneTrigger",
    "SwitchTrigger",
    "averaged_parameters",
    "build_trigger",
    "scaled_lr",
    "switch_to_asgd",
]
