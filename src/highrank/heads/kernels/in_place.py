"""Inference paths that overwrite their intermediates: the same values, fewer passes and buffers.

Taken only without gradients: where :func:`writable_in_place` allows (no autograd history,
no ``torch.func`` transform, no torch.compile trace) and not inside
``reference_paths()`` (:func:`may_write_in_place`). Each computes what the reference path it
replaces computes (tests/heads/test_reference.py): the normalisation and the sigmoid tree bit
for bit, MoS's mixture and Mixtape's assembled logits to rounding.

* ``log_softmax_fresh``: the softmax family's (and every single-softmax head's)
  normalisation, written over the logits;
* ``mixture_log_prob_``: MoS's mixture, K + 1 transcendentals per value, rows in cache;
* ``sigmoid_tree_mix_`` and ``mixtape_logits_``: Mixtape's logits assembled in one (N, V)
  buffer, the frequent block mixed in place.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from highrank.heads.functional import FEW_ROWS, linear
from highrank.heads.kernels.paths import fast_paths

N_GATES = 3  # Mixtape's sigmoid tree: 3 gates for 4 components


def eager_plain(tensor: torch.Tensor) -> bool:
    """Is ``tensor`` an eager tensor outside any ``torch.func`` transform (vmap, jvp, jacrev
    wrap their tensors, and their batching rules refuse ``out=`` ops and custom autograd
    functions alike), as the Jacobian instruments use? False while torch.compile traces too:
    the functorch check is opaque to Dynamo (a fullgraph compile would fail), and the compiled
    graph fuses the general path anyway."""
    if torch.compiler.is_compiling():
        return False
    return not torch._C._functorch.is_functorch_wrapped_tensor(tensor)


def writable_in_place(tensor: torch.Tensor) -> bool:
    """May an inference path overwrite ``tensor`` with ``out=`` ops? Only a plain tensor
    (:func:`eager_plain`) with no autograd history."""
    return not tensor.requires_grad and eager_plain(tensor)


def may_write_in_place(tensor: torch.Tensor) -> bool:
    """Take an in-place inference path over ``tensor``? Outside ``reference_paths()``, where
    :func:`writable_in_place` allows."""
    return fast_paths() and writable_in_place(tensor)


def log_softmax_fresh(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dimension of ``logits``, a fresh tensor nothing else
    holds: written over it where :func:`may_write_in_place` allows. A second
    (N, V) buffer is not free (its pages are faulted in on first write): at 256 rows,
    V = 49,152 the log-softmax into a new tensor took 79 ms, in place 29
    (benchmarks/results/inference-cost/profile-256.md)."""
    if may_write_in_place(logits):
        return torch.log_softmax(logits, dim=-1, out=logits)
    return F.log_softmax(logits, dim=-1)


# ``mixture_log_prob_`` mixes this many (K x V) values per chunk of rows (4 MiB of float32 per
# buffer at 2**20): every pass over a chunk after the first then reads it from the cache.
MIX_CHUNK_VALUES = 2**20


