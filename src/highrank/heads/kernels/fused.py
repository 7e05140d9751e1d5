"""One factory for the fused losses: a function that computes a loss *and its gradients* in
its forward pass becomes a differentiable loss, in eager mode and under torch.compile.

``fused_loss(name, compute, tensors=..., differentiable=..., options=...)`` takes
``compute(*tensors, *options) -> (loss sum, d loss / d tensor for each differentiable one)``
and returns ``loss(*tensors, *options)``, whose backward only scales the stored gradients by
the incoming scalar. ``mixture_ce.py`` and ``mixtape_ce.py`` are built with it.

* Eager mode: a ``torch.autograd.Function``. (An operator's first call costs about 80 MiB of
  one-time allocations on CPU, which a single-step memory measurement would count.)
* Under torch.compile: a ``torch.library`` custom operator ``highrank::<name>``, which the
  compiler keeps as a single opaque node; it would otherwise unroll and trace the chunk loop
  chunk by chunk (MoS at V = 10,000 and 700 tokens: 54 chunks, 12 minutes of compilation).

Both run ``compute`` with autocast off: float32 throughout (float64 for float64 inputs), as
the kernels reuse their buffers in place and their gradients are exact rather than bf16
approximations. Gradients come back in that dtype (at least float32).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

Compute = Callable[..., tuple[torch.Tensor, ...]]


def fused_loss(
    name: str,
    compute: Compute,
    *,
    tensors: Sequence[str],
    differentiable: int,
    options: Sequence[tuple[str, str]],
) -> Callable[..., torch.Tensor]:
    """The differentiable loss ``loss(*tensors, *options)`` of ``compute``.

    tensors: the names of the tensor arguments, the first ``differentiable`` of them those
    that get gradients (the rest, such as the targets, none); options: (name, schema type:
    "int" or "float") of the scalar arguments that follow them.
    """
    n_rest = len(tensors) - differentiable + len(options)
    arguments = [f"Tensor {t}" for t in tensors] + [f"{kind} {o}" for o, kind in options]
    schema = f"({', '.join(arguments)}) -> ({', '.join(['Tensor'] * (1 + differentiable))})"

    def run(*inputs):
        with autocast_off(inputs[0].device.type):
            return tuple(compute(*inputs))

    op = torch.library.custom_op(f"highrank::{name}", run, mutates_args=(), schema=schema)

    @op.register_fake
    def _(*inputs):
        dtype = torch.promote_types(inputs[0].dtype, torch.float32)
        return (
            inputs[0].new_empty((), dtype=dtype),
            *(x.new_empty(x.shape, dtype=dtype) for x in inputs[:differentiable]),
        )

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*output[1:])

    def backward(ctx, grad_loss, *_unused_gradient_grads):
        needs = ctx.needs_input_grad[:differentiable]
        return (*_scaled(ctx.saved_tensors, needs, grad_loss), *([None] * n_rest))

    op.register_autograd(backward, setup_context=setup_context)

    def loss(*inputs) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return op(*inputs)[0]
        return _GradientsInForward.apply(run, differentiable, *inputs)

    loss.__name__ = name
    return loss


class _GradientsInForward(torch.autograd.Function):
    """Eager mode: the loss with its gradients computed in forward; backward scales them."""

    @staticmethod
    def forward(ctx, run, differentiable, *inputs):
        loss, *grads = run(*inputs)
        ctx.save_for_backward(*grads)
        ctx.n_rest = len(inputs) - differentiable
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grads = ctx.saved_tensors
        needs = ctx.needs_input_grad[2 : 2 + len(grads)]
        return (None, None, *_scaled(grads, needs, grad_loss), *([None] * ctx.n_rest))


def _scaled(grads, needs, grad_loss) -> list[torch.Tensor | None]:
    """The saved gradients of the differentiable inputs, times d out / d loss."""
    return [grad * grad_loss if need else None for grad, need in zip(grads, needs, strict=True)]


def autocast_off(device_type: str):
    """No autocast on ``device_type`` (nothing to turn off where it has none, e.g. "meta")."""
    if not torch.amp.is_autocast_available(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)
