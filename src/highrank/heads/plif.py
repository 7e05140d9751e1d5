"""LMS-PLIF: a learnable monotone piecewise-linear function of every logit (Ganea et al.,
"Breaking the Softmax Bottleneck via Learnable Monotonic Pointwise Non-linearities", ICML 2019).

log p = log_softmax(f(z)), z = E g' + b. f is continuous and piecewise linear with
``n_pieces`` equal pieces on [low, high] (paper: 100,000 on [-20, 20]); piece j has slope
softplus(theta_j) > 0, so f is strictly increasing; beyond the range f continues linearly
with the edge slopes. theta_j = log(e - 1) + N(0, 1) at init, so the median slope is 1
(log(e - 1) is softplus's inverse at 1; the mean slope is about 1.1). The piece index of a
logit is found without gradient; gradients reach z through the slope of its piece and theta
through the slopes and knot values. The paper trains theta with its own learning rate
(0.02), see ``parameter_groups``. With ``learn_slopes=False`` the random slopes stay fixed
("frozen"), which the rank study (Parthiban, Mao & Inkpen, AAAI 2021) found about as good.

Anchor. f is fixed by its slopes up to a constant; here f(low) = low, so that f is the
identity when every slope is 1 and the transformed logits stay near 0, where float32 is
densest. Ganea et al.'s code (as shipped in yottabytt/awd-lstm-lmkit, ``PlifSmax.func``)
anchors f(-T) = 0 instead, i.e. its f is ours minus ``low``. The probabilities are the same
(log_softmax ignores a constant); the matrices of transformed logits (``highrank analyze rank
--kind logits``) differ by the constant matrix -low * 1 1^T, so their ranks may differ by at
most 1 (a rank-one term) and their singular values slightly. Log-probability matrices, the
papers' object, are identical.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from highrank.heads.softmax import PointwiseSoftmax
from highrank.util.checks import check_finite, check_positive_int

_SOFTPLUS_INVERSE_OF_ONE = math.log(math.e - 1.0)


class PiecewiseLinearSoftmax(PointwiseSoftmax):
    """LMS-PLIF output layer.

    Args:
        n_pieces: number of equal-width linear pieces on [low, high].
        low, high: the range covered by the pieces.
        learn_slopes: train the slopes (True) or keep the random initial ones (frozen PLIF).
        slope_lr: learning rate of the slope parameters in ``parameter_groups``.
        d_in, vocab_size, d_embed, tied_weight: as :class:`highrank.heads.softmax.Softmax`.
    """

    def __init__(
        self,
        d_in: int,
        vocab_size: int,
        *,
        d_embed: int | None = None,
        tied_weight: nn.Parameter | None = None,
        n_pieces: int = 100_000,
        low: float = -20.0,
        high: float = 20.0,
        learn_slopes: bool = True,
        slope_lr: float = 0.02,
    ) -> None:
        super().__init__(d_in, vocab_size, d_embed=d_embed, tied_weight=tied_weight)
        check_positive_int("n_pieces", n_pieces)
        if not check_finite("low", low) < check_finite("high", high):
            raise ValueError(f"low must be below high; got low={low!r}, high={high!r}")
        self.n_pieces, self.low, self.high = n_pieces, float(low), float(high)
        self.piece_width = (self.high - self.low) / n_pieces
        self.learn_slopes = bool(learn_slopes)
        self.slope_lr = check_finite("slope_lr", slope_lr)
        theta = _SOFTPLUS_INVERSE_OF_ONE + torch.randn(n_pieces)
        if self.learn_slopes:
            self.slope_logits = nn.Parameter(theta)
        else:
            self.register_buffer("slope_logits", theta)

    def _start_transform_at_identity(self) -> None:
        """Every slope 1 (theta = log(e - 1)): with the anchor f(low) = low, f is the identity."""
        with torch.no_grad():
            self.slope_logits.fill_(_SOFTPLUS_INVERSE_OF_ONE)

    def slopes(self) -> torch.Tensor:
        """Slope of every piece, softplus(theta) > 0: ``(n_pieces,)``."""
        return F.softplus(self.slope_logits)

    def transform(self, logits: torch.Tensor) -> torch.Tensor:
        rise = self.slopes() * self.piece_width  # (P,) increase of f across each piece
        return piecewise_linear(logits, rise, self.low, self.piece_width)

    def parameter_groups(self, lr: float) -> list[dict]:
        slope_params = [self.slope_logits] if self.learn_slopes else []
        slope_ids = {id(p) for p in slope_params}
        rest = [p for p in self.parameters() if p.requires_grad and id(p) not in slope_ids]
        groups = [{"params": rest, "lr": lr}]
        if slope_params:
            groups.append({"params": slope_params, "lr": self.slope_lr})
        return groups

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, n_pieces={self.n_pieces}, range=[{self.low}, {self.high}], "
            f"learn_slopes={self.learn_slopes}"
        )


def piecewise_linear(logits: torch.Tensor, rise: torch.Tensor, low: float, width: float):
    """The continuous piecewise-linear f with pieces of ``width`` from ``low``, piece j rising
    by ``rise[j]``, anchored at f(low) = low (module docstring: the reference's f(low) = 0),
    applied to every logit; linear beyond the range
    with the edge slopes."""
    return _PiecewiseLinear.apply(logits, rise, low, width)


def _locate(logits: torch.Tensor, low: float, width: float, n_pieces: int):
    """Piece index (no gradient) and position within the piece in [0, 1) (beyond the range:
    below 0 or above 1, so the edge pieces extend linearly). A NaN logit gets piece 0 and a
    NaN position, so f(NaN) = NaN as for any other head (casting NaN to an index would give
    a garbage index)."""
    position = (logits - low) / width  # in units of pieces
    piece = position.floor().nan_to_num_(nan=0.0).clamp_(0, n_pieces - 1)
    return piece.long(), position - piece


class _PiecewiseLinear(torch.autograd.Function):
    """Forward and backward written out, so that backward keeps only the logits (4 bytes per
    logit instead of ~20 for autograd's gathers) and sums the slope gradients per piece in
    float64 (``_sum_per_piece``)."""

    @staticmethod
    def forward(ctx, logits, rise, low, width):
        # f at the left knot of every piece; summed in float64, as 100,000 float32 terms
        # would drift visibly, and kept at least float32 (bf16 knots would be 0.06 apart at 20).
        knot_dtype = torch.promote_types(rise.dtype, torch.float32)
        left_value = low + (torch.cumsum(rise.double(), 0) - rise.double()).to(knot_dtype)
        index, offset = _locate(logits, low, width, rise.shape[0])
        ctx.save_for_backward(logits, rise)
        ctx.low, ctx.width = low, width
        return left_value[index] + rise[index] * offset

    @staticmethod
    def backward(ctx, grad):
        logits, rise = ctx.saved_tensors
        index, offset = _locate(logits, ctx.low, ctx.width, rise.shape[0])
        grad_logits = grad * (rise / ctx.width)[index] if ctx.needs_input_grad[0] else None
        grad_rise = None
        if ctx.needs_input_grad[1]:
            # d f / d rise_j = offset on piece j itself, 1 on every piece to its right.
            flat_index = index.reshape(-1)
            on_piece = _sum_per_piece(flat_index, (grad * offset).reshape(-1), rise.numel())
            per_piece = _sum_per_piece(flat_index, grad.reshape(-1), rise.numel())
            to_the_right = per_piece.sum() - torch.cumsum(per_piece, 0)
            grad_rise = (on_piece + to_the_right).to(rise.dtype)
        return grad_logits, grad_rise, None, None


def _sum_per_piece(index: torch.Tensor, values: torch.Tensor, n_pieces: int) -> torch.Tensor:
    """``out[j] = sum of values[i] with index[i] == j``, in float64, ``(n_pieces,)``.

    ``index_add_`` into a fixed-size vector rather than ``bincount``: the same sums
    (deterministic on CPU, where the one-dimensional accumulation runs in order), but an
    output shape that does not depend on the data, so ``torch.compile`` keeps it in the graph.
    """
    return values.new_zeros(n_pieces, dtype=torch.float64).index_add_(0, index, values.double())
