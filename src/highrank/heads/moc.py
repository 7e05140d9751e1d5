"""Mixture of Contexts (Yang et al., ICLR 2018, Sec. 3.2): the baseline that mixes *before*
the softmax, and so stays inside the bottleneck.

    log p(x | c) = log_softmax(E (sum_k pi_k h_k) + b)_x

with the prior pi and latent contexts h_k of Mixture of Softmaxes. Its log-probability
matrix has rank at most d_embed + 2 by construction, which is why MoS beats it.
"""

from __future__ import annotations

import torch

from highrank.heads.mos import ContextMixture


class MixtureOfContexts(ContextMixture):
    """MoC output layer; same knobs as :class:`highrank.heads.mos.MixtureOfSoftmaxes`."""

    def mixed_context(self, h: torch.Tensor, latent_mask: torch.Tensor | None) -> torch.Tensor:
        """``sum_k pi_k h_k``: ``(N, d_in) -> (N, d_embed)``."""
        log_prior, latents = self._prior_and_latents(h, latent_mask)
        return torch.einsum("nk,nkd->nd", log_prior.exp().to(latents.dtype), latents)

    def _logits_rows(self, h: torch.Tensor, latent_mask: torch.Tensor | None) -> torch.Tensor:
        return self._decoder_logits(self.mixed_context(h, latent_mask))  # (N, V)

    def softmax_mixture(self, h: torch.Tensor, latent_mask: torch.Tensor | None):
        """A mixture of one softmax: the mixed context ``(N, 1, d_embed)``, no prior."""
        return self.mixed_context(h, latent_mask).unsqueeze(1), None
