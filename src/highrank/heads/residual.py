"""Residual contexts: how a mixture head starts exactly at a softmax it replaces (warm start).

The papers' mixture heads build their K contexts from the hidden state g alone,

    h_k = tanh(W_k g + a_k)                                  (MoS/MoC Eq. 3; Mixtape's H_k)

which no initialisation makes equal to the softmax's own context g' (tanh is not the
identity), so a mixture attached to a trained model starts far from that model's
distribution. With ``residual_contexts=True`` a head computes instead

    h_k = g' + Z_k tanh(W_k g + a_k)                         Z_k: (d_embed x width)

where g' is the softmax's context (g itself, or its learned projection when d_in != d_embed),
and ``tanh(W_k g + a_k)`` is the paper's latent, dropout included. ``start_at_base`` sets
every Z_k to zero (built, Z_k is random like any linear layer): then every h_k equals g', so
every component is the base softmax and so is any mixture of them, whatever the priors or
gates: MoS, MoC and Mixtape then compute log_softmax(E g' + b) exactly. The
extra parameters are not stuck there: the gradient of the loss with respect to Z_k is
(dL/dh_k) tanh(W_k g + a_k)^T, which differs between components because each W_k is drawn
at random (the LoRA idea: one factor random, the other zero), and weights them by their prior
(MoS) or gates (Mixtape), so one optimiser step moves the contexts apart. The priors and
gates themselves receive no gradient on that first step (with identical components,
the posterior over components equals the prior) and start to move on the next.

A mixture with one component is a softmax again: ``h = g' + Z tanh(W g + a)`` under a single
softmax is the rank-bounded capacity control (``heads/mlp_softmax.py``).
"""

from __future__ import annotations

import torch
from torch import nn


class ResidualContexts(nn.Module):
    """``h_k = g' + Z_k t_k`` for latents ``t (N, K, width)``: ``(N, K, d_embed)``.

    Args:
        d_in: width of g.
        d_embed: width of the contexts (the decoder's rows).
        n_contexts: K.
        width: width of each latent t_k.
    """

    def __init__(self, d_in: int, d_embed: int, n_contexts: int, width: int) -> None:
        super().__init__()
        # g' as the softmax computes it: g itself, or a projection when the widths differ
        # (copied from the softmax being replaced by ``start_at_base``).
        self.base_projection = nn.Linear(d_in, d_embed) if d_in != d_embed else None
        # Z_k: nn.Linear's initialisation, so a head built with residual contexts trains every
        # parameter from the first step; start_at_base sets it to 0.
        self.residual = nn.Parameter(torch.empty(n_contexts, d_embed, width))
        bound = width**-0.5
        nn.init.uniform_(self.residual, -bound, bound)

    def base_context(self, g: torch.Tensor) -> torch.Tensor:
        """g': ``(N, d_in) -> (N, d_embed)``."""
        return g if self.base_projection is None else self.base_projection(g)

    def forward(self, g: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        shift = torch.einsum("nkw,kdw->nkd", latents, self.residual.to(latents.dtype))
        return self.base_context(g).unsqueeze(1).to(shift.dtype) + shift

    @torch.no_grad()
    def start_at_base(self, projection: nn.Linear | None = None) -> None:
        """Z = 0, and g' = ``projection`` (the replaced softmax's) when the widths differ."""
        self.residual.zero_()
        copy_projection(self.base_projection, projection)


@torch.no_grad()
def copy_projection(target: nn.Linear | None, source: nn.Linear | None) -> None:
    """``target`` (a head's d_in -> d_embed projection, or None) takes ``source``'s weights."""
    if target is None:
        if source is not None:
            raise ValueError(
                "a projection was given but this head reads g directly (d_in == d_embed)"
            )
        return
    if source is None or source.weight.shape != target.weight.shape:
        got = "none" if source is None else f"one of shape {tuple(source.weight.shape)}"
        raise ValueError(
            f"this head projects g (d_in != d_embed) with a {tuple(target.weight.shape)} matrix; "
            f"starting at a softmax needs that softmax's projection, got {got}"
        )
    target.weight.copy_(source.weight)
    target.bias.copy_(source.bias)
