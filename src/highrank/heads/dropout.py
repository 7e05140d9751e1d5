"""A head's training-time randomness as ``nn.Dropout`` modules, so that the switches the
ecosystem uses reach it.

A head draws its dropout masks itself, per row and locked over time
(``functional.locked_dropout_mask``, called by ``OutputHead._dropout_mask``), and Mixtape adds
Gaussian noise to its pre-activation priors. What turns these off must be what turns off the
body's dropout: ``model.eval()`` (every module's ``training``), and ``p = 0`` on every
``nn.Dropout`` module, which is how TRL's trainers disable dropout (``disable_dropout_in_model``,
the default of DPO and KTO, an option of GRPO, RLOO and the reward trainer: the policy and its
reference model must score the same text alike). A rate kept as a plain float escaped the
second switch: DPO then scored the policy with a MoS head's latent dropout and the reference
without it, and its first loss was not log 2. So each rate lives in one of these modules (no
parameters, no buffers: state dicts are unchanged), and the head reads ``p`` and ``training``
from it at every draw; the head's knob (``latent_dropout``, ``gate_noise``, ...) reads and sets
that ``p``.
"""

from __future__ import annotations

from torch import nn


class HeadDropout(nn.Dropout):
    """The rate ``p`` and the on/off switch of one of a head's dropouts. The head draws the
    masks (locked over its ``dropout_time_dim``) from ``p`` while both it and this module are in
    training mode; it never calls this module on a tensor (called, it is plain dropout)."""


class GaussianNoise(nn.Dropout):
    """Additive Gaussian noise of standard deviation ``p`` (Mixtape's ``gate_noise``), an
    ``nn.Dropout`` so that the switches that turn dropout off turn this noise off too
    (``model.eval()``; ``p = 0``, as TRL sets it). ``p`` is a standard deviation here, any
    finite number >= 0, not a probability; the head draws the noise, never calling this module."""

    def __init__(self, std: float) -> None:
        super().__init__(0.0)  # nn.Dropout checks p as a probability; a deviation may exceed 1
        self.p = float(std)

    def std(self) -> float:
        """The standard deviation in force: ``p`` in training mode, 0 in eval mode."""
        return float(self.p) if self.training else 0.0

    def forward(self, x):
        raise TypeError("GaussianNoise holds a head's noise level; the head draws the noise")

    def extra_repr(self) -> str:
        return f"std={self.p}"
