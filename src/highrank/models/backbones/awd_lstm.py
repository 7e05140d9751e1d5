"""AWD-LSTM (Merity, Keskar & Socher, "Regularizing and Optimizing LSTM Language Models",
ICLR 2018): an embedding and a stack of weight-dropped single-layer LSTMs with locked dropout.

    tokens (T, B)
      -> embedding with whole-word dropout (dropoute)       (T, B, d_embed)
      -> locked dropout (dropouti)
      -> LSTM_1 -> locked dropout (dropouth) -> ... -> LSTM_L   each LSTM weight-dropped (wdrop)
      -> raw output (T, B, d_last) -> locked dropout (dropout) -> output (T, B, d_last)

With ``d_project`` a linear projection of the dropped output to that width follows, which
the head reads; AR and TAR still act on the last layer's own output. The output width then
varies while the body, its dropout and its regularizers included, stays the same. Either
after the projection would not: a locked mask over d = 8 coordinates deletes about a third of
the output width for a whole sequence, and AR (alpha = 2, on the mean square) pulls an
unbounded 8-wide output toward zero, where the decoder needs it large. The bottleneck map's
d = 8 softmax cell sat at a unigram model's perplexity with both (683.3) and, with the dropout
moved, with AR and TAR still on the projected output (687.6 at epoch 8; PTB's unigram valid
perplexity 687.0); whether this placement lifts it is the map's to show.

The backbone produces hidden states and knows nothing about the vocabulary distribution: the
output head (``highrank.heads``) takes ``output`` and may tie its decoder to
``backbone.embedding.weight``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from highrank.models.backbones.regularizers import (
    LockedDropout,
    LSTMState,
    WeightDrop,
    activation_regularization,
    embedding_dropout,
    temporal_activation_regularization,
)
from highrank.util.checks import check_positive_int, check_probability

AWDLSTMState = list[LSTMState]  # one (h, c) per layer, each (1, B, H_layer)


class AWDLSTMExtras(NamedTuple):
    """What AR/TAR need from a forward pass (Sec. 4.6): both of the last layer, (T, B, d_last)."""

    raw_output: torch.Tensor  # before the output locked dropout: for TAR
    dropped_output: torch.Tensor  # after it (the backbone's output): for AR


class AWDLSTM(nn.Module):
    """The AWD-LSTM backbone.

    The defaults are the paper's PTB model (Sec. 5): 3 layers, d_embed 400, d_hidden 1150 and
    dropouts (input, hidden, output, embedding, weight) = (0.4, 0.3, 0.4, 0.1, 0.5). The
    authors' README command for PTB uses ``dropout_hidden=0.25``; for WT2 the paper raises
    ``dropout_input`` to 0.65 (README: ``dropout_hidden=0.2``). The MoS PTB model is
    ``d_embed=280, d_hidden=960, d_last=620, dropout_hidden=0.225``.

    Args:
        vocab_size: V, rows of the input embedding.
        d_embed: embedding size (the tied decoder's width).
        d_hidden: hidden size of every LSTM layer except the last.
        n_layers: number of stacked single-layer LSTMs.
        d_last: hidden size of the last layer, i.e. of the output; defaults to ``d_embed``,
            as tying with a plain softmax head requires. Heads with their own projection
            (MoS, MoC, Mixtape) let it be free.
        d_project: when given, the last layer's output is projected linearly (with a bias) to
            this width, which is then the output width ``d_last`` the head reads: a body
            whose recurrence keeps its size while the output width varies (the bottleneck
            map), after the output dropout (module docstring). None: no projection.
        dropout_embedding: ``dropoute``, whole-word dropout on the embedding (Sec. 4.3).
        dropout_input: ``dropouti``, locked dropout on the embedding output (Sec. 4.2).
        dropout_hidden: ``dropouth``, locked dropout between LSTM layers.
        dropout_output: ``dropout``, locked dropout on the last layer's output.
        weight_drop: ``wdrop``, DropConnect on every hidden-to-hidden matrix (Sec. 2).
        ar_alpha: AR weight alpha (Sec. 4.6), used by :meth:`regularization_loss`.
        tar_beta: TAR weight beta (Sec. 4.6), used by :meth:`regularization_loss`.
    """

    def __init__(
        self,
        vocab_size: int,
        *,
        d_embed: int = 400,
        d_hidden: int = 1150,
        n_layers: int = 3,
        d_last: int | None = None,
        d_project: int | None = None,
        dropout_embedding: float = 0.1,
        dropout_input: float = 0.4,
        dropout_hidden: float = 0.3,
        dropout_output: float = 0.4,
        weight_drop: float = 0.5,
        ar_alpha: float = 2.0,
        tar_beta: float = 1.0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("d_embed", d_embed),
            ("d_hidden", d_hidden),
            ("n_layers", n_layers),
            ("d_last", d_embed if d_last is None else d_last),
            ("d_project", 1 if d_project is None else d_project),
        ):
            check_positive_int(name, value)
        self.vocab_size = vocab_size
        self.d_embed = d_embed
        last_layer = d_embed if d_last is None else d_last
        self.layer_sizes = tuple([d_hidden] * (n_layers - 1) + [last_layer])
        self.d_last = last_layer if d_project is None else d_project  # the output width
        self.dropout_embedding = check_probability("dropout_embedding", dropout_embedding)
        self.ar_alpha = _check_non_negative("ar_alpha", ar_alpha)
        self.tar_beta = _check_non_negative("tar_beta", tar_beta)

        self.embedding = nn.Embedding(vocab_size, d_embed)
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        inputs = (d_embed, *self.layer_sizes[:-1])
        weight_drop = check_probability("weight_drop", weight_drop)
        self.layers = nn.ModuleList(
            WeightDrop(nn.LSTM(d_in, d_out), weight_drop)
            for d_in, d_out in zip(inputs, self.layer_sizes, strict=True)
        )
        # (T, B, last_layer) -> (T, B, d_project)
        self.projection = None if d_project is None else nn.Linear(last_layer, d_project)
        self.input_dropout = LockedDropout(check_probability("dropout_input", dropout_input))
        self.hidden_dropout = LockedDropout(check_probability("dropout_hidden", dropout_hidden))
        self.output_dropout = LockedDropout(check_probability("dropout_output", dropout_output))

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def forward(
        self, tokens: torch.Tensor, state: AWDLSTMState | None = None
    ) -> tuple[torch.Tensor, AWDLSTMState, AWDLSTMExtras]:
        """tokens: (T, B) integer ids; state: from :meth:`init_state` or a previous call.

        Returns ``output (T, B, d_last)`` after the output dropout, the new state (not detached:
        call :meth:`detach_state` between BPTT windows) and the :class:`AWDLSTMExtras` for AR/TAR.
        """
        self._check_tokens(tokens)
        if state is None:
            state = self.init_state(tokens.shape[1])
        self._check_state(state, tokens.shape[1])
        x = embedding_dropout(self.embedding, tokens, self.dropout_embedding, self.training)
        x = self.input_dropout(x)  # (T, B, d_embed)
        new_state: AWDLSTMState = []
        for i, (layer, layer_state) in enumerate(zip(self.layers, state, strict=True)):
            x, layer_state = layer(x, layer_state)  # (T, B, H_i)
            new_state.append(layer_state)
            if i < self.n_layers - 1:
                x = self.hidden_dropout(x)
        output = self.output_dropout(x)  # (T, B, H_L)
        extras = AWDLSTMExtras(raw_output=x, dropped_output=output)  # the body's: AR, TAR
        if self.projection is not None:  # the output width's map, after the body's dropout
            output = self.projection(output)  # (T, B, d_project)
        return output, new_state, extras

    def init_state(self, batch_size: int) -> AWDLSTMState:
        """Zero ``(h, c)`` per layer, each ``(1, batch_size, H_layer)``, on the model's device."""
        check_positive_int("batch_size", batch_size)
        like = self.embedding.weight
        return [layer.zero_state(batch_size, like) for layer in self.layers]

    @staticmethod
    def detach_state(state: AWDLSTMState) -> AWDLSTMState:
        """The same state cut from the graph: carried across BPTT windows, not backpropagated."""
        return [(h.detach(), c.detach()) for h, c in state]

    def regularization_loss(self, extras: AWDLSTMExtras) -> torch.Tensor:
        """``ar_alpha * AR + tar_beta * TAR`` on the last layer (Sec. 4.6), to add to the loss
        of a training step."""
        ar = activation_regularization(extras.dropped_output, self.ar_alpha)
        return ar + temporal_activation_regularization(extras.raw_output, self.tar_beta)

    def extra_repr(self) -> str:
        return (
            f"vocab_size={self.vocab_size}, d_embed={self.d_embed}, "
            f"layer_sizes={self.layer_sizes}, d_last={self.d_last}, "
            f"dropout_embedding={self.dropout_embedding}, "
            f"ar_alpha={self.ar_alpha}, tar_beta={self.tar_beta}"
        )

    # ---- input checks ---------------------------------------------------------------------

    def _check_tokens(self, tokens: torch.Tensor) -> None:
        if tokens.dim() != 2:
            raise ValueError(
                f"AWDLSTM: tokens has shape {tuple(tokens.shape)}; expected time-major (T, B)"
            )
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"AWDLSTM: tokens must hold integer ids; got dtype {tokens.dtype}")

    def _check_state(self, state: AWDLSTMState, batch_size: int) -> None:
        if len(state) != self.n_layers:
            raise ValueError(
                f"AWDLSTM: state has {len(state)} layers; expected {self.n_layers} (h, c) pairs"
            )
        for i, ((h, c), size) in enumerate(zip(state, self.layer_sizes, strict=True)):
            expected = (1, batch_size, size)
            if tuple(h.shape) != expected or tuple(c.shape) != expected:
                raise ValueError(
                    f"AWDLSTM: state[{i}] has shapes h {tuple(h.shape)}, c {tuple(c.shape)}; "
                    f"expected {expected} each (use init_state({batch_size}))"
                )


def _check_non_negative(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0; got {value!r}")
    return float(value)
