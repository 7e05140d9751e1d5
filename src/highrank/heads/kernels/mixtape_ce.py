"""Fused, chunked cross-entropy of Mixtape with its gradient in closed form.

Mixtape (Yang, Luong, Salakhutdinov & Le, NeurIPS 2019; the layer is ``heads/mixtape.py``)
in the notation of that module, for one context (token row) i, dropped below:

    h_k, k = 1..4      component contexts tanh(H_k g + a_k)              (4, d)
    s_j, j = 1..3      shared pre-activation priors u_j . g              (3,)
    t_j                gate features tanh(U_j g + c_j)                   (3, gate_dim)
    w_x, b_x           decoder row and bias of token x; v_x, b_{x,j} its gate (x < S)

The sigmoid tree (paper Sec. 3.2) mixes four values c_k with gates gamma = sigmoid(l) as
three lerps,

    T(gamma; c) = g1 A + (1 - g1) B,   A = g2 c1 + (1 - g2) c2,   B = g3 c3 + (1 - g3) c4,

and the logits are (vector gating for the S frequent tokens, gate sharing for the rest):

    z_x = T(gamma_x; (h_k . w_x)_k) + b_x,  gamma_x = sigmoid(v_x . t_j + s_j + b_{x,j})  x < S
    z_x = w_x . m + b_x,   m = T(gamma_s; h),  gamma_s = sigmoid(s)                       x >= S

so the rare block is an ordinary softmax-layer matmul with one mixed context m per row.
Gaussian gate noise (paper Sec. 3.4), when on, is added to both pre-activations before the
sigmoid, drawn in the order and layout the generic path draws it (per chunk: the shared
(c, 3), then the frequent (c, 3, S), permuted afterwards to the gate-major layout below), so
a seeded fused run draws the very same noise.

The loss is ``F.cross_entropy`` of z with label smoothing eps, weighted by w = 0 for
ignored targets and 1 otherwise:

    loss = w [ logsumexp(z) - (1 - eps) z_target - eps mean_v z_v ]
    G = d loss / d z = w [ softmax(z) - (1 - eps) onehot(target) - eps / V ]

and G goes back through the tree in closed form (per mixed value, upstream gradient G):

    dA = g1 G,   dB = (1 - g1) G,   d g1 = G (A - B)
    d c1 = g2 dA,   d c2 = (1 - g2) dA,   d g2 = dA (c1 - c2)
    d c3 = g3 dB,   d c4 = (1 - g3) dB,   d g3 = dB (c3 - c4)
    d l_j = d g_j g_j (1 - g_j)

Frequent block (x < S): the values are the component logits c_k = h_k . w_x, so
d h_k = sum_x d c_{k,x} w_x and d w_x = sum_k d c_{k,x} h_k; d l_{x,j} gives d v_x, d t_j,
d b_{x,j} and (summed over x) d s_j. Rare block (x >= S): d m = sum_x G_x w_x,
d w_x = G_x m, then m = T(gamma_s; h) backward with values h_k (d g summed over the d units).

Chunk by chunk, as ``mixture_ce.py``: the forward pass computes every gradient, reusing
one ``(c, V)`` buffer for the logits, their softmax and G. The frequent block is laid out
gate-major, ``(4, c, S)`` component logits and ``(3, c, S)`` gates, so that each comes from
one matmul and each gate is a contiguous block; its backward overwrites the component logits
with their gradients, so at its peak a chunk holds V + 12 S values per token (S = 0.1 V for
language modelling). Per chunk: three matmuls with the rare rows of the decoder, three with
the frequent rows (4 c rows each), three with the token gates. Nothing of size N x V is
allocated and nothing is recomputed; backward only scales the stored gradients.

``MIXTAPE_LOSS`` is Mixtape's ``LossKernel``: it takes the activations above from the head
(only they are differentiated by autograd) and calls ``mixtape_cross_entropy_sum``.
"""

from __future__ import annotations

import torch

