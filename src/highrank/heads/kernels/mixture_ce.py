"""Fused, chunked cross-entropy for a softmax or a mixture of K softmaxes over one decoder.

    loss = sum_i w_i [ (1 - eps) (-log p(x_i)) + eps mean_v (-log p(v)) ],
    p(v) = sum_k pi_ik q_ik(v),   q_ik = softmax(E h_ik + b)

with w_i = 0 for ignored targets and eps the label smoothing (as ``F.cross_entropy``). The
gradient has a closed form (Yang et al. 2018's MoS is a posterior-weighted softmax
cross-entropy over N x K rows). With the posteriors r_ik(v) = pi_ik q_ik(v) / p_i(v), their
sums R_ik = sum_v r_ik(v), and a_ik = w_i [(1 - eps) r_ik(x_i) + eps R_ik / V]:

    d loss / d logits_ikv = a_ik q_ikv - w_i (eps / V) r_ik(v) - w_i (1 - eps) r_ik(x_i) [v = x_i]
    d loss / d log pi_ik  = -a_ik

(d log p(u) / d logits_kv = r_k(u) ([u = v] - q_k(v)) and d log p(u) / d log pi_k = r_k(u),
summed over u with the weights of the loss.) For a single softmax (K = 1, no prior) r = 1
and R = V, so the smoothing term's gradient is just eps (q - 1 / V). So the forward pass can
compute every gradient chunk by chunk, reusing one ``(c K, V)`` buffer for the logits, their
softmax and the logit gradient, and backward only scales the stored gradients by the
incoming scalar. Per chunk: three matmuls (logits, the hidden and the decoder gradients) and
a handful of in-place passes over the buffer; nothing of size ``N x K x V`` is allocated,
and nothing is recomputed. Label smoothing of a mixture (K > 1) needs every r_ik(v): one
more ``(c, K, V)`` buffer per chunk, computed in log space.

``MIXTURE_LOSS`` is the ``LossKernel`` of every head that is such a mixture over its decoder
(softmax, MoC and the MLP softmax with K = 1, MoS): it reads the head's
``softmax_mixture(h, *masks) -> (h_ik (N, K, d_embed), log pi (N, K) or None)``.
"""

from __future__ import annotations

import torch

from highrank.heads.kernels.chunking import LossKernel, chunk_slices
from highrank.heads.kernels.fused import fused_loss


class MixtureLoss(LossKernel):
    """The fused loss of a head with ``softmax_mixture(h, *masks)`` (module docstring)."""

    def __call__(self, head, rows, target, masks, chunk_size, label_smoothing, ignore_index):
        latents, log_prior = head.softmax_mixture(rows, *masks)
        return mixture_cross_entropy_sum(
            latents,
            log_prior,
            head.weight,
            head.bias,
            target,
            chunk_size,
            label_smoothing=label_smoothing,
            ignore_index=ignore_index,
        )


MIXTURE_LOSS = MixtureLoss()


