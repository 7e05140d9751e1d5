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

A head whose rows read across rows (the context of a sequence: MFS and CPR read the earlier
positions of their sequence) passes, among its per-row ``masks``, a ``SharedRows``: tensors
indexed by sequence that every chunk reads in part (the token ids and pointer keys of each
sequence). Slicing it by a chunk's rows keeps the sequences those rows belong to, so a
chunk reads ``chunk x context`` values, never ``tokens x context``; the gradient-in-forward
path computes each chunk's gradient with respect to its sequences' slice and adds it into
the shared tensors' gradients, which backward hands on.

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


class SharedRows:
    """Inputs of a chunk's rows that live per sequence rather than per row (module docstring).

    A subclass holds ``shared``, tensors whose first axis is the sequence, and defines
    ``sequences(part)``, the slice of sequences that the rows ``part`` belong to, and
    ``narrow(part, shared)``, the inputs of those rows given ``shared`` cut to those
    sequences. ``inputs[part]`` is that narrowing with slices of the shared tensors (the
    whole-batch, checkpointed and gradient-free paths); ``gradient_in_forward_nll`` gives
    ``narrow`` detached slices instead and routes their gradients (see there).
    """

    shared: tuple[torch.Tensor, ...] = ()

    def sequences(self, part: slice) -> slice:
        raise NotImplementedError

    def narrow(self, part: slice, shared: tuple[torch.Tensor, ...]) -> SharedRows:
        raise NotImplementedError

    def __getitem__(self, part: slice) -> SharedRows:
        seqs = self.sequences(part)
        return self.narrow(part, tuple(t[seqs] for t in self.shared))


def _shared_of(masks: Masks) -> list[torch.Tensor]:
    """The shared tensors of the ``SharedRows`` among ``masks``, in order."""
    return [t for m in masks if isinstance(m, SharedRows) for t in m.shared]


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
    # The shared tensors of SharedRows inputs (a sequence's pointer keys) come first: their
    # gradients are routed as the parameters' are, each chunk adding into its sequences'.
    shared = _shared_of(masks)
    return _GradientInForward.apply(
        nll_rows, chunk_size, masks, len(shared), rows, target, *shared, *params
    )


class _GradientInForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, nll_rows, chunk_size, masks, n_shared, rows, target, *tensors):
        wants_rows = ctx.needs_input_grad[4]
        needs = ctx.needs_input_grad[6:]
        shared, params = tensors[:n_shared], tensors[n_shared:]
        shared_needs, param_needs = needs[:n_shared], needs[n_shared:]
        wanted = [p for p, need in zip(params, param_needs, strict=True) if need]
        rows_grad = torch.zeros_like(rows) if wants_rows else None
        shared_grads = [
            torch.zeros_like(t) if need else None
            for t, need in zip(shared, shared_needs, strict=True)
        ]
        param_grads = [torch.zeros_like(p) for p in wanted]
        total = torch.zeros((), dtype=torch.float64, device=rows.device)
        for part in chunk_slices(rows.shape[0], chunk_size):
            chunk_rows = rows[part].detach().requires_grad_(wants_rows)
            pieces, views = _chunk_inputs(masks, part, shared_needs)
            with torch.enable_grad():
                nll = nll_rows(chunk_rows, target[part], *pieces).sum()
                leaves = [v for v, _, _ in views]
                inputs = ([chunk_rows] if wants_rows else []) + leaves + wanted
                grads = list(torch.autograd.grad(nll, inputs, allow_unused=True) if inputs else ())
            total += nll.detach().double()
            if wants_rows:
                rows_grad[part] = grads.pop(0)
            for (_, index, seqs), grad in zip(views, grads[: len(views)], strict=True):
                if grad is not None:
                    shared_grads[index][seqs] += grad
            for accumulated, grad in zip(param_grads, grads[len(views) :], strict=True):
                if grad is not None:
                    accumulated += grad
        ctx.wants_rows = wants_rows
        ctx.needs = needs
        kept = [g for g in shared_grads if g is not None]
        ctx.save_for_backward(*([rows_grad] if wants_rows else []), *kept, *param_grads)
        return total.to(rows.dtype if rows.dtype == torch.float64 else torch.float32)

    @staticmethod
    def backward(ctx, grad_output):
        saved = list(ctx.saved_tensors)
        rows_grad = saved.pop(0) * grad_output if ctx.wants_rows else None
        tensor_grads = [saved.pop(0) * grad_output if need else None for need in ctx.needs]
        return (None, None, None, None, rows_grad, None, *tensor_grads)


def _chunk_inputs(masks: Masks, part: slice, shared_needs: Sequence[bool]):
    """The chunk's masks, its ``SharedRows`` narrowed to detached slices of their shared
    tensors, and those slices that need gradients as ``(slice tensor, index among the shared
    tensors, sequences)``."""
    pieces, views, index = [], [], 0
    for m in masks:
        if not isinstance(m, SharedRows):
            pieces.append(m[part] if m is not None else None)
            continue
        seqs = m.sequences(part)
        cut = []
        for t in m.shared:
            view = t[seqs].detach().requires_grad_(shared_needs[index])
            if shared_needs[index]:
                views.append((view, index, seqs))
            cut.append(view)
            index += 1
        pieces.append(m.narrow(part, tuple(cut)))
    return pieces, views