from highrank.heads.kernels.chunking import LossKernel, chunk_slices
from highrank.heads.kernels.fused import fused_loss

N_GATES = 3
# The fused loss's "auto" chunks hold at least this many tokens. Each chunk makes three passes
# over the V x d decoder (its logits, d m and the decoder gradient), so small chunks are bound
# by memory traffic, not arithmetic: at V = 100,000 (1400 tokens, one thread, shared machine)
# a step took 1.12x a naive softmax with 20-token chunks (2**21 values would give 9 tokens),
# 1.06x with 40, 0.95x with 80, 0.84x with 128, 0.91x with 256
# (benchmarks/results/heads-mixtape-fused/chunk-sweep-V100000.md), while 128 tokens of
# V + 12 S float32 values are 107 MiB there (S = 10,000).
MIN_AUTO_CHUNK_TOKENS = 128
# At its peak a chunk holds V logits plus this many values per frequent id: 4 component
# logits (then their gradients), 3 gates, the tree's inner lerps A - B and B, 3 gate gradients.
VALUES_PER_FREQUENT_ID = 12


class MixtapeLoss(LossKernel):
    """Mixtape's fused loss (module docstring), from the head's contexts h_k, gate features
    t_j and shared pre-activations u_j . g."""

    min_chunk_tokens = MIN_AUTO_CHUNK_TOKENS

    def __call__(self, head, rows, target, masks, chunk_size, label_smoothing, ignore_index):
        component_mask, gate_mask = masks
        token_gate, token_gate_bias = head.token_gate, head.token_gate_bias
        if head.n_frequent:
            features = head._features(rows, gate_mask)
        else:  # no token has its own gate: U_j, c_j, v_x, b_{x,j} unused, as in the logits
            features = rows.new_zeros(rows.shape[0], N_GATES, head.gate_dim)
            token_gate, token_gate_bias = token_gate.detach(), token_gate_bias.detach()
        return mixtape_cross_entropy_sum(
            head._contexts(rows, component_mask),
            features,
            head.context_gate(rows),
            token_gate,
            token_gate_bias,
            head.weight,
            head.bias,
            target,
            chunk_size,
            label_smoothing=label_smoothing,
            ignore_index=ignore_index,
            gate_noise=head._gate_noise_std(),  # 0 in eval mode or once switched off
        )


MIXTAPE_LOSS = MixtapeLoss()

# Inputs that can need a gradient, in the order of ``mixtape_cross_entropy_sum``.
_DIFFERENTIABLE = (
    "contexts",
    "features",
    "shared_pre",
    "token_gate",
    "token_gate_bias",
    "weight",
    "bias",
)


def mixtape_cross_entropy_sum(
    contexts: torch.Tensor,
    features: torch.Tensor,
    shared_pre: torch.Tensor,
    token_gate: torch.Tensor,
    token_gate_bias: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    target: torch.Tensor,
    chunk_size: int,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    gate_noise: float = 0.0,
) -> torch.Tensor:
    """Summed Mixtape loss (scalar) of ``target (N,)``; gradients computed in the forward pass.

    contexts: (N, 4, d) h_k; features: (N, 3, gate_dim) t_j (unused when S = 0);
    shared_pre: (N, 3) u_j . g; token_gate: (S, gate_dim) v_x; token_gate_bias: (S, 3)
    b_{x,j}; weight: (V, d) decoder E, frequent ids first; bias: (V,) decoder bias.
    Targets equal to ``ignore_index`` count zero; ``label_smoothing`` as ``F.cross_entropy``;
    ``gate_noise``: std of the Gaussian noise on the pre-activation priors (0: none).
    """
    _check_shapes(contexts, features, shared_pre, token_gate, token_gate_bias, weight, bias)
    inputs = (contexts, features, shared_pre, token_gate, token_gate_bias, weight, bias, target)
    options = (chunk_size, float(label_smoothing), ignore_index, float(gate_noise))
    return _mixtape_cross_entropy(*inputs, *options)


