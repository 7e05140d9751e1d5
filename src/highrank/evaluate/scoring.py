"""What static and dynamic evaluation share: the result, the stream laid out as columns and
read in segments, eval mode with or without gradients, and the float64 tally of NLL.

The stream is laid out as B contiguous columns (:func:`highrank.data.batchify`, or a view of a
memory map: :func:`highrank.data.streaming.batch_view`) and read in segments of ``bptt`` rows,
the hidden state carried from one segment to the next (:mod:`highrank.evaluate.perplexity`,
:mod:`highrank.evaluate.dynamic`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from highrank.data import iter_batches
from highrank.data.streaming import batch_view
from highrank.util.progress import progress_bar

TokenIds = torch.Tensor | np.ndarray | Sequence[int]


@dataclass(frozen=True, eq=False)  # eq=False: comparing tensors field-wise is ambiguous
class EvalResult:
    """The outcome of scoring one token stream ``ids`` of N tokens.

    Attributes:
        loss: mean NLL per predicted token, in nats.
        perplexity: ``exp(loss)`` (``inf`` on overflow).
        tokens: number of predicted (scored) tokens.
        token_nll: ``(N - 1,)`` float tensor on the CPU (only when asked for):
            ``token_nll[i]`` is the NLL of predicting ``ids[i + 1]``, NaN where that
            prediction was not scored (the last token of each batch column and the tail
            trimmed by batching).
        target_ids: ``(N - 1,)`` = ``ids[1:]``, aligned with ``token_nll`` (when asked for).
    """

    loss: float
    perplexity: float
    tokens: int
    token_nll: torch.Tensor | None = None
    target_ids: torch.Tensor | None = None


# ---- shared machinery ---------------------------------------------------------------------


class NllTally:
    """Sums per-token NLL in float64 and, optionally, keeps it to export in stream order."""

    def __init__(self, source: torch.Tensor, ids: TokenIds, *, keep_tokens: bool) -> None:
        self.rows, self.columns = source.shape  # (T, B)
        self.total = torch.zeros((), dtype=torch.float64, device=source.device)
        self.count = 0
        self.pieces: list[torch.Tensor] | None = [] if keep_tokens else None
        self.stream = stream_tensor(ids) if keep_tokens else None

    def add(self, nll: torch.Tensor) -> None:
        """nll: (L, B) for the next L rows of targets."""
        self.total += nll.sum(dtype=torch.float64)
        self.count += nll.numel()
        if self.pieces is not None:
            self.pieces.append(nll)

    def result(self) -> EvalResult:
        loss = float(self.total) / self.count
        if self.pieces is None:
            return EvalResult(loss, perplexity_of(loss), self.count)
        matrix = torch.cat(self.pieces).cpu()  # (T - 1, B)
        token_nll = stream_order(matrix, self.rows, self.stream.numel())
        return EvalResult(loss, perplexity_of(loss), self.count, token_nll, self.stream[1:])


def stream_tensor(ids: TokenIds) -> torch.Tensor:
    """The stream as a CPU tensor (a memory map read into int64, as the in-memory corpus has it:
    a per-token export holds the whole split anyway)."""
    if isinstance(ids, np.memmap):
        return torch.from_numpy(np.asarray(ids, dtype=np.int64))
    return torch.as_tensor(ids).cpu()


def stream_order(matrix: torch.Tensor, rows: int, n_stream: int) -> torch.Tensor:
    """Undo batchify's layout: ``matrix (T - 1, B)`` -> ``(N - 1,)``, NaN where not scored.

    Column b holds stream positions ``b*T .. b*T + T - 1``, so ``matrix[t, b]`` predicts
    position ``b*T + t + 1`` from position ``i = b*T + t``.
    """
    columns = matrix.shape[1]
    flat = matrix.new_full((n_stream,), math.nan)
    flat[: rows * columns].view(columns, rows)[:, : rows - 1] = matrix.t()  # (B, T - 1)
    return flat[: n_stream - 1]


def perplexity_of(loss: float) -> float:
    """``exp(loss)``, ``inf`` on overflow."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@contextmanager
def scoring_mode(model: nn.Module, *, adapting: bool) -> Iterator[None]:
    """Eval mode (every dropout, weight drop included, off) with gradients on when
    ``adapting``, off otherwise; each module's training flag is restored on exit.

    When adapting, recurrent kernels without inter-layer dropout (``nn.LSTM`` with one layer
    or ``dropout == 0``) are put in train mode: this changes nothing they compute, but cuDNN
    refuses to backpropagate through an RNN in eval mode.
    """
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    if adapting:
        for module in model.modules():
            if isinstance(module, nn.RNNBase) and (module.num_layers == 1 or module.dropout == 0):
                module.train()
    try:
        with torch.set_grad_enabled(adapting):
            yield
    finally:
        for module, training in flags:
            module.training = training


def batchify_on(model: nn.Module, ids: TokenIds, batch_size: int, name: str) -> torch.Tensor:
    """``batchify(ids, batch_size)`` ``(T, B)`` on the model's device; errors name ``name``.
    A memory map (a ``data.memmap`` run's split) is laid out as a view that reads each segment
    from the map (:func:`highrank.data.streaming.batch_view`), never the whole split."""
    device = next(model.parameters()).device
    return batch_view(ids, batch_size, name=name).to(device)


def segments(
    source: torch.Tensor, bptt: int, progress: bool, desc: str, limit: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(input, target)`` segments of ``source`` in order (at most ``limit``), with a
    progress bar when ``progress`` (:mod:`highrank.util.progress`)."""
    total = math.ceil((source.shape[0] - 1) / bptt)
    if limit is not None:
        total = min(total, limit)
    windows = iter_batches(source, bptt)
    with progress_bar(total=total, desc=desc, unit="seg", disable=not progress) as bar:
        for _ in range(total):
            yield next(windows)
            bar.update()
