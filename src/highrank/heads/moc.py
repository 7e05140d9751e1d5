"""Mixture of Contexts (Yang et al., ICLR 2018, Sec. 3.2): the baseline that mixes *before*
the softmax, and so stays inside the bottleneck.

    log p(x | c) = log_softmax(E (sum_k pi_k h_k) + b)_x

with the prior pi and latent contexts h_k of Mixture of Softmaxes. Its log-probability
matrix has rank at most d_embed + 2 by construction, which is why MoS beats it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from highrank.heads.mixture_ce import mixture_cross_entropy_sum
from highrank.heads.mos import ContextMixture


class MixtureOfContexts(ContextMixture):
    """MoC output layer; same knobs as :class:`highrank.heads.mos.MixtureOfSoftmaxes`."""

    def mixed_context(self, h: torch.Tensor, latent_mask: torch.Tensor | None) -> torch.Tensor:
        """``sum_k pi_k h_k``: ``(N, d_in) -> (N, d_embed)``."""
        log_prior, latents = self._prior_and_latents(h, latent_mask)
        return torch.einsum("nk,nkd->nd", log_prior.exp().to(latents.dtype), latents)

    def _log_prob_rows(self, h: torch.Tensor, latent_mask: torch.Tensor | None) -> torch.Tensor:
        return F.log_softmax(self._decoder_logits(self.mixed_context(h, latent_mask)), dim=-1)

    def _loss_rows(
        self,
        h: torch.Tensor,
        target: torch.Tensor,
        latent_mask: torch.Tensor | None,
        *,
        label_smoothing: float,
    ) -> torch.Tensor:
        logits = self._decoder_logits(self.mixed_context(h, latent_mask))
        return F.cross_entropy(logits, target, reduction="none", label_smoothing=label_smoothing)

    def _chunked_loss_sum(self, rows, target, masks, chunk_size, label_smoothing, ignore_index):
        mixed = self.mixed_context(rows, *masks).unsqueeze(1)  # (N, 1, d_embed)
        return mixture_cross_entropy_sum(
            mixed,
            None,
            self.weight,
            self.bias,
            target,
            chunk_size,
            label_smoothing=label_smoothing,
            ignore_index=ignore_index,
        )