def _check_shapes(contexts, features, shared_pre, token_gate, token_gate_bias, weight, bias):
    n, k, d = contexts.shape
    s, gate_dim = token_gate.shape
    expected = {
        "contexts": (n, 4, d),
        "features": (n, 3, gate_dim),
        "shared_pre": (n, 3),
        "token_gate_bias": (s, 3),
        "weight": (weight.shape[0], d),
        "bias": (weight.shape[0],),
    }
    actual = {
        "contexts": contexts,
        "features": features,
        "shared_pre": shared_pre,
        "token_gate_bias": token_gate_bias,
        "weight": weight,
        "bias": bias,
    }
    for name, shape in expected.items():
        if tuple(actual[name].shape) != shape:
            raise ValueError(
                f"mixtape_cross_entropy_sum: {name} has shape {tuple(actual[name].shape)}; "
                f"expected {shape}"
            )
    if s > weight.shape[0]:
        raise ValueError(f"{s} frequent token gates for a vocabulary of {weight.shape[0]}")


# ---- one chunk ------------------------------------------------------------------------------


def _tree_mix(gates, values, dim):
    """T(gamma; c) and its inner lerps A, B (kept for the backward pass), along ``dim``:
    gates (.., 3, ..) (broadcast over the values' other sizes), values (.., 4, ..)."""
    g1, g2, g3 = gates.unbind(dim)
    c1, c2, c3, c4 = values.unbind(dim)
    upper, lower = torch.lerp(c2, c1, g2), torch.lerp(c4, c3, g3)  # A, B
    return torch.lerp(lower, upper, g1), upper, lower


def _tree_backward(gates, values, upper, lower, grad_out, dim, *, overwrite_values=False):
    """Gradients of T(gamma; c) for upstream ``grad_out``: d values (the values' shape) and
    d gamma (3 along ``dim``; the gates' sigmoid derivative is left to the caller), slot by
    slot (the module docstring's equations). ``upper`` is overwritten by A - B, and with
    ``overwrite_values`` the values by their gradient (no second (c, 4, S) tensor)."""
    g1, g2, g3 = gates.unbind(dim)
    c1, c2, c3, c4 = values.unbind(dim)
    grad_values = values if overwrite_values else torch.empty_like(values)
    shape = list(values.shape)
    shape[dim] = 3
    grad_gammas = values.new_empty(shape)
    d1, d2, d3, d4 = grad_values.unbind(dim)
    e1, e2, e3 = grad_gammas.unbind(dim)
    torch.sub(c1, c2, out=e2)  # the values' last use: their slots are free from here on
    torch.sub(c3, c4, out=e3)
    grad_upper = torch.mul(grad_out, g1, out=d2)  # dA = g1 G, held in d c2's slot
    grad_lower = torch.sub(grad_out, grad_upper, out=d4)  # dB = (1 - g1) G, in d c4's
    torch.mul(grad_out, upper.sub_(lower), out=e1)  # d g1 = G (A - B)
    e2.mul_(grad_upper)  # d g2 = dA (c1 - c2)
    e3.mul_(grad_lower)  # d g3 = dB (c3 - c4)
    torch.mul(grad_upper, g2, out=d1)  # d c1 = g2 dA
    d2.sub_(d1)  # d c2 = (1 - g2) dA
    torch.mul(grad_lower, g3, out=d3)  # d c3 = g3 dB
    d4.sub_(d3)  # d c4 = (1 - g3) dB
    return grad_values, grad_gammas


def _noisy_(pre_activation, gate_noise, draw_shape, dims):
    """Adds gate noise in place. The noise is drawn in the generic path's layout
    ``draw_shape`` (so that a seeded run draws the same numbers) and permuted by ``dims``."""
    if gate_noise != 0.0:
        noise = torch.randn(draw_shape, dtype=pre_activation.dtype, device=pre_activation.device)
        pre_activation.add_(noise.permute(dims), alpha=gate_noise)
    return pre_activation


