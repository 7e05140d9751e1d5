"""The gradient bottleneck: how much of the loss gradient on the logits an output layer can
pass back to the hidden state it reads.

(The idea is named after Godey & Artzi 2026, known to us second-hand; what follows is derived
here and is what the code computes.)

**The softmax head.** Logits ``z = W h + b`` (W: V x d), ``log p = z - lse(z) 1``, loss
``-log p_y``. The gradient of the loss with respect to the logits is

    g = p - e_y                     (V-dim; 1^T g = 0 since sum p = 1)

and the gradient that reaches h is ``W^T g``. ``W^T`` annihilates the part of g orthogonal to
the column space of W, so the part of g that *passes* is its projection onto col(W) and the
rest is lost. The first formula that comes to mind is ``||P_W g||^2 / ||g||^2``, with
``P_W`` the orthogonal projector onto col(W).

**Why 1 joins W.** That formula depends on how the logits are written, not only on the
model: ``W`` and ``W + 1 c^T`` give the same distributions for every h (the logits move by
``(c . h) 1``, which ``lse`` cancels), the same gradient ``W^T g = (W + 1 c^T)^T g`` (as
``1^T g = 0``), but different projectors. (V = 2, d = 1, W = (1, 0)^T: any g = (a, -a)
reaches h, yet ``||P_W g||^2 / ||g||^2 = 1/2``; with W = (1/2, -1/2)^T, an equal model, it is
1.) Since every g lies in ``1^⊥``, the quantity that depends on the model alone asks which
part of g *within 1^⊥* is annihilated: the null space of ``g -> W^T g`` on ``1^⊥`` is
``1^⊥ ∩ col(W)^⊥``, whose orthogonal complement in ``1^⊥`` is ``col(C W)``, with
``C = I - 1 1^T / V`` the centring projector. So the **share** is

    share(h, y) = ||P_{CW} g||^2 / ||g||^2  =  ||P_{[W, 1]} g||^2 / ||g||^2,

the W-projection formula with the column 1 added to W (for g ⟂ 1 the two right-hand forms
are equal). It equals ``||P_W g||^2 / ||g||^2`` whenever 1 ∈ col(W) or W's
columns are centred (``1^T W = 0``), and otherwise exceeds it by ``(r . g)^2 / ||g||^2`` for
the one unit vector r along the part of 1 outside col(W). Records of linear heads give both
(``share`` and ``share_w``, the literal ``||P_W g||^2 / ||g||^2``). d >= V - 1 with C W of
rank V - 1 gives share 1; W of rank 1, W = w a^T with 1^T w = 0, gives ``(w . g)^2 /
(||w||^2 ||g||^2)``, the share of g along that one direction.

**Any head.** A high-rank head (MoS, MoC, Mixtape, SigSoftmax, ...) has no single W: its
log-probabilities ``l(h) = log p(. | h)`` are a nonlinear function of h. Take ``l`` itself as
the logits (``softmax(l) = p``, so the gradient on them is the same ``g = p - e_y``) and its
Jacobian ``J = dl/dh`` (V x d_in) at this context as the effective output matrix: the
gradient that reaches h is ``J^T g``. Any other choice of logits ``l + c(h) 1`` changes J by
``1 (grad c)^T``, which ``C`` removes, so

    share(h, y) = ||P_{CJ} g||^2 / ||g||^2.

For the softmax head ``J = (I - 1 p^T) W`` and ``C J = C W``: the Jacobian gives exactly the
closed form above (tests/analysis/test_gradient_bottleneck.py checks it), for any head whose
decoder is linear. J is computed in the head's eval mode, for a chunk of tokens at a time: in
closed form for MoS with the paper's contexts (:func:`mos_jacobians`), otherwise with
``torch.func.jacfwd`` (d_in forward-mode passes, cheaper than V reverse ones), vmapped.

**Numerics.** g is formed from the log-probs in float64 with ``g_y = expm1(l_y)`` (exact when
p_y is near 1, where ``p_y - 1`` would cancel); a token with ``g = 0`` has nothing to pass and
is counted, not averaged. The projector's basis: for a linear head, the eigenvectors of the
float64 Gram matrix ``(CW)^T (CW)`` with eigenvalues above the square of the Press threshold
of W's dtype (:func:`~highrank.analysis.rank.press_threshold`); ``U = CW V diag(s)^-1``
(V x r), and ``||P g||^2 = ||U^T g||^2`` (the product in W's precision: for a float32 W
shares are good to about 1e-6). For a Jacobian, per token the same rule on ``(CJ)^T (CJ)``:
``||P g||^2 = sum_{lambda_i > tau^2} (v_i . (CJ)^T g)^2 / lambda_i``.

**Over a text.** Per token shares; the record gives their token-weighted mean, median and
quantiles, and the energy-weighted share ``sum ||P g||^2 / sum ||g||^2`` (the share of the
whole text's logit gradient), over the first ``max_tokens`` contexts.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from highrank.analysis.contexts import count_contexts, load_run_split
from highrank.analysis.head_inputs import (
    highrank_head,
    iter_causal_lm_head_inputs,
    iter_run_head_inputs,
    output_linear,
)
from highrank.analysis.hf_contexts import count_text_contexts, hf_tag, load_text_contexts
from highrank.analysis.rank import press_threshold
from highrank.heads.mos import MixtureOfSoftmaxes
from highrank.heads.softmax import Softmax
from highrank.util.progress import progress_bar

DEFAULT_MAX_TOKENS = 2048
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
# (tokens x d_in x logits per token) float32 values a Jacobian chunk may hold at once
JACOBIAN_CHUNK_ELEMENTS = 2**25


class GradientBottleneckError(ValueError):
    """Inputs the gradient bottleneck cannot be measured on."""


# ---- the gradient on the logits --------------------------------------------------------------


def logit_gradients(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``g = p - e_y`` (float64, ``(n, V)``) from normalised ``log_probs (n, V)``; the target
    entry is ``expm1(log p_y)``, exact when p_y is close to 1."""
    if log_probs.ndim != 2 or targets.shape != log_probs.shape[:1]:
        raise GradientBottleneckError(
            f"expected log-probs (n, V) and targets (n,); got {tuple(log_probs.shape)} and "
            f"{tuple(targets.shape)}"
        )
    log_probs = log_probs.double()
    g = log_probs.exp()  # (n, V)
    rows = torch.arange(g.shape[0])
    g[rows, targets] = torch.expm1(log_probs[rows, targets])
    return g


