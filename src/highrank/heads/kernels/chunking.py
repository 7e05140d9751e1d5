"""Memory-bounded losses: process tokens in chunks so that no ``N x K x V`` tensor ever lives.

Two ways to bound memory, both used by ``OutputHead.loss(..., chunk_size=...)``:

* ``gradient_in_forward_nll``: for a *scalar* loss (sum or mean), each chunk's gradients with
  respect to its hidden rows and to the head's parameters are computed right away, during the
  forward pass, and the chunk's graph is freed. Backward then only scales the stored gradients
  by the incoming scalar. Same arithmetic as the unchunked loss (one forward and one backward
  per chunk, nothing recomputed), memory of one chunk plus one copy of the parameter
  gradients. The idea of fused linear cross-entropy kernels, applied to any head.
* ``checkpointed_nll``: for per-token losses (``reduction="none"``), whose backward weights each
  token differently, each chunk is recomputed in backward (activation checkpointing).

A head with a closed-form gradient declares a ``LossKernel`` (``OutputHead.loss_kernel``:
``mixture_ce.MIXTURE_LOSS``, ``mixtape_ce.MIXTAPE_LOSS``), which ``chunked_loss_sum`` runs for
the scalar loss instead of the generic gradient-in-forward chunks, except inside
``reference_paths()``. ``auto_chunk_tokens`` is the one chunk policy of ``chunk_size="auto"``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from highrank.heads.kernels.paths import fast_paths

NllRows = Callable[..., torch.Tensor]  # (rows (n, d), target (n,), *masks) -> nll (n,)
Masks = tuple[torch.Tensor | None, ...]

# ---- the chunk policy ---------------------------------------------------------------------

# "auto" chunk sizes, measured in benchmarks/results/heads-*: heads with a fused chunked loss
# (softmax, MoS, MoC) accumulate parameter gradients in place, so small chunks of about 2**21
# logits (8 MiB) cost nothing; the generic path allocates a full decoder gradient per chunk,
# so it takes fewer, larger chunks of 256 tokens.
AUTO_CHUNK_ELEMENTS = 2**21
GENERIC_AUTO_CHUNK_TOKENS = 256
# On a GPU each chunk is a handful of kernel launches, and 2**21 logits keep the chip idle:
# MoS (K = 15, V = 100,000, 1,400 tokens) took 107x a naive softmax on an H200 with one token
# per chunk (benchmarks/results/cuda-check/). There chunks hold about 2**26 logits (256 MiB
# in float32), still far below the (tokens x K x V) an unchunked mixture would hold.
CUDA_AUTO_CHUNK_ELEMENTS = 2**26


def auto_chunk_tokens(head, device: torch.device | str | None = None) -> int:
    """Tokens per chunk of ``head``'s loss under ``chunk_size="auto"``, for hidden states on
    ``device`` (the CPU's when None). With a fused loss: chunks of about
    ``AUTO_CHUNK_ELEMENTS`` of the head's ``logits_per_token()`` values
    (``CUDA_AUTO_CHUNK_ELEMENTS`` on a GPU), at least the kernel's ``min_chunk_tokens``. On
    the generic path: ``GENERIC_AUTO_CHUNK_TOKENS``, or on a GPU as many as hold
    ``CUDA_AUTO_CHUNK_ELEMENTS`` values if that is more."""
    cuda = device is not None and torch.device(device).type == "cuda"
    elements = CUDA_AUTO_CHUNK_ELEMENTS if cuda else AUTO_CHUNK_ELEMENTS
    kernel = active_loss_kernel(head)
    if kernel is not None:
        return max(kernel.min_chunk_tokens, elements // head.logits_per_token())
    if cuda:
        return max(GENERIC_AUTO_CHUNK_TOKENS, elements // head.logits_per_token())
    return GENERIC_AUTO_CHUNK_TOKENS


# ---- the scalar chunked loss: a head's kernel, or the generic path ------------------------


class LossKernel:
    """A fused chunked loss: ``kernel(head, rows, target, masks, chunk_size, label_smoothing,
    ignore_index)`` -> the summed loss of the valid ids ``target (N,)`` given the flattened
    hidden states ``rows (N, d_in)`` and the head's dropout masks, targets equal to
    ``ignore_index`` counting zero, with the same value and gradients as the generic path
    (closed-form gradients, computed in the forward pass)."""

    # "auto" chunks hold at least this many tokens (see ``auto_chunk_tokens``).
    min_chunk_tokens = 1

    def __call__(self, head, rows, target, masks, chunk_size, label_smoothing, ignore_index):
        raise NotImplementedError


def active_loss_kernel(head) -> LossKernel | None:
    """The head's fused loss, unless it has none or ``reference_paths()`` is on."""
    return head.loss_kernel if fast_paths() else None


def chunked_loss_sum(
    head,
    rows: torch.Tensor,
    target: torch.Tensor,
    masks: Masks,
    chunk_size: int,
    label_smoothing: float,
    ignore_index: int,
) -> torch.Tensor:
    """Summed loss of ``head``, ``chunk_size`` tokens at a time: its fused kernel, or the
    generic path (gradients computed in the forward pass; checkpointing under torch.compile)."""
    kernel = active_loss_kernel(head)
    if kernel is not None:
        return kernel(head, rows, target, masks, chunk_size, label_smoothing, ignore_index)
    token_losses = functools.partial(
        head._token_losses, label_smoothing=label_smoothing, ignore_index=ignore_index
    )
    if torch.compiler.is_compiling():
        # torch.compile cannot trace torch.autograd.grad inside a forward pass; it can
        # trace activation checkpointing: the same memory bound, one recomputation per chunk.
        return checkpointed_nll(token_losses, rows, target, masks, chunk_size).sum()
    params = [p for p in head.parameters() if p.requires_grad]
    return gradient_in_forward_nll(token_losses, rows, target, masks, params, chunk_size)


# ---- the generic pieces -------------------------------------------------------------------


def chunk_slices(n: int, chunk_size: int) -> list[slice]:
    return [slice(start, start + chunk_size) for start in range(0, n, chunk_size)]


def chunk_masks(masks: Masks, part: slice) -> Masks:
    return tuple(m[part] if m is not None else None for m in masks)


def checkpointed_nll(
    nll_rows: NllRows, rows: torch.Tensor, target: torch.Tensor, masks: Masks, chunk_size: int
) -> torch.Tensor:
    """Per-token NLL ``(N,)``; each chunk recomputed in backward (RNG state replayed)."""
    pieces = [
        checkpoint(
            nll_rows, rows[part], target[part], *chunk_masks(masks, part), use_reentrant=False
        )
        for part in chunk_slices(rows.shape[0], chunk_size)
    ]
    return torch.cat(pieces)


def gradient_in_forward_nll(
    nll_rows: NllRows,
    rows: torch.Tensor,
    target: torch.Tensor,
    masks: Masks,
    params: Sequence[torch.Tensor],
    chunk_size: int,
) -> torch.Tensor:
    """Summed NLL (a scalar) whose gradients were computed chunk by chunk in the forward pass.

    ``params`` are the tensors ``nll_rows`` reads that may need gradients (the head's
    parameters); they are passed explicitly so that autograd routes their gradients.
    """
    return _GradientInForward.apply(nll_rows, chunk_size, masks, rows, target, *params)


class _GradientInForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, nll_rows, chunk_size, masks, rows, target, *params):
        wants_rows = ctx.needs_input_grad[3]
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[5:], strict=True) if need]
        rows_grad = torch.zeros_like(rows) if wants_rows else None
        param_grads = [torch.zeros_like(p) for p in wanted]
        total = torch.zeros((), dtype=torch.float64, device=rows.device)
        for part in chunk_slices(rows.shape[0], chunk_size):
            chunk_rows = rows[part].detach().requires_grad_(wants_rows)
            with torch.enable_grad():
                nll = nll_rows(chunk_rows, target[part], *chunk_masks(masks, part)).sum()
                inputs = ([chunk_rows] if wants_rows else []) + wanted
                grads = torch.autograd.grad(nll, inputs, allow_unused=True) if inputs else ()
            total += nll.detach().double()
            if wants_rows:
                rows_grad[part] = grads[0]
            for accumulated, grad in zip(param_grads, grads[int(wants_rows) :], strict=True):
                if grad is not None:
                    accumulated += grad
        ctx.wants_rows = wants_rows
        ctx.param_needs = ctx.needs_input_grad[5:]
        ctx.save_for_backward(*([rows_grad] if wants_rows else []), *param_grads)
        return total.to(rows.dtype if rows.dtype == torch.float64 else torch.float32)

    @staticmethod
    def backward(ctx, grad_output):
        saved = list(ctx.saved_tensors)
        rows_grad = saved.pop(0) * grad_output if ctx.wants_rows else None
        param_grads = []
        for need in ctx.param_needs:
            param_grads.append(saved.pop(0) * grad_output if need else None)
        return (None, None, None, rows_grad, None, *param_grads)
