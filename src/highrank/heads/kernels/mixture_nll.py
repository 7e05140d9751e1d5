"""The negative log-likelihood of a mixture of softmaxes from its components' logits, with a
hand-written backward pass: the value of ``functional.mixture_nll``, with one ``(N, K, V)``
buffer for the gradient where autograd's chain (log-sum-exp, gather) builds several. For the
heads whose K softmaxes are not one decoder's products (MFS, MoS + CPR: ``heads/sequence.py``);
MoS's own loss is ``mixture_ce.py``'s.

With ``z`` the logits, ``lse_k`` each component's log normaliser and ``r_k`` the posterior of
component k given the target t (``r = softmax_k(log pi_k + z_kt - lse_k)``), the loss is
``-logsumexp_k(log pi_k + z_kt - lse_k)`` and

    d loss / d z_kv = r_k (softmax(z_k)_v - [v = t]),     d loss / d log pi_k = -r_k.
"""

from __future__ import annotations

import torch

from highrank.heads.kernels.in_place import eager_plain
from highrank.heads.kernels.paths import fast_paths


def may_fuse(logits: torch.Tensor) -> bool:
    """Take the hand-written backward for ``logits``? Outside ``reference_paths()``, on an
    eager tensor outside torch.compile and ``torch.func`` (:func:`eager_plain`: a custom
    autograd function has no batching rule); elsewhere the autograd chain."""
    return fast_paths() and eager_plain(logits)


def mixture_nll_fused(
    log_prior: torch.Tensor, logits: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """``(N,)`` NLL of ``target (N,)`` under the mixture of ``logits (N, K, V)`` weighted by
    ``log_prior (N, K)`` (module docstring)."""
    return _MixtureNLL.apply(log_prior, logits, target)


class _MixtureNLL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, log_prior, logits, target):
        n, k, _ = logits.shape
        normaliser = torch.logsumexp(logits, dim=-1)  # lse_k: (N, K)
        index = target.view(n, 1, 1).expand(n, k, 1)
        joint = log_prior + logits.gather(-1, index).squeeze(-1) - normaliser  # (N, K)
        total = torch.logsumexp(joint, dim=1)  # (N,)
        posterior = torch.exp(joint - total[:, None])  # r: (N, K)
        ctx.save_for_backward(logits, normaliser, posterior, index)
        return -total

    @staticmethod
    def backward(ctx, grad):
        logits, normaliser, posterior, index = ctx.saved_tensors
        weight = posterior * grad[:, None]  # r_k times the incoming gradient: (N, K)
        grad_logits = torch.sub(logits, normaliser[..., None])  # the one (N, K, V) buffer
        grad_logits.exp_().mul_(weight[..., None])  # r_k softmax(z_k)
        grad_logits.scatter_add_(-1, index, -weight[..., None])  # minus r_k at the target
        return -weight, grad_logits, None
