"""Pieces of a training step that every recipe shares: the non-finite guard and the head's
chunk size (seeding and the device: :mod:`highrank.train.startup`).

A step whose loss or gradient norm is NaN/inf changes nothing: no backward pass for a
non-finite loss, gradients zeroed for a non-finite norm, no optimizer step. The recipe returns
``StepResult(None, reason)`` and the loop counts the skip (:mod:`highrank.train.loop`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from highrank.config import Config
from highrank.train.distributed import all_finite


def backward_or_skip(loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> str:
    """``loss.backward()`` when ``loss`` is finite and ``""``; otherwise the gradients are
    zeroed and the reason is returned (``"loss was nan"``). With gradient accumulation, call it
    once per micro-batch and stop at the first reason. Under torchrun the loss must be finite
    on every process, so that all of them skip or none does (their backward passes meet)."""
    if not all_finite(loss):
        optimizer.zero_grad(set_to_none=True)
        return f"loss was {loss.detach().item()}"
    loss.backward()
    return ""


def clip_or_skip(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], clip: float
) -> str:
    """Clip the gradient norm of ``params`` to ``clip`` (0: no clipping, the norm is still
    checked); ``""``, or the reason when the norm is not finite (then gradients are zeroed)."""
    norm = torch.nn.utils.clip_grad_norm_(params, clip or math.inf)
    if not bool(torch.isfinite(norm)):
        optimizer.zero_grad(set_to_none=True)
        return f"gradient norm was {float(norm)}"
    return ""


def head_chunk_size(config: Config) -> int | str:
    """``train.chunk_size``, or ``"auto"`` when unset: the heads' default, chunks of about
    2**21 logits, which bounds memory and avoids allocating (N, K, V) tensors every step (on
    2 CPU cores the small MoS recipe, K = 5, ran about 1,300 tokens/s unchunked at best and
    2,600 with "auto"; the small softmax recipe 5,100 and 6,600)."""
    return "auto" if config.train.chunk_size is None else config.train.chunk_size


__all__ = [
    "backward_or_skip",
    "clip_or_skip",
    "head_chunk_size",
]
