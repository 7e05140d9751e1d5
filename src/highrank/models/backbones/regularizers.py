"""The regularizers of AWD-LSTM (Merity, Keskar & Socher, "Regularizing and Optimizing LSTM
Language Models", ICLR 2018). Section numbers below refer to that paper.

* :class:`LockedDropout` — variational dropout, one mask per sequence shared over time (Sec. 4.2).
* :func:`embedding_dropout` — drop whole words from the vocabulary (``dropoute``, Sec. 4.3).
* :class:`WeightDrop` — DropConnect on the hidden-to-hidden matrix of an LSTM (Sec. 2).
* :func:`activation_regularization`, :func:`temporal_activation_regularization` — AR/TAR (Sec. 4.6).
* :func:`variable_bptt_length` — variable-length backpropagation windows (Sec. 4.1).

Every tensor here is time-major: ``(T, B, H)``, as in the AWD-LSTM code.
"""

from __future__ import annotations

import random
from typing import NamedTuple

import torch
from torch import nn

from highrank.util.checks import check_probability

LSTMState = tuple[torch.Tensor, torch.Tensor]  # (h, c), each (1, B, H)


# ---- locked (variational) dropout, Sec. 4.2 ------------------------------------------------


class LockedDropout(nn.Module):
    """Variational dropout (Gal & Ghahramani 2016) as AWD-LSTM uses it (Sec. 4.2).

    For a time-major input ``(T, B, H)`` one Bernoulli mask of shape ``(1, B, H)`` is drawn per
    forward call and shared by every time step; kept units are scaled by ``1 / (1 - p)`` so the
    expectation is unchanged. Identity in eval mode or when ``p == 0``.
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = check_probability("p", p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.dim() < 2:
            raise ValueError(
                f"LockedDropout: input has shape {tuple(x.shape)}; expected time-major (T, B, ...)"
            )
        keep = 1.0 - self.p
        mask = x.new_empty((1, *x.shape[1:])).bernoulli_(keep).div_(keep)  # (1, B, H)
        return x * mask

    def extra_repr(self) -> str:
        return f"p={self.p}"


# ---- embedding dropout, Sec. 4.3 ----------------------------------------------------------


def embedding_dropout(
    embedding: nn.Embedding, words: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """Look up ``words`` with whole vocabulary rows dropped (``dropoute``, Sec. 4.3).

    One mask over the V rows is drawn per call and shared by the whole batch, so every
    occurrence of a dropped word is zero in this forward pass; kept rows are scaled by
    ``1 / (1 - p)``. Equivalent to the reference's ``F.embedding(words, mask * weight)`` but
    masks only the looked-up rows instead of building a masked ``(V, d)`` copy.

    words: integer ids of any shape ``S`` -> ``(*S, d)``. Identity lookup unless training.
    """
    p = check_probability("p", p)
    vectors = embedding(words)  # (*S, d)
    if not training or p == 0.0:
        return vectors
    keep = 1.0 - p
    weight = embedding.weight
    row_mask = weight.new_empty(weight.shape[0], 1).bernoulli_(keep).div_(keep)  # (V, 1)
    return vectors * row_mask[words]  # (*S, d) * (*S, 1)


# ---- weight drop, Sec. 2 ------------------------------------------------------------------


class WeightDrop(nn.Module):
    """DropConnect (Wan et al. 2013) on the hidden-to-hidden matrix ``U`` of a single-layer LSTM:
    the "weight-dropped LSTM" of Sec. 2 (``wdrop``).

    Each forward call in training mode draws one element-wise mask for ``weight_hh_l0``
    ``(4H, H)``, shared by every time step and every sequence of the batch, and scales kept
    weights by ``1 / (1 - p)``. In eval mode (or with ``p == 0``) it is exactly the wrapped
    ``nn.LSTM``.

    Design: the LSTM's parameters stay ordinary registered Parameters (state_dict keys
    ``lstm.weight_ih_l0``, ...), and the dropped matrix is passed to the functional LSTM kernel
    ``torch.lstm`` in an explicit weight list, so no Parameter is ever deleted or replaced and no
    cuDNN internals are touched (the public reference does both and breaks across releases).
    On CUDA the four weights are first packed into one contiguous buffer in PyTorch's flat
    order (W_ih, W_hh, b_ih, b_hh), the layout ``flatten_parameters`` gives cuDNN; without it
    cuDNN copies them itself and warns. (The CUDA path has not yet been run on a GPU.)

    Args:
        lstm: an ``nn.LSTM`` with ``num_layers=1``, unidirectional, without projection.
        p: probability of dropping each recurrent weight (paper: 0.5).
    """

    def __init__(self, lstm: nn.LSTM, p: float = 0.5) -> None:
        super().__init__()
        _check_single_layer_lstm(lstm)
        self.lstm = lstm
        self.p = check_probability("p", p)

    def forward(
        self, x: torch.Tensor, state: LSTMState | None = None
    ) -> tuple[torch.Tensor, LSTMState]:
        """x: (T, B, d_in) (batch-first if the LSTM is); state: (h, c), each (1, B, H)."""
        if not self.training or self.p == 0.0:
            return self.lstm(x, state)
        if x.dim() != 3:
            raise ValueError(f"WeightDrop: input has shape {tuple(x.shape)}; expected (T, B, d_in)")
        if state is None:
            state = self.zero_state(x.shape[0] if self.lstm.batch_first else x.shape[1], x)
        self.lstm.check_forward_args(x, state, None)
        weights = self._weights(self.lstm.weight_hh_l0 * self.draw_mask())
        output, h, c = torch.lstm(
            x, state, weights, self.lstm.bias, 1, 0.0, True, False, self.lstm.batch_first
        )
        return output, (h, c)

    def draw_mask(self) -> torch.Tensor:
        """A fresh inverted-dropout mask ``(4H, H)`` for ``weight_hh_l0``: 0 or 1 / (1 - p)."""
        weight = self.lstm.weight_hh_l0
        keep = 1.0 - self.p
        # uniform < keep is a Bernoulli(keep) draw; done in place it is ~4x faster than
        # bernoulli_ on CPU, which matters for a (4600, 1150) matrix at every forward.
        mask = torch.rand(weight.shape, dtype=weight.dtype, device=weight.device)
        return mask.lt_(keep).div_(keep)

    def zero_state(self, batch_size: int, like: torch.Tensor) -> LSTMState:
        """Zero ``(h, c)``, each ``(1, batch_size, H)``, with the dtype and device of ``like``."""
        zeros = like.new_zeros(1, batch_size, self.lstm.hidden_size)
        return zeros, zeros

    def _weights(self, weight_hh: torch.Tensor) -> list[torch.Tensor]:
        """The weight list ``torch.lstm`` takes: [W_ih, W_hh, b_ih, b_hh] (biases if any)."""
        lstm = self.lstm
        weights = [lstm.weight_ih_l0, weight_hh]
        if lstm.bias:
            weights += [lstm.bias_ih_l0, lstm.bias_hh_l0]
        return _pack_contiguous(weights) if weight_hh.is_cuda else weights

    def extra_repr(self) -> str:
        return f"p={self.p}"


def _check_single_layer_lstm(lstm: object) -> None:
    if not isinstance(lstm, nn.LSTM):
        raise TypeError(f"WeightDrop wraps an nn.LSTM; got {type(lstm).__name__}")
    problems = {
        "num_layers": (lstm.num_layers, 1),
        "bidirectional": (lstm.bidirectional, False),
        "proj_size": (lstm.proj_size, 0),
    }
    for name, (value, expected) in problems.items():
        if value != expected:
            raise ValueError(
                f"WeightDrop needs a single-layer unidirectional nn.LSTM without projection; "
                f"got {name}={value!r}, expected {expected!r} (stack WeightDrop modules instead)"
            )


def _pack_contiguous(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``weights`` into one contiguous buffer (differentiable: the copy is a cat)."""
    flat = torch.cat([w.reshape(-1) for w in weights])
    pieces = flat.split([w.numel() for w in weights])
    return [piece.view(w.shape) for piece, w in zip(pieces, weights, strict=True)]


