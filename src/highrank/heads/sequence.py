"""What the heads that read more than a hidden state share: sequences, layers and contexts.

Multi-Facet Softmax (``mfs.py``) reads the last layers of the model at the current and the
previous positions; Softmax-CPR (``cpr.py``) reads those too, and the tokens earlier in the
context with their positions' states. Such a head declares ``reads`` (``heads/base.py``)
and gets, besides ``hidden [..., d_in]``:

* ``layers``: a sequence of ``input_layers`` tensors, the hidden states of the last layers
  (top last), each shaped like ``hidden`` except along the time axis, where they cover the
  *context*: S >= T positions ending with hidden's T (the S - T before them are what a caller
  holds of the past, e.g. the tokens decoded so far when generating with a key-value cache;
  0 in training windows). Over hidden's own positions the top layer is ``hidden`` itself,
  which the head reads there (so gradients reach ``hidden``);
* ``context_ids``: the token ids at those S positions (the input token of each position),
  an id below 0 marking a position without a token (padding), which no partition counts.

``time_dim`` (a knob) names the time axis of hidden's leading shape: None (default) the last
one, before the features, so ``(B, T, d)`` is batch-first and ``(T, d)`` one sequence; the
stream families' time-major ``(T, B, d)`` pass 0. Rows are ordered by sequence
(``SequenceOrder``), and what a row reads of its sequence (the ids and pointer keys of earlier
positions) travels as a ``kernels.chunking.SharedRows`` (``ContextRows``), so a chunk of rows
reads only its own sequences: memory ``chunk x S`` per chunk, never ``tokens x S``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from highrank.heads.base import OutputHead, RowOrder
from highrank.heads.functional import log_mixture, mixture_nll, smoothed_nll, widen
from highrank.heads.kernels.chunking import SharedRows
from highrank.heads.kernels.in_place import log_softmax_fresh
from highrank.heads.kernels.mixture_nll import may_fuse, mixture_nll_fused


class SequenceOrder(RowOrder):
    """Rows ordered by sequence: the time axis ``time_axis`` of the leading shape moved last
    (``[..., T]``), the other leading axes flattened into sequences, so row ``r`` is position
    ``r % T`` of sequence ``r // T``."""

    def __init__(self, lead: tuple[int, ...] | torch.Size, time_axis: int) -> None:
        super().__init__(lead)
        self.time_axis = time_axis
        self.length = self.lead[time_axis]
        last = len(self.lead) - 1
        self.moved = tuple(n for i, n in enumerate(self.lead) if i != time_axis) + (self.length,)
        self._last = last

    def sequences(self, x: torch.Tensor) -> torch.Tensor:
        """``[*lead (time of any length), ...] -> (B, S, ...)``."""
        moved = x.movedim(self.time_axis, self._last)
        n_sequences = math.prod(moved.shape[: self._last])  # not -1: 0 positions are allowed
        return moved.reshape(n_sequences, moved.shape[self._last], *moved.shape[self._last + 1 :])

    def flatten(self, x: torch.Tensor) -> torch.Tensor:
        seqs = self.sequences(x)
        return seqs.reshape(seqs.shape[0] * seqs.shape[1], *seqs.shape[2:])

    def restore(self, rows: torch.Tensor) -> torch.Tensor:
        moved = rows.reshape(*self.moved, *rows.shape[1:])
        return moved.movedim(self._last, self.time_axis)