def mixture_cross_entropy_sum(
    latents: torch.Tensor,
    log_prior: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    target: torch.Tensor,
    chunk_size: int,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Summed loss (scalar) of ``target (N,)``; gradients computed in the forward pass.

    latents: (N, K, d) component contexts h_ik; log_prior: (N, K) log pi, or None for K = 1;
    weight: (V, d) decoder E; bias: (V,) decoder bias b. Targets equal to ``ignore_index``
    count zero; ``label_smoothing`` as ``F.cross_entropy``.
    """
    if log_prior is None:
        if latents.shape[1] != 1:
            raise ValueError(f"log_prior is required for K = {latents.shape[1]} components")
        log_prior = latents.new_zeros(latents.shape[:2])
    options = (chunk_size, float(label_smoothing), ignore_index)
    return _mixture_cross_entropy(latents, log_prior, weight, bias, target, *options)


def _chunk_gradients(h, log_prior, weight, bias, target, kept, eps, buffer):
    """Loss sum and gradients for one chunk. h: (c, K, d); log_prior: (c, K); target: (c,)
    valid ids; kept: (c,) 1 for counted rows, 0 for ignored ones; eps: label smoothing."""
    c, k, d = h.shape
    n_vocab = weight.shape[0]
    rows = h.reshape(c * k, d)
    logits = torch.addmm(bias, rows, weight.t(), out=buffer[: c * k])  # (cK, V)
    target_rows = target.repeat_interleave(k)  # (cK,) target of every component row
    target_logit = (rows * weight[target_rows]).sum(-1) + bias[target_rows]  # (cK,)
    logit_mean = logits.mean(dim=1) if eps != 0.0 and k == 1 else None  # (cK,)
    row_max = logits.amax(dim=1, keepdim=True)
    shifted = logits.sub_(row_max)  # in place
    if eps != 0.0 and k > 1:  # before the buffer is exponentiated: needs log q in full
        smoothing, all_posteriors = _mixture_smoothing(shifted, log_prior)
    probs = shifted.exp_()  # in place: unnormalised component probabilities
    normaliser = probs.sum(dim=1)  # (cK,)
    log_normaliser = row_max.squeeze(1) + normaliser.log()
    joint = log_prior + (target_logit - log_normaliser).view(c, k)  # log pi_k q_k(x): (c, K)
    log_likelihood = torch.logsumexp(joint, dim=1)  # (c,)
    posterior = (joint - log_likelihood.unsqueeze(1)).exp_()  # r_k(x): (c, K)
    loss = -log_likelihood
    if eps == 0.0:
        prior_grad = posterior
    elif k == 1:
        smoothing = log_normaliser - logit_mean  # mean_v -log q(v)
        prior_grad = (1.0 - eps) * posterior + eps  # R = V, so eps R / V = eps
    else:
        prior_grad = (1.0 - eps) * posterior + (eps / n_vocab) * all_posteriors.sum(-1)
    if eps != 0.0:
        loss = (1.0 - eps) * loss + eps * smoothing
    loss_sum = torch.where(kept > 0, loss, 0.0).sum()
    prior_grad = prior_grad * kept.unsqueeze(1)  # a_ik: (c, K)
    # Logit gradient, built in the buffer: a q - w (eps / V) r(v) - w (1 - eps) r(x) [v = x].
    grad_logits = probs.mul_((prior_grad.view(-1) / normaliser).unsqueeze(1))
    if eps != 0.0:
        scale = kept * (eps / n_vocab)  # (c,)
        if k == 1:
            grad_logits.sub_(scale.unsqueeze(1))
        else:
            grad_logits.view(c, k, n_vocab).sub_(all_posteriors.mul_(scale.view(c, 1, 1)))
    target_weight = (1.0 - eps) * posterior * kept.unsqueeze(1)  # (c, K)
    grad_logits[torch.arange(c * k, device=h.device), target_rows] -= target_weight.view(-1)
    grad_rows = grad_logits @ weight  # (cK, d)
    return loss_sum, grad_rows.view(c, k, d), -prior_grad, grad_logits, rows


def _mixture_smoothing(shifted, log_prior):
    """The smoothing term mean_v -log p(v) ``(c,)`` of a mixture and its posteriors r_k(v)
    ``(c, K, V)``, in log space (p(v) of rare words underflows float32 long before its log
    does). shifted: (cK, V) logits minus any per-row constant, left unchanged; log_prior:
    (c, K)."""
    c, k = log_prior.shape
    log_joint = shifted - torch.logsumexp(shifted, dim=1, keepdim=True)  # log q_k(v): (cK, V)
    log_joint = log_joint.view(c, k, -1).add_(log_prior.unsqueeze(2))  # log pi_k q_k(v)
    log_p = torch.logsumexp(log_joint, dim=1)  # (c, V)
    return -log_p.mean(dim=1), log_joint.sub_(log_p.unsqueeze(1)).exp_()


def _loss_and_gradients(
    latents, log_prior, weight, bias, target, chunk_size, eps, ignore_index
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k, _ = latents.shape
    compute_dtype = torch.promote_types(latents.dtype, torch.float32)
    latents, log_prior = latents.to(compute_dtype), log_prior.to(compute_dtype)
    weight_c, bias_c = weight.to(compute_dtype), bias.to(compute_dtype)
    buffer = latents.new_empty(max(1, min(chunk_size, n)) * k, weight.shape[0])
    grad_latents = torch.empty_like(latents)
    grad_log_prior = torch.empty_like(log_prior)
    grad_weight = torch.zeros_like(weight_c)
    grad_bias = torch.zeros_like(bias_c)
    total = torch.zeros((), dtype=torch.float64, device=latents.device)
    kept = (target != ignore_index).to(compute_dtype)  # (N,) 0 for ignored targets
    target = torch.where(target != ignore_index, target, 0)  # any valid id: weighted 0
    for part in chunk_slices(n, chunk_size):
        nll, g_rows, g_prior, g_logits, rows = _chunk_gradients(
            latents[part], log_prior[part], weight_c, bias_c, target[part], kept[part], eps, buffer
        )
        total += nll.double()
        grad_latents[part], grad_log_prior[part] = g_rows, g_prior
        grad_weight.addmm_(g_logits.t(), rows)  # (V, d) += (V, cK) @ (cK, d)
        grad_bias += g_logits.sum(dim=0)
    return total.to(compute_dtype), grad_latents, grad_log_prior, grad_weight, grad_bias


# (loss sum, d/d latents, d/d log_prior, d/d weight, d/d bias), at least float32.
_mixture_cross_entropy = fused_loss(
    "mixture_cross_entropy",
    _loss_and_gradients,
    tensors=("latents", "log_prior", "weight", "bias", "target"),
    differentiable=4,
    options=(("chunk_size", "int"), ("label_smoothing", "float"), ("ignore_index", "int")),
)
