"""The contract every output head keeps.

A head maps hidden states ``[..., d_in]`` to a *normalised* next-token distribution over
``vocab_size`` tokens and owns its loss, so model and loss can never disagree:

* ``log_prob(hidden) -> [..., V]``: float32 log-probabilities, normalised, computed in log space.
* ``loss(hidden, target, *, reduction="mean", chunk_size="auto", ignore_index=-100,
  label_smoothing=0.0)``: the cross-entropy of ``target [...]``, with ``ignore_index`` and
  ``label_smoothing`` as ``F.cross_entropy`` defines them. With a ``chunk_size`` the
  flattened tokens are processed ``chunk_size`` at a time (see ``highrank.heads.kernels``),
  so peak memory is about ``chunk_size x K x V`` instead of ``N x K x V``; ``None`` processes
  them all at once, and ``"auto"`` (the default) picks the head's ``auto_chunk_tokens()``.
* ``forward(hidden, target=None)``: ``loss`` with a target (mean), ``log_prob`` without.

What a head reads: ``reads``, ``("hidden",)`` for most heads. A head that reads more declares
it (MFS: ``("hidden", "layers")``, CPR: ``("hidden", "layers", "context_ids")``), and the
three methods take those inputs as keywords, which callers pass exactly as ``reads`` says:

* ``layers``: the hidden states of the last ``input_layers`` layers, top last, each shaped
  like ``hidden`` but over the whole *context*: the positions of ``hidden`` and, before them,
  any earlier ones the caller has (generation with a key-value cache passes the tokens
  decoded so far; training and evaluation windows have none);
* ``context_ids``: the token ids at those same positions (the input token of each, whose
  hidden state is there), ids below 0 marking positions without a token (padding).

Such heads have a time axis (the knob ``time_dim``), and the context of a position is its
sequence up to it.

A subclass writes its paper's equations, its reference path, on flattened inputs
``h: (N, d_in)``. A head whose distribution is one softmax over logits implements

* ``_logits_rows(h, *masks) -> (N, V)``, a fresh tensor: ``log_prob`` is its log-softmax and
  the loss ``F.cross_entropy`` of it;

any other head (MoS) implements the two methods those defaults give:

* ``_log_prob_rows(h, *masks) -> (N, V)``
* ``_loss_rows(h, target, *masks, label_smoothing) -> (N,)``, the label-smoothed NLL of
  every row; targets are valid ids here, ``ignore_index`` is handled once, in this class.

Faster paths to the same values live in ``highrank.heads.kernels``: a head names its fused
chunked loss in ``loss_kernel``, and the in-place inference paths are taken where no gradient
is needed. Inside ``highrank.heads.kernels.reference_paths()`` every head takes its reference
path instead.

``masks`` are per-row dropout masks drawn by ``_draw_masks`` *before* flattening, so that
locked (variational) dropout can share one mask over the time axis of the input, and so that
chunked and unchunked losses see the same masks. A head that reads more than ``hidden``
overrides ``_head_rows``, which turns its inputs into rows, per-row inputs in place of masks
(a ``kernels.chunking.SharedRows`` for what rows read of their sequence) and the order of
the rows (``RowOrder``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from highrank.heads.functional import linear, locked_dropout_mask, widen
from highrank.heads.kernels.chunking import (
    LossKernel,
    auto_chunk_tokens,
    checkpointed_nll,
    chunk_masks,
    chunk_slices,
    chunked_loss_sum,
)
from highrank.heads.kernels.in_place import log_softmax_fresh
from highrank.heads.kernels.paths import REMOVED_SWITCHES, refuse_removed_switch
from highrank.util.checks import check_positive_int, is_number

_REDUCTIONS = ("mean", "sum", "none")


class _HeadClass(type(nn.Module)):
    """The type of head classes: refuses the removed path switches when set on a class
    (``MoS.fused_loss = False`` changed the path once; now it would change nothing)."""

    def __setattr__(cls, name: str, value: object) -> None:
        refuse_removed_switch(name)
        super().__setattr__(name, value)


class OutputHead(nn.Module, metaclass=_HeadClass):
    """Base class of every output layer (see the module docstring for the contract).

    Args:
        d_in: size of the hidden state the backbone produces.
        vocab_size: number of tokens V.
        d_embed: size of the output embedding (the rows of the decoder matrix E, V x d_embed).
            Defaults to ``d_in``. With a tied weight it is the tied matrix's width.
        tied_weight: an existing ``(V, d_embed)`` Parameter (the input embedding) to use as E;
            the head then shares that one Parameter instead of creating its own.
    """

    # Heads with internal dropout take ``dropout_time_dim`` as a knob and set this.
    dropout_time_dim: int | None = None
    # The fused chunked loss of the head (``highrank.heads.kernels``: ``MIXTURE_LOSS``,
    # ``MIXTAPE_LOSS``), or None: autograd chunk by chunk (the generic path).
    loss_kernel: LossKernel | None = None
    # What the head reads (module docstring): "hidden", and "layers" / "context_ids" for heads
    # that read other layers or the context's tokens; callers pass exactly these.
    reads: tuple[str, ...] = ("hidden",)
    # How many of the last layers a head that reads "layers" wants (0: it reads none).
    input_layers: int = 0

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        for name in REMOVED_SWITCHES:
            if name in vars(cls):
                refuse_removed_switch(name)

    def __setattr__(self, name: str, value: object) -> None:
        refuse_removed_switch(name)  # on one head object, as on its class
        super().__setattr__(name, value)

    def __init__(
        self,
        d_in: int,
        vocab_size: int,
        *,
        d_embed: int | None = None,
        tied_weight: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("d_in", d_in)
        check_positive_int("vocab_size", vocab_size)
        self.d_in = d_in
        self.vocab_size = vocab_size
        self.d_embed = _resolve_embed_size(d_in, vocab_size, d_embed, tied_weight)
        if tied_weight is not None:
            self.weight = tied_weight  # registered under this name too: one shared Parameter
        else:
            # U(-0.1, 0.1) as the AWD-LSTM embedding, so an untied decoder starts like a tied one.
            self.weight = nn.Parameter(torch.empty(vocab_size, self.d_embed).uniform_(-0.1, 0.1))
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    # ---- the public contract -------------------------------------------------------------

    def log_prob(self, hidden: torch.Tensor, **inputs: object) -> torch.Tensor:
        """Normalised float32 log-probabilities ``[..., V]`` for hidden states ``[..., d_in]``
        (and the other ``inputs`` the head ``reads``)."""
        rows, masks, order = self._head_rows(hidden, inputs)
        return order.restore(self._log_prob_rows(rows, *masks))

    def loss(
        self,
        hidden: torch.Tensor,
        target: torch.Tensor,
        *,
        reduction: str = "mean",
        chunk_size: int | None | str = "auto",
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        **inputs: object,
    ) -> torch.Tensor:
        """Cross-entropy of ``target [...]`` given ``hidden [..., d_in]`` (and the other
        ``inputs`` the head ``reads``), as ``F.cross_entropy``.

        Per token, ``(1 - eps) * -log p(target) + eps * mean_v -log p(v)`` with
        ``eps = label_smoothing`` in [0, 1] (Szegedy et al. 2016; the plain NLL when 0).
        Positions whose target equals ``ignore_index`` contribute nothing: 0 under
        ``reduction="none"`` (shape of ``target``), left out of "sum", and "mean" averages
        over the other tokens only. As in ``F.cross_entropy``, a "mean" over no tokens (an
        empty batch, or every target ignored) is 0 / 0 = nan; "sum" gives 0.

        ``chunk_size`` bounds the tokens whose ``V``-sized intermediates live at once: an
        int, None (all at once) or "auto" (``auto_chunk_tokens()`` per chunk for scalar
        losses and for evaluation; per-token losses that need gradients are computed
        whole, since chunking them costs a recomputation: pass an int to bound their memory).

        Nothing here reads a tensor's values on the host, so the loss never waits for an
        accelerator and ``torch.compile(fullgraph=True)`` captures it whole; out-of-range
        target ids are caught on the device (a ValueError naming them for CPU tensors in
        eager mode; see ``check_target_ids``).
        """
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction={reduction!r}; expected one of {_REDUCTIONS}")
        label_smoothing = check_label_smoothing(label_smoothing)
        ignore_index = check_ignore_index(ignore_index)
        rows, masks, order = self._head_rows(hidden, inputs)
        target_rows = self._flatten_target(hidden, target, ignore_index, order)
        n = rows.shape[0]
        chunk_size = self._resolve_chunk_size(chunk_size, reduction, hidden.device)
        token_losses = functools.partial(
            self._token_losses, label_smoothing=label_smoothing, ignore_index=ignore_index
        )
        if chunk_size is None or chunk_size >= n:
            losses = token_losses(rows, target_rows, *masks)
        elif not torch.is_grad_enabled():
            # Nothing will call backward: a plain loop over chunks, no graph, no gradients.
            losses = torch.cat(
                [
                    token_losses(rows[part], target_rows[part], *chunk_masks(masks, part))
                    for part in chunk_slices(n, chunk_size)
                ]
            )
        elif reduction == "none":
            losses = checkpointed_nll(token_losses, rows, target_rows, masks, chunk_size)
        else:
            total = chunked_loss_sum(
                self, rows, target_rows, masks, chunk_size, label_smoothing, ignore_index
            )
            return total / _count_kept(target_rows, ignore_index) if reduction == "mean" else total
        if reduction == "mean":
            return losses.sum() / _count_kept(target_rows, ignore_index)
        if reduction == "sum":
            return losses.sum()
        return order.restore(losses)

    def _token_losses(
        self,
        h: torch.Tensor,
        target: torch.Tensor,
        *masks: torch.Tensor | None,
        label_smoothing: float,
        ignore_index: int,
    ) -> torch.Tensor:
        """``(N,)`` label-smoothed NLL of each row, 0 where ``target == ignore_index``.

        Ignored rows are computed with a stand-in target (id 0) and then zeroed, rather than
        selected out, so that shapes stay static (no host synchronisation, no recompilation).
        """
        kept = target != ignore_index
        losses = self._loss_rows(
            h, torch.where(kept, target, 0), *masks, label_smoothing=label_smoothing
        )
        return torch.where(kept, losses, 0.0)

    def _resolve_chunk_size(
        self, chunk_size: int | None | str, reduction: str, device: torch.device | None = None
    ) -> int | None:
        if chunk_size == "auto":
            if reduction == "none" and torch.is_grad_enabled():
                return None
            return self.auto_chunk_tokens(device)
        if chunk_size is not None:
            check_positive_int("chunk_size", chunk_size)
        return chunk_size

    def auto_chunk_tokens(self, device: torch.device | str | None = None) -> int:
        """Tokens per chunk under ``chunk_size="auto"`` for hidden states on ``device`` (the
        CPU's when None): the one policy, ``highrank.heads.kernels.auto_chunk_tokens``."""
        return auto_chunk_tokens(self, device)

    def logits_per_token(self) -> int:
        """How many vocabulary-sized values one token's loss materialises (K x V for MoS)."""
        return self.vocab_size

    def forward(
        self, hidden: torch.Tensor, target: torch.Tensor | None = None, **inputs: object
    ) -> torch.Tensor:
        if target is None:
            return self.log_prob(hidden, **inputs)
        return self.loss(hidden, target, **inputs)

    # Knobs that give the head the structure ``start_at_base`` needs (e.g. residual contexts);
    # ``build_head(..., init="base")`` applies them. None: the head cannot start at a softmax.
    BASE_INIT_KNOBS: dict | None = {}
    # Why a head cannot start at the base softmax (one line), when BASE_INIT_KNOBS is None.
    NO_BASE_INIT = ""

    def start_at_base(self, projection: nn.Linear | None = None) -> None:
        """Set the head's own parameters so that it computes ``log_softmax(E g' + b)`` exactly:
        the softmax over its decoder E and bias b, which ``attach_head`` and ``--init-from``
        copy from the model being extended (g' = g, or ``projection(g)`` when d_in != d_embed:
        the replaced softmax's projection). E and b are left as they are."""
        raise ValueError(
            f"{type(self).__name__} cannot start at the base softmax: "
            f"{self.NO_BASE_INIT or 'it has no start_at_base'}"
        )

    def parameter_groups(self, lr: float) -> list[dict]:
        """Optimizer parameter groups; heads whose paper prescribes a separate lr override it."""
        return [{"params": [p for p in self.parameters() if p.requires_grad], "lr": lr}]

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, vocab_size={self.vocab_size}, d_embed={self.d_embed}"

    # ---- what a subclass implements: its paper's equations, the reference path -----------

    def _logits_rows(self, h: torch.Tensor, *masks: torch.Tensor | None) -> torch.Tensor:
        """``(N, V)`` logits, a fresh tensor, of a head that is one softmax over them."""
        raise NotImplementedError

    def _log_prob_rows(self, h: torch.Tensor, *masks: torch.Tensor | None) -> torch.Tensor:
        """``(N, V)`` normalised log-probabilities: the log-softmax of ``_logits_rows`` (in
        place where no gradient is needed: ``kernels.in_place.log_softmax_fresh``)."""
        return log_softmax_fresh(self._logits_rows(h, *masks))

    def _loss_rows(
        self,
        h: torch.Tensor,
        target: torch.Tensor,
        *masks: torch.Tensor | None,
        label_smoothing: float,
    ) -> torch.Tensor:
        """``(N,)`` label-smoothed NLL of the valid ids ``target (N,)``: the cross-entropy of
        ``_logits_rows``."""
        logits = self._logits_rows(h, *masks)
        return F.cross_entropy(logits, target, reduction="none", label_smoothing=label_smoothing)

    def tanh_context_inputs(self, g: torch.Tensor) -> torch.Tensor | None:
        """The pre-activations ``a (N, units)`` of the tanh units that form this head's context
        vectors, for rows ``g (N, d_in)`` (MoS's and MoC's latents, Mixtape's contexts,
        ``mlp_softmax``'s hidden layer); None for a head without (read by
        ``analysis/saturation.py``: how many of them sit in tanh's flat tails)."""
        return None

    def _draw_masks(self, hidden: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Per-row dropout masks ``(N, width)`` (or None when off); none by default."""
        return ()

    # ---- helpers for subclasses ----------------------------------------------------------

    def _decoder_logits(self, h: torch.Tensor) -> torch.Tensor:
        """``E h + b``, at least float32: ``(..., d_embed) -> (..., V)``."""
        return widen(linear(h, self.weight, self.bias))

    def _dropout_mask(
        self, hidden: torch.Tensor, width: int, dropout: nn.Dropout | float
    ) -> torch.Tensor | None:
        """Dropout mask for ``width`` units per row (locked over ``dropout_time_dim``), or None
        in eval mode or when the rate is 0. ``dropout`` is the head's ``nn.Dropout`` module
        (``heads/dropout.py``: ``HeadDropout``), whose ``p`` and ``training`` are the switches
        that ``model.eval()`` and TRL's ``disable_dropout_in_model`` set; a plain float rate
        follows ``model.eval()`` only."""
        if isinstance(dropout, nn.Dropout):
            p = float(dropout.p) if dropout.training else 0.0
        else:
            p = dropout
        if not self.training or p == 0.0:
            return None
        return locked_dropout_mask(
            hidden.shape[:-1], width, p, hidden.device, time_dim=self.dropout_time_dim
        )

    # ---- plumbing ------------------------------------------------------------------------

    def _head_rows(
        self, hidden: torch.Tensor, inputs: dict
    ) -> tuple[torch.Tensor, tuple, RowOrder]:
        """The rows ``(N, d_in)`` the head computes on, their per-row inputs (dropout masks
        here) and their order; a head that reads more than ``hidden`` overrides it."""
        rows = self._flatten_hidden(hidden)
        self._check_inputs(inputs)
        return rows, self._draw_masks(hidden), RowOrder(hidden.shape[:-1])

    def _check_inputs(self, inputs: dict) -> None:
        """``inputs`` hold exactly what the head reads besides ``hidden`` (one clear error)."""
        wanted = [name for name in self.reads if name != "hidden"]
        name = type(self).__name__
        unknown = sorted(set(inputs) - set(wanted))
        if unknown:
            raise TypeError(
                f"{name} reads {', '.join(self.reads)}; it was also given "
                f"{', '.join(unknown)} (pass what head.reads names)"
            )
        missing = [key for key in wanted if inputs.get(key) is None]
        if missing:
            raise ValueError(
                f"{name} reads {', '.join(self.reads)}: pass {', '.join(missing)} "
                "(see highrank.heads.base: what a head reads)"
            )

    def _flatten_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() < 1 or hidden.shape[-1] != self.d_in:
            raise ValueError(
                f"{type(self).__name__}: hidden has shape {tuple(hidden.shape)}; "
                f"expected [..., d_in] with d_in={self.d_in}"
            )
        self._check_hidden_dtype(hidden)
        return hidden.reshape(-1, self.d_in)

    def _check_hidden_dtype(self, hidden: torch.Tensor) -> None:
        """Floating-point hidden states of the head's dtype; under autocast any floating
        dtype, since autocast casts both sides of every matmul."""
        name, expected = type(self).__name__, self.weight.dtype
        if not hidden.is_floating_point():
            raise TypeError(
                f"{name}: hidden has dtype {hidden.dtype}; expected floating-point hidden "
                f"states of the head's dtype {expected} (token ids go to the embedding, not here)"
            )
        if hidden.dtype != expected and not torch.is_autocast_enabled(hidden.device.type):
            raise TypeError(
                f"{name}: hidden has dtype {hidden.dtype} but the head's parameters are "
                f"{expected}; convert one to the other (hidden.to({expected}) or "
                f"head.to({hidden.dtype})), or run under torch.autocast"
            )

    def _flatten_target(
        self, hidden: torch.Tensor, target: torch.Tensor, ignore_index: int, order: RowOrder
    ) -> torch.Tensor:
        if tuple(target.shape) != tuple(hidden.shape[:-1]):
            raise ValueError(
                f"{type(self).__name__}: target has shape {tuple(target.shape)}; expected "
                f"{tuple(hidden.shape[:-1])} (the hidden shape without its last dimension)"
            )
        if target.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"target must hold integer token ids; got dtype {target.dtype}")
        flat = order.flatten(target).long()
        valid = self._valid_target_ids(flat, ignore_index)
        if torch.compiler.is_compiling() or flat.device.type != "cpu":
            # Checked on the device, without waiting for it: the host never reads the ids
            # (no synchronisation, no graph break). A bad id fails the next synchronisation
            # with this message; call check_target_ids first for an immediate ValueError.
            torch._assert_async(valid.all(), self._target_range_message(ignore_index))
        else:
            self.check_target_ids(flat, ignore_index)  # CPU tensors are at hand: name them
        return flat

    def check_target_ids(self, target: torch.Tensor, ignore_index: int = -100) -> None:
        """Raise a ValueError naming the ids of ``target`` outside ``[0, V)`` that are not
        ``ignore_index``. Reads the ids on the host (a synchronisation on accelerators), so
        ``loss`` does it only for CPU tensors in eager mode; call it outside the hot path to
        validate data bound for an accelerator or a compiled model."""
        valid = self._valid_target_ids(target, ignore_index)
        if not bool(valid.all()):
            bad = target[~valid][:5].tolist()
            raise ValueError(f"{self._target_range_message(ignore_index)}; got {bad}")

    def _valid_target_ids(self, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
        return ((target >= 0) & (target < self.vocab_size)) | (target == ignore_index)

    def _target_range_message(self, ignore_index: int) -> str:
        return (
            f"{type(self).__name__}: target ids must lie in [0, {self.vocab_size}) "
            f"or equal ignore_index={ignore_index}"
        )


class RowOrder:
    """How tensors over the leading shape ``lead`` of the hidden states (``[...]`` or
    ``[..., k]``) become rows and back: row-major flattening here; heads with a time axis
    order rows by sequence (``heads/sequence.py``)."""

    def __init__(self, lead: tuple[int, ...] | torch.Size) -> None:
        self.lead = tuple(lead)

    def flatten(self, x: torch.Tensor) -> torch.Tensor:
        """``[*lead, ...] -> (N, ...)``."""
        return x.reshape(-1, *x.shape[len(self.lead) :])

    def restore(self, rows: torch.Tensor) -> torch.Tensor:
        """``(N, ...) -> [*lead, ...]``."""
        return rows.reshape(*self.lead, *rows.shape[1:])


def check_label_smoothing(value: object) -> float:
    """``label_smoothing`` as ``F.cross_entropy`` accepts it: a number in [0, 1]."""
    if not is_number(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"label_smoothing must be a number in [0, 1]; got {value!r}")
    return float(value)


def check_ignore_index(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"ignore_index must be an integer token id; got {value!r}")
    return value


def _count_kept(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Number of targets not ignored, as a tensor: the "mean" divides by it without reading it
    on the host (0 gives 0 / 0 = nan, as ``F.cross_entropy``)."""
    return (target != ignore_index).sum()


def _resolve_embed_size(
    d_in: int, vocab_size: int, d_embed: int | None, tied_weight: torch.Tensor | None
) -> int:
    if tied_weight is None:
        if d_embed is None:
            return d_in
        check_positive_int("d_embed", d_embed)
        return d_embed
    if not isinstance(tied_weight, nn.Parameter) or tied_weight.dim() != 2:
        raise TypeError("tied_weight must be a 2-D nn.Parameter of shape (vocab_size, d_embed)")
    rows, width = tied_weight.shape
    if rows != vocab_size or (d_embed is not None and width != d_embed):
        expected = f"({vocab_size}, {d_embed if d_embed is not None else 'd_embed'})"
        raise ValueError(f"tied_weight has shape {tuple(tied_weight.shape)}; expected {expected}")
    return width
