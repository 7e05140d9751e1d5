"""A softmax over a residual MLP of the context: the capacity control for high-rank heads.

    h = g' + Z tanh(W g + a)          Z: (d_embed x width), W: (width x d_in)
    log p(x | c) = log_softmax(E h + b)_x

g' is g, or a learned projection when d_in != d_embed. This is a Mixture of Softmaxes with
one component and residual contexts (``heads/residual.py``): it adds about as many
parameters as a high-rank head (``width = K d_embed`` matches MoS-K with residual contexts,
whose K latents and K residual matrices hold about 2 K d^2 weights; ``4 d_embed`` matches
Mixtape) and starts, like them, exactly at the softmax it extends (``start_at_base`` sets Z
to zero; built, Z is random like any linear layer), but it stays a single
softmax over a d_embed-dimensional context: its log-probability matrix has rank at most
d_embed + 2 (d_embed + 1 without a bias), whatever it learns. A gain of a high-rank head over
this control is therefore not explained by its extra parameters alone.

Not from a paper: a control built for the warm-start study (issue "a high-rank head that
improves a pretrained LM").
"""

from __future__ import annotations

import torch
from torch import nn

from highrank.heads.base import OutputHead
from highrank.heads.dropout import HeadDropout
from highrank.heads.functional import apply_mask
from highrank.heads.kernels.mixture_ce import MIXTURE_LOSS
from highrank.heads.residual import ResidualContexts
from highrank.util.checks import check_dropout_time_dim, check_positive_int, check_probability


class MLPSoftmax(OutputHead):
    """Softmax over ``g' + Z tanh(W g + a)`` (module docstring).

    Args:
        mlp_width: width of the hidden layer tanh(W g + a); None: d_embed.
        latent_dropout: dropout on the hidden layer's units (as MoS's on its latents).
        dropout_time_dim: the time axis over which dropout masks are shared (locked), or None.
        d_in, vocab_size, d_embed, tied_weight: as :class:`highrank.heads.base.OutputHead`.
    """

    def __init__(
        self,
        d_in: int,
        vocab_size: int,
        *,
        d_embed: int | None = None,
        tied_weight: nn.Parameter | None = None,
        mlp_width: int | None = None,
        latent_dropout: float = 0.0,
        dropout_time_dim: int | None = None,
    ) -> None:
        super().__init__(d_in, vocab_size, d_embed=d_embed, tied_weight=tied_weight)
        self.mlp_width = self.d_embed if mlp_width is None else mlp_width
        check_positive_int("mlp_width", self.mlp_width)
        # The rate lives in an nn.Dropout, where model.eval() and TRL's dropout switch reach it.
        self.latent_dropout_layer = HeadDropout(check_probability("latent_dropout", latent_dropout))
        self.dropout_time_dim = check_dropout_time_dim(dropout_time_dim)
        self.latent = nn.Linear(d_in, self.mlp_width)  # W, a
        self.residual_branch = ResidualContexts(d_in, self.d_embed, 1, self.mlp_width)

    @property
    def latent_dropout(self) -> float:
        """Dropout on the hidden units: the ``p`` of ``latent_dropout_layer`` (heads/dropout.py)."""
        return self.latent_dropout_layer.p

    @latent_dropout.setter
    def latent_dropout(self, value: float) -> None:
        self.latent_dropout_layer.p = check_probability("latent_dropout", value)

    def start_at_base(self, projection: nn.Linear | None = None) -> None:
        self.residual_branch.start_at_base(projection)

    loss_kernel = MIXTURE_LOSS  # fused chunked cross-entropy (heads/kernels/mixture_ce.py)

    def _draw_masks(self, hidden: torch.Tensor) -> tuple[torch.Tensor | None]:
        return (self._dropout_mask(hidden, self.mlp_width, self.latent_dropout_layer),)

    def tanh_context_inputs(self, g: torch.Tensor) -> torch.Tensor:
        """``W g + a``, ``(N, mlp_width)`` (``OutputHead``)."""
        return self.latent(g)

    def context(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``g' + Z tanh(W g + a)``: ``(N, d_in) -> (N, 1, d_embed)``."""
        latent = apply_mask(torch.tanh(self.latent(h)), mask).unsqueeze(1)  # (N, 1, width)
        return self.residual_branch(h, latent)

    def _logits_rows(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self._decoder_logits(self.context(h, mask).squeeze(1))  # (N, V)

    def softmax_mixture(self, h: torch.Tensor, mask: torch.Tensor | None):
        """A mixture of one softmax: the context ``(N, 1, d_embed)``, no prior."""
        return self.context(h, mask), None

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, mlp_width={self.mlp_width}, "
            f"latent_dropout={self.latent_dropout}"
        )
