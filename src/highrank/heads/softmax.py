"""The softmax output layer, and the base of the pointwise-transformed softmax family.

Softmax: log p(x | c) = log_softmax(E g' + b)_x, with g' = g, or a learned linear projection
of g when ``d_in != d_embed``. Its log-probability matrix over any set of contexts has rank at
most d_embed + 2: the *softmax bottleneck* (Yang et al., ICLR 2018, Sec. 2).

SigSoftmax, GSS and LMS-PLIF keep this layer and apply a monotone function f to every logit
before the normalisation, log p = log_softmax(f(z)); they subclass ``PointwiseSoftmax``.
"""

from __future__ import annotations

import torch
from torch import nn

from highrank.heads.base import OutputHead
from highrank.heads.kernels.mixture_ce import MIXTURE_LOSS
from highrank.heads.residual import copy_projection


class PointwiseSoftmax(OutputHead):
    """``log_softmax(f(E g' + b))`` for a pointwise ``f``; ``f`` is the identity here."""

    def __init__(
        self,
        d_in: int,
        vocab_size: int,
        *,
        d_embed: int | None = None,
        tied_weight: nn.Parameter | None = None,
    ) -> None:
        super().__init__(d_in, vocab_size, d_embed=d_embed, tied_weight=tied_weight)
        # Only project when the sizes differ, so a tied d_in == d_embed softmax is the plain one.
        self.projection = nn.Linear(d_in, self.d_embed) if self.d_embed != d_in else None

    def transform(self, logits: torch.Tensor) -> torch.Tensor:
        """The pointwise f applied to float32 logits ``(N, V)``; identity for Softmax."""
        return logits

    def transformed_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``f(E g' + b)`` as ``[..., V]``: the matrix whose rank the sigsoftmax papers study."""
        out = self._logits_rows(self._flatten_hidden(hidden))
        return out.reshape(*hidden.shape[:-1], self.vocab_size)

    def start_at_base(self, projection: nn.Linear | None = None) -> None:
        """f becomes the identity (``_start_transform_at_identity``) and g' the given
        projection's, so the head is exactly the softmax it replaces."""
        copy_projection(self.projection, projection)
        self._start_transform_at_identity()

    def _start_transform_at_identity(self) -> None:
        """Make f the identity; it is one for Softmax."""

    def _project(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.projection is None else self.projection(h)

    def _logits_rows(self, h: torch.Tensor) -> torch.Tensor:
        return self.transform(self._decoder_logits(self._project(h)))  # (N, V)


class Softmax(PointwiseSoftmax):
    """The standard softmax output layer, ``log_softmax(E g' + b)``.

    Args:
        d_in: hidden size of the backbone output g.
        vocab_size: V.
        d_embed: width of E; a bias-carrying linear projection d_in -> d_embed is added when
            it differs from d_in (defaults to d_in).
        tied_weight: the input embedding Parameter ``(V, d_embed)`` to share as E.
    """

    loss_kernel = MIXTURE_LOSS  # fused chunked cross-entropy (heads/kernels/mixture_ce.py)

    def softmax_mixture(self, h: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The softmax as a mixture of one: its context g' ``(N, 1, d_embed)``, no prior."""
        return self._project(h).unsqueeze(1), None