def _softmax_cross_entropy_(logits, target, kept, eps):
    """Per-row loss ``(c,)`` of logits ``(c, V)``, which are overwritten by d loss / d logits
    = kept [softmax - (1 - eps) onehot(target) - eps / V] (as ``mixture_ce`` with K = 1)."""
    c, n_vocab = logits.shape
    target_logit = logits.gather(1, target.unsqueeze(1)).squeeze(1)
    logit_mean = logits.mean(dim=1) if eps != 0.0 else None
    row_max = logits.amax(dim=1, keepdim=True)
    probs = logits.sub_(row_max).exp_()  # in place: unnormalised probabilities
    normaliser = probs.sum(dim=1)
    log_normaliser = row_max.squeeze(1) + normaliser.log()
    loss = log_normaliser - target_logit
    if eps != 0.0:
        loss = (1.0 - eps) * loss + eps * (log_normaliser - logit_mean)
    grad = probs.mul_((kept / normaliser).unsqueeze(1))
    if eps != 0.0:
        grad.sub_((kept * (eps / n_vocab)).unsqueeze(1))
    grad[torch.arange(c, device=logits.device), target] -= (1.0 - eps) * kept
    return torch.where(kept > 0, loss, 0.0)


def _chunk(rows, params, grads, part, target, kept, eps, gate_noise, buffer):
    """Loss sum of the rows ``part``; writes their gradients into ``grads``.

    rows: (contexts, features, shared_pre), all N rows; params: (token_gate, gate_bias_t
    (3, S), weight, bias) in the compute dtype; grads: the dict of full gradients."""
    token_gate, gate_bias_t, weight, bias = params
    h, t, s = (x[part] for x in rows)  # (c, 4, d), (c, 3, gate_dim), (c, 3)
    c, _, d = h.shape
    n_frequent = token_gate.shape[0]
    logits = buffer[:c]  # (c, V): frequent ids [:S], rare ids [S:]

    # Rare block (gate sharing): one prior per row, mixed context m = T(gamma_s; h).
    shared_gates = torch.sigmoid(_noisy_(s.clone(), gate_noise, (c, 3), (0, 1))).unsqueeze(2)
    mixed, shared_upper, shared_lower = _tree_mix(shared_gates, h, dim=1)  # (c, d)
    torch.addmm(bias[n_frequent:], mixed, weight[n_frequent:].t(), out=logits[:, n_frequent:])

    # Frequent block (vector gating): a prior per row and token, laid out gate-major,
    # (3 or 4, c, S), so that each comes from one matmul and each gate is a contiguous block.
    if n_frequent:
        frequent_rows = weight[:n_frequent]  # (S, d)
        h_major = h.transpose(0, 1).reshape(4 * c, d)  # rows (k, i)
        t_major = t.transpose(0, 1).reshape(3 * c, -1)  # rows (j, i)
        component = (h_major @ frequent_rows.t()).view(4, c, n_frequent)  # h_k . w_x
        pre = (t_major @ token_gate.t()).view(3, c, n_frequent)  # v_x . t_j
        pre += gate_bias_t.unsqueeze(1)  # + b_{x,j}
        pre += s.t().unsqueeze(2)  # + s_j
        gates = torch.sigmoid_(_noisy_(pre, gate_noise, (c, 3, n_frequent), (1, 0, 2)))
        mixed_logits, upper, lower = _tree_mix(gates, component, dim=0)  # (c, S)
        torch.add(mixed_logits, bias[:n_frequent], out=logits[:, :n_frequent])
        del mixed_logits

    loss = _softmax_cross_entropy_(logits, target[part], kept[part], eps)  # logits := G
    grad_rare, grad_frequent = logits[:, n_frequent:], logits[:, :n_frequent]

    grads["weight"][n_frequent:].addmm_(grad_rare.t(), mixed)  # d w_x = G_x m
    grads["bias"] += logits.sum(dim=0)
    grad_mixed = grad_rare @ weight[n_frequent:]  # d m: (c, d)
    grad_contexts, grad_gammas = _tree_backward(
        shared_gates, h, shared_upper, shared_lower, grad_mixed, dim=1
    )
    # (c, 3): summed over the d units sharing each gate, then through the sigmoid.
    grad_shared = torch.ops.aten.sigmoid_backward(grad_gammas.sum(dim=2), shared_gates.squeeze(2))
    if n_frequent:
        grad_component, grad_pre = _tree_backward(
            gates, component, upper, lower, grad_frequent, dim=0, overwrite_values=True
        )
        del upper, lower
        # d l = d gamma gamma (1 - gamma), in place: (3, c, S)
        torch.ops.aten.sigmoid_backward.grad_input(grad_pre, gates, grad_input=grad_pre)
        grad_component = grad_component.view(4 * c, n_frequent)
        grad_contexts += (grad_component @ frequent_rows).view(4, c, d).transpose(0, 1)
        grads["weight"][:n_frequent].addmm_(grad_component.t(), h_major)
        grad_pre_rows = grad_pre.view(3 * c, n_frequent)
        grad_features = (grad_pre_rows @ token_gate).view(3, c, -1)
        grads["features"][part] = grad_features.transpose(0, 1)
        grads["token_gate"].addmm_(grad_pre_rows.t(), t_major)
        grads["token_gate_bias"] += grad_pre.sum(dim=1).t()
        grad_shared += grad_pre.sum(dim=2).t()  # s_j is in every frequent pre-activation
    grads["contexts"][part] = grad_contexts
    grads["shared_pre"][part] = grad_shared
    return loss.sum()


