"""Fused, chunked cross-entropy for a softmax or a mixture of K softmaxes over one decoder.

    loss = sum_i -log sum_k pi_ik softmax(E h_ik + b)_{x_i}

The gradient has a closed form (Yang et al. 2018's MoS is a posterior-weighted softmax
cross-entropy over N x K rows): with the posterior r_ik = pi_ik p_k(x_i) / p(x_i),

    d loss / d logits_ikv = r_ik (softmax_ikv - [v = x_i])
    d loss / d log pi_ik  = -r_ik

so the forward pass can compute every gradient chunk by chunk, reusing one ``(c K, V)``
buffer for the logits, their softmax and the logit gradient, and backward only scales the
stored gradients by the incoming scalar. Per chunk: three matmuls (logits, the hidden and the
decoder gradients) and a handful of in-place passes over the buffer; nothing of size
``N x K x V`` is allocated, and nothing is recomputed. With K = 1 and no prior this is a
chunked softmax cross-entropy.
"""

from __future__ import annotations

import torch

from highrank.heads.chunking import chunk_slices


def mixture_cross_entropy_sum(
    latents: torch.Tensor,
    log_prior: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    target: torch.Tensor,
    chunk_size: int,
) -> torch.Tensor:
    """Summed NLL (scalar) of ``target (N,)``; gradients computed in the forward pass.

    latents: (N, K, d) component contexts h_ik; log_prior: (N, K) log pi, or None for K = 1;
    weight: (V, d) decoder E; bias: (V,) decoder bias b.
    """
    if log_prior is None:
        if latents.shape[1] != 1:
            raise ValueError(f"log_prior is required for K = {latents.shape[1]} components")
        log_prior = latents.new_zeros(latents.shape[:2])
    return _MixtureCrossEntropy.apply(latents, log_prior, weight, bias, target, chunk_size)


def _chunk_gradients(h, log_prior, weight, bias, target, buffer):
    """NLL sum and gradients for one chunk. h: (c, K, d); log_prior: (c, K); target: (c,)."""
    c, k, d = h.shape
    rows = h.reshape(c * k, d)
    logits = torch.addmm(bias, rows, weight.t(), out=buffer[: c * k])  # (cK, V)
    target_rows = target.repeat_interleave(k)  # (cK,) target of every component row
    target_logit = (rows * weight[target_rows]).sum(-1) + bias[target_rows]  # (cK,)
    row_max = logits.amax(dim=1, keepdim=True)
    probs = logits.sub_(row_max).exp_()  # in place: unnormalised component probabilities
    normaliser = probs.sum(dim=1)  # (cK,)
    log_normaliser = row_max.squeeze(1) + normaliser.log()
    joint = log_prior + (target_logit - log_normaliser).view(c, k)  # log pi_k p_k(x): (c, K)
    log_likelihood = torch.logsumexp(joint, dim=1)  # (c,)
    posterior = (joint - log_likelihood.unsqueeze(1)).exp_()  # r_ik: (c, K)
    # Logit gradient r (softmax - onehot), built in the same buffer.
    grad_logits = probs.mul_((posterior.view(-1) / normaliser).unsqueeze(1))
    grad_logits[torch.arange(c * k, device=h.device), target_rows] -= posterior.view(-1)
    grad_rows = grad_logits @ weight  # (cK, d)
    return -log_likelihood.sum(), grad_rows.view(c, k, d), -posterior, grad_logits, rows


class _MixtureCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, latents, log_prior, weight, bias, target, chunk_size):
        # Float32 throughout (float64 for float64 inputs): the buffer is reused in place, and
        # the gradients are exact rather than bf16 approximations.
        with torch.autocast(latents.device.type, enabled=False):
            return _MixtureCrossEntropy._forward(
                ctx, latents, log_prior, weight, bias, target, chunk_size
            )

    @staticmethod
    def _forward(ctx, latents, log_prior, weight, bias, target, chunk_size):
        n, k, _ = latents.shape
        compute_dtype = torch.promote_types(latents.dtype, torch.float32)
        latents, log_prior = latents.to(compute_dtype), log_prior.to(compute_dtype)
        weight_c, bias_c = weight.to(compute_dtype), bias.to(compute_dtype)
        buffer = latents.new_empty(min(chunk_size, n) * k, weight.shape[0])
        grad_latents = torch.empty_like(latents)
        grad_log_prior = torch.empty_like(log_prior)
        grad_weight = torch.zeros_like(weight_c)
        grad_bias = torch.zeros_like(bias_c)
        total = torch.zeros((), dtype=torch.float64, device=latents.device)
        for part in chunk_slices(n, chunk_size):
            nll, g_rows, g_prior, g_logits, rows = _chunk_gradients(
                latents[part], log_prior[part], weight_c, bias_c, target[part], buffer
            )
            total += nll.double()
            grad_latents[part], grad_log_prior[part] = g_rows, g_prior
            grad_weight.addmm_(g_logits.t(), rows)  # (V, d) += (V, cK) @ (cK, d)
            grad_bias += g_logits.sum(dim=0)
        ctx.save_for_backward(grad_latents, grad_log_prior, grad_weight, grad_bias)
        return total.to(compute_dtype)

    @staticmethod
    def backward(ctx, grad_output):
        grad_latents, grad_log_prior, grad_weight, grad_bias = ctx.saved_tensors
        return (
            grad_latents * grad_output if ctx.needs_input_grad[0] else None,
            grad_log_prior * grad_output if ctx.needs_input_grad[1] else None,
            grad_weight * grad_output if ctx.needs_input_grad[2] else None,
            grad_bias * grad_output if ctx.needs_input_grad[3] else None,
            None,
            None,
        )
