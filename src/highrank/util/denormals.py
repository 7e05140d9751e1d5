"""Denormal floats flushed to zero while highrank trains or scores on the CPU.

A sharp next-token distribution over a large vocabulary holds probabilities below the
smallest normal float32 (1.2e-38) - in a log-softmax's or logsumexp's exponentials and their
gradients - and CPUs compute with such denormal numbers many times slower. One training step
of the warm-start study's MoS + CPR on SmolLM2's vocabulary (49,152 tokens) took 4.5-4.9
times longer with them than flushed, from its three seeds' final states, the loss
unchanged (``benchmarks/results/denormals``). Flushing changes only values below 1.2e-38
(2.2e-308 in float64), which a log-space loss never reads.

The flag (``torch.set_flush_denormal``, where torch supports it: x86 with SSE3, ARM) belongs
to a thread: it is the calling thread's, and torch's OpenMP worker threads take the setting of
the thread that creates them, at torch's first parallel operation in the process. So
:class:`flush_denormals` wraps the outermost library functions a verb calls (training,
resuming, fine-tuning, a retrofit, evaluation, dynamic evaluation, translation, the log-prob
matrices of the analyses; :data:`ENTRY_POINTS` names them): in the ``highrank`` command, and
in a script whose first torch work is one of them, every thread flushes. In a process that ran
parallel torch operations before (a notebook), only the calling thread does: call
``torch.set_flush_denormal(True)`` first thing there. Blocks nest, per thread; leaving a
thread's outermost block sets its flag back to PyTorch's default (off); worker threads created
inside a block keep flushing (no Python call reaches them).
"""

from __future__ import annotations

import threading
from contextlib import ContextDecorator
from typing import Any

import torch

_open = threading.local()  # .depth: how many flush_denormals blocks this thread has open
# the qualified names of the functions decorated with flush_denormals (tests hold the list)
ENTRY_POINTS: set[str] = set()


class flush_denormals(ContextDecorator):  # noqa: N801 - used as a decorator, like no_grad
    """Denormals flushed to zero on this thread inside the block or the decorated function."""

    def __call__(self, function: Any) -> Any:
        ENTRY_POINTS.add(f"{function.__module__}.{function.__qualname__}")
        return super().__call__(function)

    def __enter__(self) -> flush_denormals:
        depth = getattr(_open, "depth", 0)
        if depth == 0:
            torch.set_flush_denormal(True)
        _open.depth = depth + 1
        return self

    def __exit__(self, *exc: object) -> None:
        _open.depth -= 1
        if _open.depth == 0:
            torch.set_flush_denormal(False)
