"""Denormal floats flushed to zero while highrank trains or scores on the CPU.

A sharp next-token distribution over a large vocabulary holds probabilities below the
smallest normal float32 (1.2e-38) - in a log-softmax's or logsumexp's exponentials and their
gradients - and x86 CPUs compute with such denormal numbers in microcode, many times slower.
One training step of the warm-start study's MoS + CPR on SmolLM2's
vocabulary (49,152 tokens) took 1.4-3.4x longer with them than flushed, depending on the
trained state, the softmax head's on sharp inputs 2.4x (``benchmarks/results/denormals``).
Flushing changes only values below 1.2e-38 (2.2e-308
in float64), which a log-space loss never reads.

``torch.set_flush_denormal`` is process-wide and PyTorch has no getter for it:
:class:`flush_denormals` sets it on entering the outermost block and back to PyTorch's default
(off) on leaving it, so nested blocks (a training loop that scores inside) keep it on.
"""

from __future__ import annotations

import threading
from contextlib import ContextDecorator

import torch

_lock = threading.Lock()
_depth = 0  # how many flush_denormals blocks are open in this process


class flush_denormals(ContextDecorator):  # noqa: N801 - used as a decorator, like no_grad
    """Denormals flushed to zero inside the block or the decorated function (x86 with SSE3,
    where torch supports it; elsewhere nothing changes)."""

    def __enter__(self) -> flush_denormals:
        global _depth
        with _lock:
            if _depth == 0:
                torch.set_flush_denormal(True)
            _depth += 1
        return self

    def __exit__(self, *exc) -> None:
        global _depth
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.set_flush_denormal(False)