@torch.no_grad()
def mixture_log_prob_(
    log_prior: torch.Tensor, logits: torch.Tensor, chunk_values: int = MIX_CHUNK_VALUES
) -> torch.Tensor:
    """``log sum_k pi_k softmax(l_k)_v`` for inference; **overwrites** ``logits``.

    log_prior: (N, K) normalised; logits: (N, K, V) unnormalised -> (N, V) log-probabilities.

    What ``log_mixture(log_prior, log_softmax(logits))`` computes, with fewer passes and K + 1
    transcendentals per value instead of 3K - 2: per component e_k = exp(l_k - max l_k) (K exps per
    value; they also give the normalisers s_k = sum_v e_k), then the mixture p = sum_k (pi_k / s_k)
    e_k as a weighted sum (multiply-adds) and one log per value, where the log-space chain needs a
    log-softmax (K exps) and, for each k > 1, a logaddexp (an exp and a log1p). Rows go in chunks of
    about ``chunk_values`` K x V values on the CPU, so the passes run in the cache.

    Exactness: e_k <= 1 and pi_k / s_k <= 1, so nothing overflows; a term that underflows
    loses at most the smallest subnormal. Wherever the mixture is below ``exp(floor)``,
    floor = log(finfo.tiny) + 7 (-80.3 in float32), that loss could show, and those values
    alone are recomputed in log space (``logsumexp`` over k of l_k - max l_k + log pi_k -
    log s_k); above it the relative error is that of K rounded products, as in log space.
    No gradients: MoS calls this only where :func:`may_write_in_place` allows.
    """
    n, k, v = logits.shape
    out = logits.new_empty(n, v)
    rows = max(1, min(n, chunk_values // (k * v)))
    if logits.device.type != "cpu":  # one chunk: no CPU cache to fit, one underflow check
        rows = n
    exps = logits.new_empty(rows, k, v)  # reused by every chunk
    floor = math.log(torch.finfo(logits.dtype).tiny) + 7
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        _mix_chunk(
            log_prior[start:stop], logits[start:stop], exps[: stop - start], out[start:stop], floor
        )
    return out


def _mix_chunk(
    log_prior: torch.Tensor,
    logits: torch.Tensor,
    exps: torch.Tensor,
    out: torch.Tensor,
    floor: float,
) -> None:
    """One chunk of ``mixture_log_prob_``: logits (c, K, V) are shifted in place, exps (c, K,
    V) is scratch, out (c, V) receives the log-mixture."""
    logits.sub_(logits.amax(dim=-1, keepdim=True))  # l_k - max l_k <= 0
    torch.exp(logits, out=exps)  # e_k in (0, 1]
    log_weight = log_prior - exps.sum(dim=-1).log()  # (c, K): log pi_k - log s_k
    weight = log_weight.exp().unsqueeze(-1)  # (c, K, 1)
    torch.mul(exps[:, 0], weight[:, 0], out=out)
    for j in range(1, exps.shape[1]):
        out.addcmul_(exps[:, j], weight[:, j])
    out.log_()
    # One reduction tells whether any value lies where underflow could show (or comes from
    # -inf logits); the (c, V) mask is built only then, not for every chunk.
    if float(out.min()) < floor:
        row, col = (out < floor).nonzero(as_tuple=True)
        terms = logits[row, :, col] + log_weight[row]  # (n_low, K)
        out[row, col] = torch.logsumexp(terms, dim=-1)


def sigmoid_tree_mix_(
    pre_activation: torch.Tensor, values: torch.Tensor, *, out: torch.Tensor
) -> torch.Tensor:
    """``sigmoid_tree_mix`` for inference, into ``out (..., X)``, **overwriting** both inputs:
    the gates become sigmoid(pre_activation) in place and the inner lerps land in values'
    slices 2 and 4, so no (..., X) temporary is allocated. The same three lerps, so the same
    values bit for bit. pre_activation: (..., 3, X); values: (..., 4, X)."""
    g1, g2, g3 = pre_activation.sigmoid_().unbind(-2)
    c1, c2, c3, c4 = values.unbind(-2)
    c4.lerp_(c3, g3)  # g3 c3 + (1 - g3) c4
    c2.lerp_(c1, g2)  # g2 c1 + (1 - g2) c2
    return torch.lerp(c4, c2, g1, out=out)


def assembles_in_place(head, contexts: torch.Tensor) -> bool:
    """Does Mixtape assemble its logits with ``mixtape_logits_``? Where
    :func:`may_write_in_place` allows, and only in float32 or float64: the buffer takes the
    matmuls' results directly, so their dtype must be the widened one (a bf16 head keeps
    the general path)."""
    return (
        may_write_in_place(contexts)
        and head.weight.dtype in (torch.float32, torch.float64)
        and contexts.dtype == head.weight.dtype
    )


def mixtape_logits_(head, h, contexts, shared_pre, mixed, gate_mask) -> torch.Tensor:
    """Mixtape's logits (``Mixtape._logits_rows``) for inference, the same arithmetic without
    a ``cat`` or temporary sums: the rare block's matmul (bias included) writes into its
    columns of the output, and the frequent block's gates and component logits are mixed in
    place into the others. contexts (N, 4, d), shared_pre (N, 3, 1), mixed (N, d) -> (N, V)."""
    n, s, v = h.shape[0], head.n_frequent, head.vocab_size
    out = head.weight.new_empty(n, v)
    # Both decoder blocks run over id ranges widened to a multiple of GEMM_COLUMNS; the
    # rare block's extra ids are frequent ones, overwritten below.
    rare_start = max(0, v - _round_up(v - s, GEMM_COLUMNS))
    _addmm_into(out[:, rare_start:], mixed, head.weight[rare_start:], head.bias[rare_start:])
    if s == 0:
        return out
    features = head._features(h, gate_mask).view(n * N_GATES, head.gate_dim)
    token_pre = (features @ head.token_gate.t()).view(n, N_GATES, s)  # (N, 3, S)
    token_pre.add_(shared_pre).add_(head.token_gate_bias.t())
    frequent_rows = head.weight[: min(v, _round_up(s, GEMM_COLUMNS))]
    component_logits = linear(contexts, frequent_rows)[..., :s]  # (N, 4, S), ours
    frequent = out[:, :s]
    sigmoid_tree_mix_(head._noisy(token_pre), component_logits, out=frequent)
    frequent.add_(head.bias[:s])
    return out


# The CPU GEMM (MKL, AVX2, one thread) ran 1.5x slower per value when the number of output
# columns was not a multiple of 16: 44,237 rare ids 361 ms, 44,240 ids 245 ms (256 rows);
# 4,915 frequent ids 126 ms, 4,928 ids 81 ms (1,024 rows; `python -m
# benchmarks.heads.inference_cost --gemm-columns`). Mixtape's inference path computes a few more
# ids than it needs instead.
GEMM_COLUMNS = 16


def _round_up(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def _addmm_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    """``out (N, V') = x (N, d) weight^T + bias`` written into ``out``, a column block of a
    wider row-major buffer (BLAS takes its row stride as the leading dimension: no copy).
    For 2 to FEW_ROWS rows on the CPU as ``weight x^T`` (V', N), as ``functional.linear``
    does (streams the weight once), then copied: written straight into ``out.t()`` (column
    major) BLAS would compute it as ``x weight^T`` again, the slow way."""
    if x.device.type == "cpu" and 1 < x.shape[0] <= FEW_ROWS:
        out.copy_(torch.addmm(bias.unsqueeze(1), weight, x.t()).t())
    else:
        torch.addmm(bias, x, weight.t(), out=out)
