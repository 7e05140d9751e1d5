"""The softmax output layer, and the base of the pointwise-transformed softmax family.

Softmax: log p(x | c) = log_softmax(E g' + b)_x, with g' = g, or a learned linear projection
of g when ``d_in != d_embed``. Its log-probability matrix over any set of contexts has rank at
most d_embed + 2: the *softmax bottleneck* (Yang et al., ICLR 2018, Sec. 2).

SigSoftmax, GSS and LMS-PLIF keep this layer and apply a monotone function f to every logit
before the normalisation, log p = log_softmax(f(z)); they subclass ``PointwiseSoftmax``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from highrank.heads.base import OutputHead
from highrank.heads.functional import log_softmax_fresh
from highrank.heads.mixture_ce import mixture_cross_entropy_sum
from highrank.heads.residual import copy_projection


class PointwiseSoftmax(OutputHead):
    """``log_softmax(f(E g' + b))`` for a pointwise ``f``; ``f`` is the identity here."""

    # Without gradients log_prob normalises its fresh logits in place (False: into a new
    # tensor, the general path; the benchmarks time both).
    in_place_normalisation = True

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
        rows = self._flatten_hidden(hidden)
        out = self.transform(self._decoder_logits(self._project(rows)))
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

    def _log_prob_rows(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.transform(self._decoder_logits(self._project(h)))  # (N, V), a fresh tensor
        return log_softmax_fresh(logits, in_place=self.in_place_normalisation)

    def _loss_rows(
        self, h: torch.Tensor, target: torch.Tensor, *, label_smoothing: float
    ) -> torch.Tensor:
        logits = self.transform(self._decoder_logits(self._project(h)))
        return F.cross_entropy(logits, target, reduction="none", label_smoothing=label_smoothing)


class Softmax(PointwiseSoftmax):
    """The standard softmax output layer, ``log_softmax(E g' + b)``.

    Args:
        d_in: hidden size of the backbone output g.
        vocab_size: V.
        d_embed: width of E; a bias-carrying linear projection d_in -> d_embed is added when
            it differs from d_in (defaults to d_in).
        tied_weight: the input embedding Parameter ``(V, d_embed)`` to share as E.
    """

    def auto_chunk_tokens(self, device: torch.device | str | None = None) -> int:
        return self.fused_auto_chunk_tokens(device)

    def _chunked_loss_sum(self, rows, target, masks, chunk_size, label_smoothing, ignore_index):
        latents = self._project(rows).unsqueeze(1)  # (N, 1, d_embed)
        return mixture_cross_entropy_sum(
            latents,
            None,
            self.weight,
            self.bias,
            target,
            chunk_size,
            label_smoothing=label_smoothing,
            ignore_index=ignore_index,
        )
