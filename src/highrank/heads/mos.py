"""Mixture of Softmaxes (Yang, Dai, Salakhutdinov & Cohen, "Breaking the Softmax Bottleneck:
A High-Rank RNN Language Model", ICLR 2018, Eq. 3).

    pi_k  = softmax(P g)_k                          prior, P bias-free (K x d_in)
    h_k   = tanh(W_k g + a_k)                       K latent contexts of size d_embed
    log p(x | c) = logsumexp_k( log pi_k + log_softmax(E h_k + b)_x )

The latent dropout (``dropoutl``) acts on all K x d_embed units, locked over time when
``dropout_time_dim`` names the time axis, as in the paper. The mixture is computed in log
space (the authors' code used log(p + 1e-8), which caps log-probabilities at -18.4).
The log-probability matrix is not bounded by rank d_embed + 2.

``residual_contexts=True`` (for starting at a trained softmax; ``heads/residual.py``) uses
h_k = g' + Z_k tanh(W_k g + a_k) with Z_k zero at init, so that the mixture starts as that
softmax exactly and leaves it on the first optimiser step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from highrank.heads.base import OutputHead
from highrank.heads.dropout import HeadDropout
from highrank.heads.functional import apply_mask, log_mixture, mixture_nll, smoothed_nll, widen
from highrank.heads.kernels.in_place import may_write_in_place, mixture_log_prob_
from highrank.heads.kernels.mixture_ce import MIXTURE_LOSS
from highrank.heads.residual import ResidualContexts
from highrank.util.checks import (
    check_bool,
    check_dropout_time_dim,
    check_positive_int,
    check_probability,
)


class ContextMixture(OutputHead):
    """Prior and latent contexts shared by MoS and MoC (the same paper's Eq. 3 and Sec. 3.2)."""

    def __init__(
        self,
        d_in: int,
        vocab_size: int,
        *,
        d_embed: int | None = None,
        tied_weight: nn.Parameter | None = None,
        n_components: int = 15,
        latent_dropout: float = 0.29,
        dropout_time_dim: int | None = None,
        residual_contexts: bool = False,
    ) -> None:
        super().__init__(d_in, vocab_size, d_embed=d_embed, tied_weight=tied_weight)
        self.n_components = check_positive_int("n_components", n_components)
        # The rate lives in an nn.Dropout, where model.eval() and TRL's dropout switch reach it.
        self.latent_dropout_layer = HeadDropout(check_probability("latent_dropout", latent_dropout))
        self.dropout_time_dim = check_dropout_time_dim(dropout_time_dim)
        self.prior = nn.Linear(d_in, n_components, bias=False)
        self.latent = nn.Linear(d_in, n_components * self.d_embed)
        self.residual_contexts = check_bool("residual_contexts", residual_contexts)
        self.residual_branch = (
            ResidualContexts(d_in, self.d_embed, n_components, self.d_embed)
            if residual_contexts
            else None
        )

    @property
    def latent_dropout(self) -> float:
        """Dropout on the latent units: the ``p`` of ``latent_dropout_layer`` (heads/dropout.py)."""
        return self.latent_dropout_layer.p

    @latent_dropout.setter
    def latent_dropout(self, value: float) -> None:
        self.latent_dropout_layer.p = check_probability("latent_dropout", value)

    BASE_INIT_KNOBS = {"residual_contexts": True}

    def start_at_base(self, projection: nn.Linear | None = None) -> None:
        if self.residual_branch is None:
            raise ValueError(
                f"{type(self).__name__} with the paper's contexts tanh(W_k g + a_k) cannot "
                "equal a softmax; build it with residual_contexts=True (init='base' does)"
            )
        self.residual_branch.start_at_base(projection)

    loss_kernel = MIXTURE_LOSS  # fused chunked cross-entropy (heads/kernels/mixture_ce.py)

    def _draw_masks(self, hidden: torch.Tensor) -> tuple[torch.Tensor | None]:
        width = self.n_components * self.d_embed
        return (self._dropout_mask(hidden, width, self.latent_dropout_layer),)

    def tanh_context_inputs(self, g: torch.Tensor) -> torch.Tensor:
        """``W_k g + a_k`` for every k, ``(N, K d_embed)`` (``OutputHead``)."""
        return self.latent(g)

    def _prior_and_latents(
        self, h: torch.Tensor, latent_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``log pi (N, K)`` in float32 and the latent contexts ``h_k (N, K, d_embed)``."""
        log_prior = F.log_softmax(widen(self.prior(h)), dim=-1)
        latents = apply_mask(torch.tanh(self.latent(h)), latent_mask)
        latents = latents.view(h.shape[0], self.n_components, self.d_embed)
        if self.residual_branch is not None:
            latents = self.residual_branch(h, latents)  # g' + Z_k tanh(W_k g + a_k)
        return log_prior, latents

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, n_components={self.n_components}, "
            f"latent_dropout={self.latent_dropout}"
            + (", residual_contexts=True" if self.residual_contexts else "")
        )


class MixtureOfSoftmaxes(ContextMixture):
    """MoS output layer.

    Args:
        n_components: K, the number of softmaxes (paper: 15 on PTB and WT2).
        latent_dropout: dropout on the K x d_embed latent units (paper: 0.29 PTB, locked).
        residual_contexts: h_k = g' + Z_k tanh(W_k g + a_k), Z_k = 0 at init, so that
            ``start_at_base`` makes the head a given softmax (module docstring).
        dropout_time_dim: the time axis of ``hidden`` over which dropout masks are shared
            (locked dropout: 0 for AWD-LSTM's time-major ``(T, B, d)``, 1 for batch-first);
            None (default) draws an independent mask for every token.
        d_in, vocab_size, d_embed, tied_weight: as :class:`highrank.heads.base.OutputHead`.
    """

    def softmax_mixture(self, h: torch.Tensor, latent_mask: torch.Tensor | None):
        """The contexts h_k ``(N, K, d_embed)`` and log pi ``(N, K)`` of the mixture."""
        log_prior, latents = self._prior_and_latents(h, latent_mask)
        return latents, log_prior

    def _log_prob_rows(self, h: torch.Tensor, latent_mask: torch.Tensor | None) -> torch.Tensor:
        log_prior, latents = self._prior_and_latents(h, latent_mask)
        logits = self._decoder_logits(latents)  # (N, K, V)
        if may_write_in_place(logits):  # inference: mixed in place, K + 1 transcendentals
            return mixture_log_prob_(log_prior, logits)  # per value (heads/kernels/in_place.py)
        return log_mixture(log_prior, F.log_softmax(logits, dim=-1))

    def _loss_rows(
        self,
        h: torch.Tensor,
        target: torch.Tensor,
        latent_mask: torch.Tensor | None,
        *,
        label_smoothing: float,
    ) -> torch.Tensor:
        if label_smoothing:  # the smoothing term needs every log p(v): the whole mixture
            return smoothed_nll(self._log_prob_rows(h, latent_mask), target, label_smoothing)
        log_prior, latents = self._prior_and_latents(h, latent_mask)
        return mixture_nll(log_prior, self._decoder_logits(latents), target)

    def logits_per_token(self) -> int:
        return self.n_components * self.vocab_size
