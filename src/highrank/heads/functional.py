"""Pure tensor maths shared by the heads: log-space mixtures, the sigmoid tree, dropout masks.

(The in-place inference versions of some of it are kernels: ``kernels/in_place.py``.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def locked_dropout_mask(
    lead_shape: torch.Size | tuple[int, ...],
    width: int,
    p: float,
    device: torch.device,
    time_dim: int | None = None,
) -> torch.Tensor:
    """Inverted-dropout mask ``(N, width)`` for the N = prod(lead_shape) rows of a hidden tensor.

    With ``time_dim`` set, one mask per sequence is shared over that axis of the hidden
    tensor: the "locked" (variational) dropout of Gal & Ghahramani used by AWD-LSTM and MoS
    (time_dim=0 for their time-major ``(T, B, d)`` layout, mask ``(1, B, width)``). With
    ``time_dim=None`` every row draws its own mask. Kept values are scaled by 1 / (1 - p).
    """
    lead = tuple(lead_shape)
    mask_lead = list(lead)
    if time_dim is not None:
        # A time axis needs another axis beside it; on flat (N, d) input, "locking" over the
        # only axis would silently give every token the same mask.
        if len(lead) < 2 or not -len(lead) <= time_dim < len(lead):
            raise ValueError(
                f"dropout_time_dim={time_dim} is not a time axis of hidden states with leading "
                f"shape {lead}; use None for inputs without a time axis"
            )
        mask_lead[time_dim] = 1
    keep = torch.full((*mask_lead, width), 1.0 - p, device=device)
    mask = torch.bernoulli(keep).div_(1.0 - p)
    return mask.expand(*lead, width).reshape(-1, width)


def apply_mask(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``x * mask`` with ``mask (N, width)`` matching ``x (N, ...)`` flattened; None is identity.

    The result keeps x's dtype: a float32 mask must not turn a bf16 head's activations into
    float32 (its next matmul would then mix dtypes); the product is rounded once, after the
    scaling by 1 / (1 - p) in the mask's precision."""
    if mask is None:
        return x
    return (x.reshape(mask.shape) * mask).to(x.dtype).reshape(x.shape)


# Up to this many rows on the CPU (a generation step: MoS's K contexts, Mixtape's 4, a few
# beams), ``linear`` computes (W x^T)^T: see there.
FEW_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear(x, weight, bias)``: ``(..., d) -> (..., V)`` for ``weight (V, d)``.

    For 2 to ``FEW_ROWS`` rows on the CPU it is computed as ``(W x^T)^T``, which streams W
    once, where ``x W^T`` repacks W: at V = 49,152, d = 576 (one thread) 2 rows took 2.5x and
    4 rows 2.9x one row's time that way, against 1.2x and 1.3x this way.
    """
    rows = x.reshape(-1, x.shape[-1])
    if x.device.type != "cpu" or not 1 < rows.shape[0] <= FEW_ROWS:
        return F.linear(x, weight, bias)
    if bias is None:
        product = weight @ rows.t()
    else:
        product = torch.addmm(bias.unsqueeze(1), weight, rows.t())
    return product.t().contiguous().view(*x.shape[:-1], weight.shape[0])


def log_mixture(log_prior: torch.Tensor, component_log_probs: torch.Tensor) -> torch.Tensor:
    """``log sum_k pi_k p_k(x)`` computed as a log-sum-exp, never as log(p + eps).

    log_prior: (N, K); component_log_probs: (N, K, V) -> (N, V).

    A chain of ``logaddexp`` over the K contiguous (N, V) slices rather than ``logsumexp``
    along the middle dimension: on the CPU (one thread, V = 49,152, N = 256) the mixing took
    616 ms instead of 1,141 ms for K = 2 and 1,541 ms instead of 1,888 ms for K = 4 (log-softmax
    included; medians of 11, loaded machine); the prior is added slice by slice, so no
    (N, K, V) sum is built.
    """
    mixed = component_log_probs[:, 0] + log_prior[:, :1]
    for k in range(1, component_log_probs.shape[1]):
        mixed = torch.logaddexp(mixed, component_log_probs[:, k] + log_prior[:, k : k + 1])
    return mixed


def smoothed_nll(log_p: torch.Tensor, target: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """Label-smoothed NLL ``(N,)`` from normalised log-probabilities ``log_p (N, V)``:
    ``(1 - eps) * -log p(target) + eps * mean_v -log p(v)``, as ``F.cross_entropy`` defines it
    (the uniform distribution over V mixed into the one-hot target with weight eps)."""
    nll = -log_p.gather(1, target.unsqueeze(1)).squeeze(1)
    if label_smoothing == 0.0:
        return nll
    return (1.0 - label_smoothing) * nll - label_smoothing * log_p.mean(dim=1)


def mixture_nll(
    log_prior: torch.Tensor, component_logits: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """Negative log-likelihood of ``target (N,)`` under a mixture of softmaxes.

    log_prior: (N, K); component_logits: (N, K, V) unnormalised. Only the target column of
    each component is gathered, so no (N, K, V) log-probability tensor is built.
    """
    n, k, _ = component_logits.shape
    normaliser = torch.logsumexp(component_logits, dim=-1)  # (N, K)
    index = target.view(n, 1, 1).expand(n, k, 1)
    target_logit = component_logits.gather(-1, index).squeeze(-1)  # (N, K)
    return -torch.logsumexp(log_prior + target_logit - normaliser, dim=1)


def sigmoid_tree(pre_activation: torch.Tensor) -> torch.Tensor:
    """Mixtape's sigmoid tree decomposition (Yang et al. 2019, Sec. 3.2), ``(..., 3) -> (..., 4)``.

    gamma = sigmoid(l); pi_1 = g1 g2, pi_2 = g1 (1 - g2), pi_3 = (1 - g1) g3,
    pi_4 = (1 - g1)(1 - g3). The four priors sum to one. 1 - sigmoid(l) is computed as
    sigmoid(-l) so that it keeps its precision when gamma is close to one.
    """
    on = torch.sigmoid(pre_activation)
    off = torch.sigmoid(-pre_activation)
    g1, g2, g3 = on.unbind(-1)
    n1, n2, n3 = off.unbind(-1)
    return torch.stack((g1 * g2, g1 * n2, n1 * g3, n1 * n3), dim=-1)


def sigmoid_tree_mix(pre_activation: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``sum_k pi_k values_k`` with pi = sigmoid_tree(pre_activation), without building pi.

    pre_activation: (..., 3, X); values: (..., 4, X) -> (..., X). The tree factorises,
        sum_k pi_k c_k = g1 (g2 c1 + (1 - g2) c2) + (1 - g1) (g3 c3 + (1 - g3) c4),
    which is three ``lerp``s: one pass each, no (..., 4, X) prior tensor, and lerp keeps its
    precision for gates near 1 as sigmoid(-l) would.
    """
    g1, g2, g3 = torch.sigmoid(pre_activation).to(values.dtype).unbind(-2)
    c1, c2, c3, c4 = values.unbind(-2)
    return torch.lerp(torch.lerp(c4, c3, g3), torch.lerp(c2, c1, g2), g1)


def widen(x: torch.Tensor) -> torch.Tensor:
    """At least float32: half-precision results of autocast matmuls are widened before any
    normalisation; float64 (used by reference tests) is kept as it is."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()
