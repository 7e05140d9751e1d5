"""Generalized SigSoftmax, GSS(c, k), introduced by the rank study (Parthiban, Mao & Inkpen,
"On the Softmax Bottleneck of Recurrent Language Models", AAAI 2021; code:
yottabytt/awd-lstm-lmkit). It generalises SigSoftmax (Kanai et al., NeurIPS 2018) as a fixed
monotone pointwise function of the logits, the family whose learnable member, LMS-PLIF, is
Ganea et al.'s (ICML 2019; see ``plif.py``).

log p = log_softmax(f(z)) with the monotone pointwise function
    f(z) = k (z - c) + c - (k - 1) softplus(z - c),
i.e. p(x | c) ∝ exp(z_x) · sigmoid(z_x - c)^(k - 1). k = 1 is Softmax and (c, k) = (0, 2) is
SigSoftmax. The rank study's choices: PTB (c, k) = (-1.5, 2.5) (the defaults), WT2 (-1.5, 3).

With ``learn_shape=True`` (our extension, used to start at a trained softmax) c and k are
trained with the rest: k = exp(s) keeps f monotone for any s, and ``start_at_base`` sets
k = 1 (s = 0), where f is the identity and GSS the softmax it replaces; the gradient of the
loss with respect to s there is sum_x dL/df_x · log sigmoid(z_x - c), not zero, so k moves
on the first step (c follows once k != 1: df/dc = (k - 1)(sigmoid(z - c) - 1)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from highrank.heads.softmax import PointwiseSoftmax
from highrank.util.checks import check_bool, check_finite


class GeneralizedSigSoftmax(PointwiseSoftmax):
    """GSS output layer.

    Args:
        center: c, where f bends from slope k (for z << c) to slope 1 (for z >> c).
        slope: k > 0, the slope of f for logits well below ``center``.
        learn_shape: train c and k (initialised at ``center`` and ``slope``); see above.
        d_in, vocab_size, d_embed, tied_weight: as :class:`highrank.heads.softmax.Softmax`.
    """

    def __init__(
        self,
        d_in: int,
        vocab_size: int,
        *,
        d_embed: int | None = None,
        tied_weight: nn.Parameter | None = None,
        center: float = -1.5,
        slope: float = 2.5,
        learn_shape: bool = False,
    ) -> None:
        super().__init__(d_in, vocab_size, d_embed=d_embed, tied_weight=tied_weight)
        self.center = check_finite("center", center)
        # f'(z) = k - (k - 1) sigmoid(z - c) lies between 1 and k: monotone exactly when k > 0.
        if check_finite("slope", slope) <= 0.0:
            raise ValueError(f"slope (k) must be > 0 so that f stays monotone; got {slope!r}")
        self.slope = float(slope)
        self.learn_shape = check_bool("learn_shape", learn_shape)
        if learn_shape:  # c and s = log k, trained; self.center/slope keep the initial values
            self.learned_center = nn.Parameter(torch.tensor(self.center))
            self.log_slope = nn.Parameter(torch.tensor(math.log(self.slope)))

    BASE_INIT_KNOBS = {"slope": 1.0, "learn_shape": True}

    def shape(self) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """The current (c, k)."""
        if self.learn_shape:
            return self.learned_center, self.log_slope.exp()
        return self.center, self.slope

    def _start_transform_at_identity(self) -> None:
        if self.learn_shape:
            with torch.no_grad():
                self.log_slope.zero_()
        elif self.slope != 1.0:
            raise ValueError(
                f"GSS with the fixed slope k={self.slope} is not the identity; build it with "
                "slope=1.0 (and learn_shape=True to train it from there)"
            )

    def transform(self, logits: torch.Tensor) -> torch.Tensor:
        c, k = self.shape()
        shifted = logits - c
        return k * shifted + c - (k - 1.0) * F.softplus(shifted)

    def extra_repr(self) -> str:
        learned = ", learn_shape=True" if self.learn_shape else ""
        return f"{super().extra_repr()}, center={self.center}, slope={self.slope}{learned}"
