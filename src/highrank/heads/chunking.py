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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

NllRows = Callable[..., torch.Tensor]  # (rows (n, d), target (n,), *masks) -> nll (n,)
Masks = tuple[torch.Tensor | None, ...]


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