class ContextRows(SharedRows):
    """What rows read of their sequence's context: its token ids ``(B, S)`` and pointer keys
    ``(B, S, d_key)`` (d_key = 0 without a pointer), shared; row ``r`` of the whole batch is
    position ``history + r % T`` of sequence ``r // T`` and reads the positions before it.

    ``row_seq`` and ``row_pos`` give, for the rows held, their sequence among those held and
    their position in the context.
    """

    def __init__(
        self,
        ids: torch.Tensor,
        keys: torch.Tensor,
        *,
        length: int,
        history: int,
        first: int = 0,
        n_rows: int | None = None,
        first_seq: int = 0,
    ) -> None:
        self.shared = (ids, keys)
        self.length, self.history = length, history
        self.first = first
        self.n_rows = ids.shape[0] * length if n_rows is None else n_rows
        self.first_seq = first_seq

    @property
    def ids(self) -> torch.Tensor:
        return self.shared[0]

    @property
    def keys(self) -> torch.Tensor:
        return self.shared[1]

    def sequences(self, part: slice) -> slice:
        start = self.first + (part.start or 0)
        stop = self.first + min(part.stop if part.stop is not None else self.n_rows, self.n_rows)
        if stop <= start or self.length == 0:
            return slice(0, 0)
        first, last = start // self.length, (stop - 1) // self.length
        return slice(first - self.first_seq, last + 1 - self.first_seq)

    def narrow(self, part: slice, shared: tuple[torch.Tensor, ...]) -> ContextRows:
        start = part.start or 0
        stop = min(part.stop if part.stop is not None else self.n_rows, self.n_rows)
        seqs = self.sequences(part)
        ids, keys = shared
        return ContextRows(
            ids,
            keys,
            length=self.length,
            history=self.history,
            first=self.first + start,
            n_rows=max(0, stop - start),
            first_seq=self.first_seq + (seqs.start or 0),
        )

    def row_seq(self) -> torch.Tensor:
        """``(n,)`` each row's sequence among those held."""
        rows = torch.arange(self.first, self.first + self.n_rows, device=self.ids.device)
        return rows // max(self.length, 1) - self.first_seq

    def row_pos(self) -> torch.Tensor:
        """``(n,)`` each row's position in its context (history + time)."""
        rows = torch.arange(self.first, self.first + self.n_rows, device=self.ids.device)
        return rows % max(self.length, 1) + self.history

    def earlier(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's context: the ids ``(n, S)`` of its sequence (0 where there is no token)
        and which of them count ``(n, S)``: positions before the row's own, with a token."""
        ids = self.ids[self.row_seq()]  # (n, S)
        positions = torch.arange(ids.shape[1], device=ids.device)
        counted = (positions < self.row_pos()[:, None]) & (ids >= 0)
        return ids.clamp_min(0), counted

    def scores(self, query: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """``query_r . table[seq(r), j]`` for every row r and context position j: ``(n, S)``.

        query ``(n, d)``, table ``(k, S, d)`` over the k sequences held: the rows of each
        sequence (a contiguous run of rows) against that sequence's table only, ``n x S``
        products in all."""
        table = table.to(query.dtype)
        pieces = [
            query[start:stop] @ table[seq].transpose(0, 1)  # (rows of seq, S)
            for seq, start, stop in self.sequence_runs()
        ]
        if not pieces:
            return query.new_zeros(0, table.shape[1])
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def sequence_runs(self) -> list[tuple[int, int, int]]:
        """``(sequence among those held, first row, stop row)`` of each sequence the held rows
        cover, in order (Python integers: the layout is static)."""
        runs, row = [], 0
        length = max(self.length, 1)
        while row < self.n_rows:
            global_row = self.first + row
            stop = min(self.n_rows, row + length - global_row % length)
            runs.append((global_row // length - self.first_seq, row, stop))
            row = stop
        return runs


def check_time_dim(value: object) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(
            f"time_dim must be an integer axis of the hidden states or None; got {value!r}"
        )
    return value


class SequenceHead(OutputHead):
    """A head whose rows read their sequence (module docstring): checks the inputs, orders
    rows by sequence and hands ``_sequence_rows`` the context in ``(B, S, ...)`` layout."""

    time_dim: int | None = None

    def _head_rows(
        self, hidden: torch.Tensor, inputs: dict
    ) -> tuple[torch.Tensor, tuple, RowOrder]:
        self._flatten_hidden(hidden)  # the shape and dtype checks every head makes
        self._check_inputs(inputs)
        order = SequenceOrder(hidden.shape[:-1], self._time_axis(hidden))
        layers = self._context_layers(inputs["layers"], hidden, order)
        ids = None
        if "context_ids" in self.reads:
            ids = self._context_ids(inputs["context_ids"], hidden, order, layers[-1].shape[1])
        rows, masks = self._sequence_rows(order.sequences(hidden), layers, ids)
        return rows, masks, order

    def _sequence_rows(
        self, hidden: torch.Tensor, layers: list[torch.Tensor], ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, tuple]:
        """Rows ``(B T, width)`` and their per-row inputs, given hidden ``(B, T, d)``, the
        layers over the context ``(B, S, d)`` each (the top one ending with hidden) and the
        context's ids ``(B, S)`` when the head reads them."""
        raise NotImplementedError

    def _time_axis(self, hidden: torch.Tensor) -> int:
        lead = hidden.dim() - 1
        if self.time_dim is None and lead:
            return lead - 1
        if self.time_dim is None or not -lead <= self.time_dim < lead:
            raise ValueError(
                f"{type(self).__name__}: time_dim={self.time_dim} is not a time axis of hidden "
                f"states with leading shape {tuple(hidden.shape[:-1])}"
            )
        return self.time_dim % lead

    def _context_layers(
        self, layers: object, hidden: torch.Tensor, order: SequenceOrder
    ) -> list[torch.Tensor]:
        """``layers`` as ``(B, S, d)`` tensors, checked; the top one's last T positions are
        ``hidden`` (so that its gradient reaches the caller's hidden states)."""
        name = type(self).__name__
        if not isinstance(layers, Sequence) or isinstance(layers, torch.Tensor):
            raise TypeError(
                f"{name}: layers must be a sequence of the last {self.input_layers} layers' "
                f"hidden states; got {type(layers).__name__}"
            )
        if len(layers) != self.input_layers:
            raise ValueError(f"{name} reads the last {self.input_layers} layers; got {len(layers)}")
        out = []
        for i, layer in enumerate(layers):
            _check_like(name, f"layers[{i}]", layer, hidden, order.time_axis, with_features=True)
            out.append(order.sequences(layer))
        lengths = {layer.shape[1] for layer in out}
        if len(lengths) != 1:
            raise ValueError(f"{name}: the layers cover different numbers of positions {lengths}")
        top, history = out[-1], out[-1].shape[1] - order.length
        out[-1] = torch.cat([top[:, :history], order.sequences(hidden)], dim=1)
        return out

    def _context_ids(
        self, ids: object, hidden: torch.Tensor, order: SequenceOrder, length: int
    ) -> torch.Tensor:
        name = type(self).__name__
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise TypeError(f"{name}: context_ids must be a tensor of token ids, torch.int64 or "
                            f"torch.int32; got {got}")
        _check_like(name, "context_ids", ids, hidden, order.time_axis, with_features=False)
        seqs = order.sequences(ids)
        if seqs.shape[1] != length:
            raise ValueError(
                f"{name}: context_ids cover {seqs.shape[1]} positions but the layers {length}; "
                "both cover the context (module docstring of highrank.heads.sequence)"
            )
        seqs = seqs.long()
        valid = seqs < self.vocab_size  # below 0: padding
        message = f"{name}: context_ids must lie below the vocabulary size {self.vocab_size}"
        if torch.compiler.is_compiling() or seqs.device.type != "cpu":  # as the targets
            torch._assert_async(valid.all(), message)
        elif not bool(valid.all()):
            bad = seqs[~valid][:5].tolist()
            raise ValueError(f"{message} (an id below 0 marks padding); got {bad}")
        return seqs


def _check_like(
    name: str, what: str, x: object, hidden: torch.Tensor, time_axis: int, *, with_features: bool
) -> None:
    """``x`` has hidden's shape (without the features unless ``with_features``), except a
    time axis at least as long; floating layers of hidden's dtype."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a tensor; got {type(x).__name__}")
    expected = list(hidden.shape if with_features else hidden.shape[:-1])
    shape = list(x.shape)
    ok = len(shape) == len(expected) and shape[time_axis] >= expected[time_axis]
    ok = ok and all(
        a == b for i, (a, b) in enumerate(zip(shape, expected, strict=True)) if i != time_axis
    )
    if not ok:
        expected[time_axis] = f">={expected[time_axis]}"
        raise ValueError(
            f"{name}: {what} has shape {tuple(shape)}; expected ({', '.join(map(str, expected))})"
            " (hidden's shape, over the context along the time axis)"
        )
    if with_features and x.dtype != hidden.dtype:
        raise TypeError(f"{name}: {what} has dtype {x.dtype} but hidden {hidden.dtype}")
    if x.device != hidden.device:
        raise ValueError(f"{name}: {what} is on {x.device} but hidden on {hidden.device}")


# ---- pieces both papers use -----------------------------------------------------------------


def shift_right(x: torch.Tensor, steps: int) -> torch.Tensor:
    """``x (B, S, d)`` moved ``steps`` positions later in time, zeros before the start."""
    if steps == 0:
        return x
    if steps >= x.shape[1]:
        return torch.zeros_like(x)
    return F.pad(x[:, : x.shape[1] - steps], (0, 0, steps, 0))


class Facets(nn.Module):
    """``n`` facets ``f_i(q) = W_i q + c_i``, ``(..., width) -> (..., n, d_embed)``: one
    product for all of them."""

    def __init__(self, width: int, d_embed: int, n: int) -> None:
        super().__init__()
        self.n, self.d_embed = n, d_embed
        self.linear = nn.Linear(width, n * d_embed)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return self.linear(q).unflatten(-1, (self.n, self.d_embed))

    def one(self, q: torch.Tensor, i: int) -> torch.Tensor:
        """Facet ``i`` alone: ``(..., width) -> (..., d_embed)``."""
        rows = slice(i * self.d_embed, (i + 1) * self.d_embed)
        return F.linear(q, self.linear.weight[rows], self.linear.bias[rows])

    @torch.no_grad()
    def start(self, i: int, d_in: int, projection: nn.Linear | None, *, zero: bool = False) -> None:
        """Facet ``i`` at ``[I, 0]`` (or ``[P, 0]`` and bias c for the projection g' = P g + c
        of a softmax whose width differs), reading only g of q = [g ; ...]; ``zero``: 0."""
        rows = slice(i * self.d_embed, (i + 1) * self.d_embed)
        weight, bias = self.linear.weight[rows], self.linear.bias[rows]
        weight.zero_()
        bias.zero_()
        if zero:
            return
        if d_in == self.d_embed:
            if projection is not None:
                raise ValueError(
                    "a projection was given but this head reads g directly (d_in == d_embed)"
                )
            weight[:, :d_in] = torch.eye(d_in, dtype=weight.dtype, device=weight.device)
            return
        if projection is None or tuple(projection.weight.shape) != (self.d_embed, d_in):
            got = "none" if projection is None else f"one of shape {tuple(projection.weight.shape)}"
            raise ValueError(
                f"this head projects g (d_in != d_embed) with a ({self.d_embed}, {d_in}) matrix; "
                f"starting at a softmax needs that softmax's projection, got {got}"
            )
        weight[:, :d_in] = projection.weight
        bias.copy_(projection.bias)


def mixture_log_prob(log_prior: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
    """``log sum_k pi_k softmax(z_k)`` in log space, ``logits (N, K, V)``; K = 1 and no
    prior: the log-softmax (in place where no gradient is needed)."""
    if log_prior is None:
        return log_softmax_fresh(logits[:, 0])
    return log_mixture(log_prior, F.log_softmax(logits, dim=-1))


def mixture_loss(
    log_prior: torch.Tensor | None,
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
) -> torch.Tensor:
    """``(N,)`` label-smoothed NLL of a mixture of softmaxes over ``logits (N, K, V)``."""
    if label_smoothing:
        return smoothed_nll(mixture_log_prob(log_prior, logits), target, label_smoothing)
    if log_prior is None:
        return F.cross_entropy(logits[:, 0], target, reduction="none")
    if may_fuse(logits):  # the same value, a hand-written backward (kernels/mixture_nll.py)
        return mixture_nll_fused(log_prior, logits, target)
    return mixture_nll(log_prior, logits, target)


def gate_log_prior(gate: nn.Linear | None, q: torch.Tensor) -> torch.Tensor | None:
    """log pi ``(N, K)`` from the gate over q, or None for a single softmax."""
    return None if gate is None else F.log_softmax(widen(gate(q)), dim=-1)