def _loss_and_gradients(
    contexts,
    features,
    shared_pre,
    token_gate,
    token_gate_bias,
    weight,
    bias,
    target,
    chunk_size,
    eps,
    ignore_index,
    gate_noise,
) -> tuple[torch.Tensor, ...]:
    """(loss sum, then the gradient of every input of ``_DIFFERENTIABLE``), at least float32."""
    dtype = torch.promote_types(contexts.dtype, torch.float32)
    rows = tuple(x.to(dtype) for x in (contexts, features, shared_pre))
    params = (token_gate.to(dtype), token_gate_bias.to(dtype).t(), weight.to(dtype), bias.to(dtype))
    n = contexts.shape[0]
    grads = {
        "contexts": torch.empty_like(rows[0]),
        "features": torch.zeros_like(rows[1]),  # stays 0 when S = 0 (features unused)
        "shared_pre": torch.empty_like(rows[2]),
        "token_gate": torch.zeros_like(params[0]),
        "token_gate_bias": torch.zeros(token_gate_bias.shape, dtype=dtype, device=bias.device),
        "weight": torch.zeros_like(params[2]),
        "bias": torch.zeros_like(params[3]),
    }
    buffer = rows[0].new_empty(max(1, min(chunk_size, n)), weight.shape[0])
    kept = (target != ignore_index).to(dtype)  # (N,) 0 for ignored targets
    target = torch.where(target != ignore_index, target, 0)  # any valid id: weighted 0
    total = torch.zeros((), dtype=torch.float64, device=contexts.device)
    for part in chunk_slices(n, chunk_size):
        total += _chunk(rows, params, grads, part, target, kept, eps, gate_noise, buffer).double()
    return (total.to(dtype), *(grads[name] for name in _DIFFERENTIABLE))


# (loss sum, then the gradient of every input of ``_DIFFERENTIABLE``), at least float32.
_mixtape_cross_entropy = fused_loss(
    "mixtape_cross_entropy",
    _loss_and_gradients,
    tensors=(*_DIFFERENTIABLE, "target"),
    differentiable=len(_DIFFERENTIABLE),
    options=(
        ("chunk_size", "int"),
        ("label_smoothing", "float"),
        ("ignore_index", "int"),
        ("gate_noise", "float"),
    ),
)