# ---- a linear decoder: one basis for every token ---------------------------------------------


def centred(matrix: torch.Tensor) -> torch.Tensor:
    """``C M``: each column of ``matrix (V, k)`` minus its mean over the V rows."""
    return matrix - matrix.mean(dim=0, keepdim=True)


def column_basis(matrix: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An orthonormal basis ``(V, r)`` float64 of the column space of ``matrix (V, k)``,
    from the eigenvectors of its float64 Gram matrix whose singular values lie above the
    Press threshold of ``dtype`` (default: the matrix's own)."""
    dtype = dtype or matrix.dtype
    a = matrix.detach().double()  # (V, k)
    eigenvalues, vectors = torch.linalg.eigh(a.T @ a)  # ascending, (k,), (k, k)
    s = eigenvalues.clamp(min=0).sqrt()
    if float(s[-1]) == 0.0:
        raise GradientBottleneckError(f"the output matrix {tuple(matrix.shape)} is zero")
    tau = press_threshold(tuple(a.shape), float(s[-1]), dtype)
    keep = s > tau
    return (a @ vectors[:, keep]) / s[keep]  # (V, r)


def projected_shares(
    g: torch.Tensor, basis: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``||U^T g_i||^2 / ||g_i||^2`` per row of ``g (n, V)`` for an orthonormal ``basis (V,
    r)`` (float64 result; the product in ``dtype``); rows with ``g = 0`` give nan."""
    passed = (g.to(dtype) @ basis.to(dtype)).double().square().sum(dim=1)  # (n,)
    total = g.square().sum(dim=1)
    return torch.where(total > 0, passed / total, torch.full_like(total, float("nan")))


class LinearBasis:
    """The projectors of a linear decoder ``W (V, d)``: onto col(CW) (``share``) and col(W)
    (``share_w``, the literal formula; see the module docstring)."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.ndim != 2:
            raise GradientBottleneckError(
                f"expected a decoder matrix (V, d); got shape {tuple(weight.shape)}"
            )
        weight = weight.detach().cpu()  # the shares are computed on the CPU
        self.shape = tuple(weight.shape)
        # the products in the decoder's own precision (float32 for a float32 or bf16 one)
        self.dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        self.centred = column_basis(centred(weight.double()), dtype=weight.dtype)  # (V, r)
        self.plain = column_basis(weight, dtype=weight.dtype)  # (V, r')

    def shares(self, log_probs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        g = logit_gradients(log_probs, targets)
        return {
            "share": projected_shares(g, self.centred, self.dtype),
            "share_w": projected_shares(g, self.plain, self.dtype),
            "g_energy": g.square().sum(dim=1),
            "nll": -log_probs.double()[torch.arange(len(targets)), targets],
        }


# ---- any head: the Jacobian of its log-probs -------------------------------------------------


def head_jacobians(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``(n, V, d_in)`` Jacobians of ``head.log_prob`` at each row of ``hidden (n, d_in)``
    (the head in eval mode, so no dropout): closed form for MoS with the paper's contexts
    (:func:`mos_jacobians`), forward mode (``torch.func.jacfwd``, vmapped) for any head."""
    from torch.func import jacfwd, vmap

    if _closed_form_mos(head):
        return mos_jacobians(head, hidden)

    def log_prob(row: torch.Tensor) -> torch.Tensor:  # (d_in,) -> (V,)
        return head.log_prob(row[None])[0]

    try:
        with torch.no_grad():  # forward mode only: no graph over the parameters
            return vmap(jacfwd(log_prob))(hidden.detach())
    except RuntimeError as error:
        if "functorch" not in str(error) and "setup_context" not in str(error):
            raise
        raise GradientBottleneckError(
            f"the {type(head).__name__} head uses an autograd.Function that torch.func "
            "cannot differentiate in forward mode; its Jacobian is not available"
        ) from None


def _closed_form_mos(head: nn.Module) -> bool:
    return type(head) is MixtureOfSoftmaxes and head.residual_branch is None and not head.training


@torch.no_grad()
def mos_jacobians(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``(n, V, d_in)`` Jacobians of a MoS head's log-probs (Yang et al. 2018, Eq. 3, eval
    mode), in closed form. With ``pi = softmax(P g)``, ``h_k = tanh(A_k g + a_k)``,
    ``q_k = softmax(E h_k + b)``, ``log p = log sum_k pi_k q_k`` and the responsibilities
    ``r_kv = pi_k q_kv / p_v``:

        d log p_v / dg = sum_k r_kv [ (P_k - pi^T P) + (E_v - q_k^T E) diag(1 - h_k^2) A_k ]

    one (V x d_embed) by (d_embed x K d_in) product per token instead of d_in forward passes
    of the head (tests check it against ``jacfwd``). Computed in the head's dtype, float32 at
    least (a half-precision head's parts are raised to float32, a float64 head stays float64)."""
    n, k, d_embed = hidden.shape[0], head.n_components, head.d_embed
    dtype = torch.promote_types(head.weight.dtype, torch.float32)
    log_prior = torch.log_softmax(head.prior(hidden).to(dtype), dim=-1)  # (n, K)
    latents = torch.tanh(head.latent(hidden)).view(n, k, d_embed)  # (n, K, de)
    log_q = torch.log_softmax(head._decoder_logits(latents).to(dtype), dim=-1)  # (n, K, V)
    latents = latents.to(dtype)
    joint = log_prior[:, :, None] + log_q  # (n, K, V)
    r = (joint - torch.logsumexp(joint, dim=1, keepdim=True)).exp()  # (n, K, V)
    prior = head.prior.weight.to(dtype)  # (K, d_in)
    c = prior[None] - (log_prior.exp() @ prior)[:, None]  # (n, K, d_in): d log pi_k / dg
    a = head.latent.weight.to(dtype).view(k, d_embed, -1)  # (K, de, d_in)
    b = (1 - latents.square())[..., None] * a[None]  # (n, K, de, d_in): d h_k / dg
    # E B_k for every token and component: one (V, de) @ (de, n K d_in) product
    eb = head.weight.to(dtype) @ b.permute(2, 0, 1, 3).reshape(d_embed, -1)  # (V, n K d_in)
    eb = eb.view(-1, n, k, b.shape[-1])  # (V, n, K, d_in)
    qeb = torch.einsum("nkv,vnke->nke", log_q.exp(), eb)  # (n, K, d_in): q_k^T E B_k
    mixed = (r.permute(2, 0, 1)[..., None] * eb).sum(dim=2).permute(1, 0, 2)  # (n, V, d_in)
    return mixed + torch.einsum("nkv,nke->nve", r, c - qeb)


def jacobian_shares(jacobians: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``||P_{CJ} g||^2 / ||g||^2`` per token, for ``jacobians (n, V, d)`` and ``g (n, V)``."""
    cj = centred_batch(jacobians.detach().double())  # (n, V, d)
    gram = cj.transpose(1, 2) @ cj  # (n, d, d)
    eigenvalues, vectors = torch.linalg.eigh(gram)  # (n, d), (n, d, d)
    s = eigenvalues.clamp(min=0).sqrt()
    shape = tuple(jacobians.shape[1:])
    tau = torch.tensor(
        [press_threshold(shape, float(top), jacobians.dtype) for top in s[:, -1]],
        dtype=torch.float64,
    )
    keep = s > tau[:, None]  # (n, d)
    coefficients = (vectors.transpose(1, 2) @ (cj.transpose(1, 2) @ g[:, :, None]))[:, :, 0]
    safe = torch.where(keep, eigenvalues, torch.ones_like(eigenvalues))
    passed = torch.where(keep, coefficients.square() / safe, torch.zeros_like(safe)).sum(dim=1)
    total = g.square().sum(dim=1)
    return torch.where(total > 0, passed / total, torch.full_like(total, float("nan")))


def centred_batch(jacobians: torch.Tensor) -> torch.Tensor:
    """``C J`` for a batch ``(n, V, d)``: every column minus its mean over V."""
    return jacobians - jacobians.mean(dim=1, keepdim=True)


def jacobian_chunk_tokens(head: nn.Module) -> int:
    """Tokens per Jacobian chunk: about :data:`JACOBIAN_CHUNK_ELEMENTS` values of
    ``(tokens, d_in, logits per token)`` at once."""
    per_token = head.d_in * head.logits_per_token()
    return max(1, JACOBIAN_CHUNK_ELEMENTS // max(1, per_token))


def head_shares(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """Per-token shares of any highrank head on ``hidden (n, d_in)`` with ``targets (n,)``,
    through the Jacobian of its log-probs."""
    device = head.weight.device
    with torch.no_grad():
        log_probs = head.log_prob(hidden.to(device)).cpu()  # (n, V)
    g = logit_gradients(log_probs, targets.cpu())
    jacobians = head_jacobians(head, hidden.to(device)).cpu()  # (n, V, d_in)
    return {
        "share": jacobian_shares(jacobians, g),
        "g_energy": g.square().sum(dim=1),
        "nll": -log_probs.double()[torch.arange(len(targets)), targets],
    }


def linear_decoder(head: nn.Module) -> torch.Tensor | None:
    """The matrix a plain softmax head's logits are linear in (``E``, or ``E P`` with its
    projection), or None for any other head (those go through the Jacobian)."""
    if type(head) is not Softmax:
        return None
    weight = head.weight.detach()
    if head.projection is not None:
        weight = weight @ head.projection.weight.detach()  # (V, d_embed) @ (d_embed, d_in)
    return weight


# ---- a text: per-token shares, then the summary ----------------------------------------------


class ShareTally:
    """Per-token shares gathered over blocks, summarised by :meth:`summary`."""

    def __init__(self) -> None:
        self.parts: dict[str, list[torch.Tensor]] = {}

    def add(self, values: dict[str, torch.Tensor]) -> None:
        for key, tensor in values.items():
            self.parts.setdefault(key, []).append(tensor.detach().double().cpu())

    def summary(self) -> dict[str, Any]:
        columns = {key: torch.cat(parts).numpy() for key, parts in self.parts.items()}
        if not columns:
            raise GradientBottleneckError("no tokens were read")
        energy = columns["g_energy"]
        live = energy > 0
        out: dict[str, Any] = {
            "n_tokens": int(energy.size),
            "tokens_with_zero_gradient": int((~live).sum()),
            "mean_nll": float(columns["nll"].mean()),
        }
        for key in ("share", "share_w"):
            if key in columns:
                out[key] = summarise(columns[key][live], energy[live])
        return out


def summarise(shares: np.ndarray, energy: np.ndarray) -> dict[str, Any]:
    """Token-weighted mean, quantiles and the energy-weighted share of per-token ``shares``
    whose ``||g||^2`` are ``energy``."""
    if shares.size == 0:
        raise GradientBottleneckError("every token had a zero gradient: nothing to share")
    return {
        "mean": float(shares.mean()),
        "quantiles": {str(q): float(np.quantile(shares, q)) for q in QUANTILES},
        "median": float(np.median(shares)),
        "min": float(shares.min()),
        "max": float(shares.max()),
        "energy_weighted": float((shares * energy).sum() / energy.sum()),
    }


def shares_of_blocks(
    head: nn.Module | None,
    basis: LinearBasis | None,
    blocks: Iterator[tuple[torch.Tensor, torch.Tensor]],
    *,
    total: int,
    log_probs_of=None,
    progress: bool = False,
) -> dict[str, Any]:
    """Shares over ``(hidden (b, d), targets (b,))`` blocks: by ``basis`` (a linear decoder;
    ``log_probs_of(hidden)`` gives the rows) or else by the Jacobian of ``head``."""
    tally = ShareTally()
    with progress_bar(total=total, desc="gradient shares", unit="tok", disable=not progress) as bar:
        for hidden, targets in blocks:
            if basis is not None:
                with torch.no_grad():
                    tally.add(basis.shares(log_probs_of(hidden), targets))
            else:
                step = jacobian_chunk_tokens(head)
                for start in range(0, len(targets), step):
                    part = slice(start, start + step)
                    tally.add(head_shares(head, hidden[part], targets[part]))
                    bar.update(len(targets[part]))
                continue
            bar.update(len(targets))
    return tally.summary()


def analyze_gradient_bottleneck_run(
    run_dir: str | os.PathLike,
    *,
    split: str = "test",
    which: str = "best",
    data_dir: str | os.PathLike | None = None,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> dict[str, Any]:
    """The gradient bottleneck of a run's checkpoint ``which`` on the first ``max_tokens``
    contexts of ``split``: closed form for a plain softmax head, the Jacobian otherwise."""
    began = time.perf_counter()
    loaded = load_run_split(run_dir, split, which=which, data_dir=data_dir, device=device)
    head = loaded.model.head.eval()
    weight = linear_decoder(head)
    basis = LinearBasis(weight) if weight is not None else None
    total = count_contexts(len(loaded.ids))
    total = total if max_tokens is None else min(total, max_tokens)
    blocks = iter_run_head_inputs(loaded, max_contexts=max_tokens, progress=False)

    def log_probs_of(hidden: torch.Tensor) -> torch.Tensor:  # (b, d_in) on the CPU -> (b, V)
        return head.log_prob(hidden.to(head.weight.device)).cpu()

    summary = shares_of_blocks(
        head, basis, blocks, total=total, log_probs_of=log_probs_of, progress=progress
    )
    return {
        "kind": "gradient-bottleneck",
        "run_dir": str(run_dir),
        "checkpoint": which,
        "split": split,
        "source": loaded.source,
        "head": loaded.config.head.name,
        "d_in": head.d_in,
        "vocab_size": head.vocab_size,
        "method": _method(basis),
        "max_tokens": max_tokens,
        **summary,
        "seconds": round(time.perf_counter() - began, 2),
        "threads": torch.get_num_threads(),
    }


def analyze_gradient_bottleneck_hf(
    model_path: str | os.PathLike,
    text_path: str | os.PathLike,
    *,
    window: int | None = None,
    bos: bool = False,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> dict[str, Any]:
    """The gradient bottleneck of a Hugging Face causal LM on the first ``max_tokens``
    contexts of a text: its linear lm_head in closed form, or the highrank head attached to
    it (``integrations.hf``) as a run's head (closed form for a softmax, else the Jacobian)."""
    began = time.perf_counter()
    loaded = load_text_contexts(
        model_path, text_path, window=window, bos=bos, device=device, progress=progress
    )
    load_seconds = time.perf_counter() - began
    head = highrank_head(loaded.model)
    if head is not None:
        head.eval()
        weight = linear_decoder(head)
        basis = LinearBasis(weight) if weight is not None else None

        def log_probs_of(hidden: torch.Tensor) -> torch.Tensor:  # (b, d_in) -> (b, V)
            return head.log_prob(hidden.to(head.weight.device)).cpu()

        d_in, vocab_size = head.d_in, head.vocab_size
    else:
        linear = output_linear(loaded.model, loaded.name)
        basis = LinearBasis(linear.weight)

        def log_probs_of(hidden: torch.Tensor) -> torch.Tensor:  # (b, d) -> (b, V), f64 lse
            logits = linear(hidden.to(linear.weight.device, linear.weight.dtype)).double()
            return torch.log_softmax(logits, dim=-1).cpu()

        vocab_size, d_in = linear.weight.shape
    basis_seconds = time.perf_counter() - began - load_seconds
    blocks = iter_causal_lm_head_inputs(loaded, max_contexts=max_tokens)
    total = count_text_contexts(loaded.ids.numel(), max_tokens)
    summary = shares_of_blocks(
        head, basis, blocks, total=total, log_probs_of=log_probs_of, progress=progress
    )
    return {
        "kind": "gradient-bottleneck",
        "tag": hf_tag(model_path, text_path, window=window, bos=bos, max_contexts=max_tokens),
        **loaded.record(max_tokens),
        "head": loaded.model.config.head_name if head is not None else "lm_head",
        "d_in": int(d_in),
        "vocab_size": int(vocab_size),
        "method": _method(basis),
        "max_tokens": max_tokens,
        **summary,
        "load_seconds": round(load_seconds, 2),
        "basis_seconds": round(basis_seconds, 2),
        "seconds": round(time.perf_counter() - began - load_seconds, 2),
        "threads": torch.get_num_threads(),
    }


def _method(basis: LinearBasis | None) -> str:
    if basis is not None:
        return (
            f"closed form: share = ||P_CW g||^2/||g||^2 with W {basis.shape[0]} x "
            f"{basis.shape[1]} (rank of CW {basis.centred.shape[1]}); share_w = "
            f"||P_W g||^2/||g||^2 (rank {basis.plain.shape[1]})"
        )
    return "Jacobian: share = ||P_CJ g||^2/||g||^2, J = d log p / d h per token (jacfwd)"