# ---- AR / TAR, Sec. 4.6 -------------------------------------------------------------------


def activation_regularization(dropped_output: torch.Tensor, alpha: float) -> torch.Tensor:
    """AR (Sec. 4.6): ``alpha * mean(m ⊙ h_t ^ 2)`` on the last layer's output *after* its
    dropout ``m``, as in the AWD-LSTM code (a mean of squares, not the paper's L2 norm).

    dropped_output: (T, B, H) -> scalar.
    """
    return alpha * dropped_output.pow(2).mean()


def temporal_activation_regularization(raw_output: torch.Tensor, beta: float) -> torch.Tensor:
    """TAR (Sec. 4.6): ``beta * mean((h_{t+1} - h_t) ^ 2)`` on the last layer's output *before*
    dropout, penalising large changes of the hidden state between consecutive time steps.

    raw_output: (T, B, H) time-major -> scalar; zero when T < 2 (no consecutive pair).
    """
    if raw_output.shape[0] < 2:
        return raw_output.new_zeros(())
    return beta * (raw_output[1:] - raw_output[:-1]).pow(2).mean()


# ---- variable-length BPTT, Sec. 4.1 ---------------------------------------------------------


class BpttLength(NamedTuple):
    """One window length and the factor to scale that step's learning rate by."""

    seq_len: int
    lr_scale: float  # seq_len / bptt: short windows take proportionally smaller steps


def variable_bptt_length(
    bptt: int,
    rng: torch.Generator | random.Random,
    max_delta: int = 40,
    *,
    p_full: float = 0.95,
    std: float = 5.0,
    min_len: int = 5,
) -> BpttLength:
    """Draw a backpropagation window length (Sec. 4.1, as in the AWD-LSTM / MoS code).

    base = bptt with probability ``p_full`` (0.95), else bptt / 2;
    seq_len = min(max(min_len, int(N(base, std))), bptt + max_delta);
    lr_scale = seq_len / bptt.

    Only ``rng`` is consumed (a ``torch.Generator`` or ``random.Random``), never a global
    generator, so a run that saves and restores ``rng``'s state resumes exactly.
    ``max_delta`` caps the window (MoS: 40 on PTB, 20 on WT2).
    """
    _check_bptt_args(bptt, max_delta)
    uniform, normal = _draws(rng)
    base = bptt if uniform() < p_full else bptt / 2
    seq_len = min(max(min_len, int(normal(base, std))), bptt + max_delta)
    return BpttLength(seq_len, seq_len / bptt)


def _draws(rng: torch.Generator | random.Random):
    """(uniform(), normal(mean, std)) drawing from ``rng`` only."""
    if isinstance(rng, random.Random):
        return rng.random, rng.gauss
    if isinstance(rng, torch.Generator):

        def uniform() -> float:
            return torch.rand((), generator=rng, device=rng.device).item()

        def normal(mean: float, std: float) -> float:
            return mean + std * torch.randn((), generator=rng, device=rng.device).item()

        return uniform, normal
    raise TypeError(f"rng must be a torch.Generator or random.Random; got {type(rng).__name__}")


def _check_bptt_args(bptt: object, max_delta: object) -> None:
    for name, value, low in (("bptt", bptt, 1), ("max_delta", max_delta, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
