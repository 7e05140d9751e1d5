"""The Transformer schedule's pieces: AdamW parameter groups and a warm-up learning-rate curve.

AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019) with weight
decay on the weight matrices only: biases, LayerNorm gains and other vectors are not decayed
(as nanoGPT and the GPT-2/BERT recipes do). Embedding matrices are matrices and are decayed.

The learning rate of update ``t = 1, 2, ..`` is ``lr * lr_factor(t, ...)``::

    warm-up     t <= w:  t / w                                  (linear from 0)
    inverse-sqrt t > w:  sqrt(w / t)                            (Vaswani et al. 2017, eq. 3,
                                                                 peak lr = d^-0.5 w^-0.5 there)
    cosine       t > w:  (1 + cos(pi * (t - w) / (T - w))) / 2  (Loshchilov & Hutter 2017,
                                                                 to 0 at t = T, then 0)

With ``w = 0`` there is no warm-up and inverse-sqrt is ``t^-1/2``.

The retrofit's curve, :func:`lr_factor_from_zero`, counts updates from 0 and is the same shape
a step later: linear warm-up, then a cosine over the ``T - w`` updates after it, ending above 0.
It is kept as it is, not folded into ``lr_factor``: every recorded retrofit and the warm-start
study trained on it, and an interrupted retrofit resumes bit for bit only on the same floats
(the shifted ``lr_factor`` differs in the last bit in about one update in five).
"""

from __future__ import annotations

import math

import torch
from torch import nn

SCHEDULES = ("inverse-sqrt", "cosine")


def adamw_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: parameters with two or more dimensions decayed, the rest not; each
    shared Parameter (a tied embedding) once.

    The seq2seq recipe's policy: embeddings are decayed. The Transformer LM recipe
    (:func:`highrank.train.transformer.adamw_groups`) decays only ``nn.Linear`` weights, as
    nanoGPT does. The two are kept apart deliberately for now: the optimizer's groups are part
    of a checkpoint, and the recorded Multi30k runs must stay resumable."""
    decay, no_decay = [], []
    for param in model.parameters():  # parameters() yields a shared tensor once
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_adamw(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float
) -> torch.optim.AdamW:
    """AdamW over :func:`adamw_param_groups`."""
    groups = adamw_param_groups(model, weight_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def lr_factor(step: int, *, warmup_steps: int, schedule: str, total_steps: int | None) -> float:
    """The multiplier of the peak lr at update ``step`` (1-based); see the module docstring.
    ``total_steps`` (the last update) is needed by ``"cosine"`` only."""
    if step < 1:
        raise ValueError(f"step must be >= 1 (updates are counted from 1); got {step}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not known; expected one of {SCHEDULES}")
    if warmup_steps and step <= warmup_steps:
        return step / warmup_steps
    if schedule == "inverse-sqrt":
        return math.sqrt(max(warmup_steps, 1) / step)
    if total_steps is None or total_steps <= warmup_steps:
        raise ValueError(
            f"the cosine schedule needs total_steps > warmup_steps = {warmup_steps}; "
            f"got {total_steps}"
        )
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_factor_from_zero(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """The retrofit's multiplier of the peak lr at update ``step`` (0-based, ``< total_steps``):
    ``(step + 1) / w`` during the warm-up, then ``(1 + cos(pi (step - w) / (T - w))) / 2``.

    Against :func:`lr_factor`: the peak is held for two updates (``step = w - 1`` and ``w``),
    the last update's factor is above 0, and the cosine's argument is evaluated as
    ``pi * a / b`` (not ``pi * (a / b)``); see the module docstring for why both exist."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup_steps) / decay_steps))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's lr to ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


__all__ = [
    "SCHEDULES",
    "adamw_param_groups",
    "build_adamw",
    "lr_factor",
    "lr_factor_from_zero",
    "set_lr",
]
