"""Evaluation: perplexity with carried state, per-token NLL export, and dynamic evaluation.

Static evaluation (:func:`evaluate_perplexity`) follows AWD-LSTM (Merity et al., 2018): the
stream is laid out as B contiguous columns (validation B = 10, test B = 1), read in segments of
``bptt`` (70) with the hidden state carried across segments, and

    perplexity = exp(total NLL / number of predicted tokens),

the total accumulated in float64. Every dropout, weight drop included, is off (eval mode).

Dynamic evaluation (Krause, Kahembwe, Murray & Renals, "Dynamic Evaluation of Neural Sequence
Models", 2017; the "RMS" variant of Sec. 4 as shipped with the MoS code, Yang et al. 2018)
adapts the model to the recent history while it is being scored:

1. :func:`gradient_statistics`: ``MS_p = sqrt(sum_s grad_s(p)^2)`` over the training set
   (B = 100, segments of 5, state carried).
2. :func:`decay_rates`: ``decay_p = MS_p / sum_q mean(MS_q)``, clipped at ``1 / lambda``.
3. :func:`dynamic_evaluate`: B = 1, segments of 5; score a segment, then
   ``theta <- theta + lambda * decay ⊙ (theta_0 - theta) - eta * grad / (MS + epsilon)``,
   theta_0 being the trained parameters (the global prior). :data:`DYNAMIC_EVAL_DEFAULTS`
   holds the published (eta, epsilon, lambda).

Unlike the public MoS port (which adapts in train mode and so keeps weight drop on), every
dropout is off both while collecting the statistics and while adapting. Gradients are taken
with :func:`torch.autograd.grad`, so no ``.grad`` attribute of the caller's model is touched.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from highrank.data import Vocab, iter_batches
from highrank.data.streaming import batch_view
from highrank.model import LanguageModel
from highrank.util.progress import progress_bar

# Krause et al. (2017) hyperparameters as used for AWD-LSTM-MoS (Yang et al., 2018, Sec. 3);
# the keys are the keyword arguments of dynamic_evaluate (and the [dynamic_eval] config keys).
DYNAMIC_EVAL_DEFAULTS: dict[str, dict[str, float]] = {
    "ptb": {"lr": 0.002, "epsilon": 0.001, "prior_decay": 0.075},
    "wt2": {"lr": 0.002, "epsilon": 0.002, "prior_decay": 0.02},
}

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


# ---- static evaluation --------------------------------------------------------------------


AWD_LSTM_EVAL_BPTT = 70  # AWD-LSTM / MoS evaluation segments (the state is carried across)


def default_bptt(config) -> int:
    """The segment length evaluation and analysis use when none is given.

    A Transformer run (``model.backbone = "transformer"``) carries no state between windows, so
    its own training window ``train.bptt`` is the protocol it was trained for (and its learned
    positions cover no more); an AWD-LSTM run carries its state, and the papers score it in
    segments of 70 whatever it was trained with.
    """
    if config.model.backbone == "transformer":
        return config.train.bptt
    return AWD_LSTM_EVAL_BPTT


def refuse_transformer_dynamic_eval(config) -> None:
    """Dynamic evaluation (segments of 5, state carried) is defined for recurrent models: a
    Transformer window would see only its own 5 tokens, so the figure would mean nothing."""
    from highrank.runs.run_dir import RunDirError

    if config.model.backbone != "awd-lstm":
        raise RunDirError(
            f'dynamic evaluation needs a recurrent run (model.backbone = "awd-lstm"); this run '
            f"is a {config.model.backbone!r} model, whose windows carry no state between the "
            f"segments of {config.dynamic_eval.bptt} tokens that dynamic evaluation scores; "
            f"use `highrank eval` instead"
        )


def evaluate_perplexity(
    model: LanguageModel,
    ids: TokenIds,
    *,
    batch_size: int,
    bptt: int = 70,
    progress: bool = False,
    return_token_nll: bool = False,
    name: str = "evaluation stream",
) -> EvalResult:
    """Perplexity of the 1-D token stream ``ids`` with the hidden state carried across segments.

    The stream is trimmed to a multiple of ``batch_size`` (B) and laid out as B contiguous
    columns (:func:`highrank.data.batchify`); the papers use B = 10 for validation and B = 1
    for test. Segments of ``bptt`` rows are scored in order, the state of one segment feeding
    the next, in eval mode (no dropout) and without gradients. Each module's training flag is
    restored afterwards. ``name`` (e.g. the split's file) appears in errors, such as a stream
    shorter than two tokens per column.
    """
    _check_positive_int("bptt", bptt)
    source = _batchify_on(model, ids, batch_size, name)  # (T, B)
    tally = _NllTally(source, ids, keep_tokens=return_token_nll)
    with _scoring_mode(model, adapting=False):
        state = model.init_state(batch_size)
        for tokens, target in _segments(source, bptt, progress, "eval"):
            nll, state = model.nll(tokens, target, state)  # (L, B)
            tally.add(nll)
    return tally.result()


# ---- per-token export ---------------------------------------------------------------------


def write_token_nll(
    path: str | os.PathLike, result: EvalResult, vocab: Vocab | None = None
) -> Path:
    """Write ``result``'s per-token NLL (from ``return_token_nll=True``) to ``path``.

    * ``.tsv``: a header ``position<TAB>target<TAB>nll``, then one row per scored prediction in
      stream order: the 0-based position of the target token in the stream (``i + 1`` for
      ``token_nll[i]``), the target word (its id when ``vocab`` is None) and the NLL in nats.
    * ``.npy``: the float array ``token_nll`` of length N - 1, NaN where not scored.

    Returns the path written.
    """
    path = Path(path)
    if result.token_nll is None or result.target_ids is None:
        raise ValueError(
            "the EvalResult holds no per-token NLL; evaluate with return_token_nll=True"
        )
    suffix = path.suffix.lower()
    if suffix == ".npy":
        np.save(path, result.token_nll.numpy())
    elif suffix == ".tsv":
        path.write_text(_token_nll_tsv(result, vocab), encoding="utf-8")
    else:
        raise ValueError(f"cannot write token NLL to {path}: expected a .tsv or .npy file name")
    return path


def _token_nll_tsv(result: EvalResult, vocab: Vocab | None) -> str:
    """TSV text of the scored predictions (tokens never hold tabs or newlines)."""
    nll, targets = result.token_nll, result.target_ids
    scored = torch.nonzero(~torch.isnan(nll)).flatten().tolist()
    target_ids = targets[scored].tolist()
    words = vocab.decode(target_ids) if vocab is not None else [str(t) for t in target_ids]
    values = nll[scored].tolist()
    rows = (f"{i + 1}\t{w}\t{v:.6f}" for i, w, v in zip(scored, words, values, strict=True))
    return "\n".join(["position\ttarget\tnll", *rows]) + "\n"


# ---- dynamic evaluation: gradient statistics and decay rates --------------------------------


def gradient_statistics(
    model: LanguageModel,
    train_ids: TokenIds,
    *,
    batch_size: int = 100,
    bptt: int = 5,
    progress: bool = False,
    max_batches: int | None = None,
    name: str = "training stream",
) -> dict[str, torch.Tensor]:
    """Krause et al. (2017), Sec. 4: ``MS_p = sqrt(sum_s grad_s(p)^2)``, one tensor per parameter.

    ``grad_s`` is the gradient of segment s's *mean* NLL (as in the reference code), over the
    training stream laid out as ``batch_size`` columns (100) in segments of ``bptt`` (5) with
    the state carried; ``max_batches`` stops after that many segments. The model is in eval
    mode (every dropout, weight drop included, off) with gradients enabled, and is not changed.

    The sum is not divided by the number of segments (the MoS port; Krause's later release
    divides and rescales eta and epsilon to match), so the PTB/WT2 defaults assume a full
    training pass: ``max_batches`` shrinks MS and thereby enlarges the effective step.

    Returns ``{name: MS}`` keyed like ``model.named_parameters()``: each trainable parameter
    once (a tied embedding under its first name), MS with the parameter's shape and device.
    """
    _check_positive_int("bptt", bptt)
    if max_batches is not None:
        _check_positive_int("max_batches", max_batches)
    params = _adaptable_parameters(model)
    source = _batchify_on(model, train_ids, batch_size, name)  # (T, B)
    squares = {key: torch.zeros_like(p) for key, p in params.items()}
    with _scoring_mode(model, adapting=True):
        state = model.init_state(batch_size)
        for tokens, target in _segments(source, bptt, progress, "grad stats", max_batches):
            nll, state = model.nll(tokens, target, state)  # (L, B)
            grads = _gradients(nll.mean(), params)
            for square, grad in zip(squares.values(), grads, strict=True):
                if grad is not None:  # None: the parameter took no part in this segment
                    square.addcmul_(grad, grad)
            state = model.backbone.detach_state(state)
    return {key: square.sqrt_() for key, square in squares.items()}


def decay_rates(stats: Mapping[str, torch.Tensor], prior_decay: float) -> dict[str, torch.Tensor]:
    """Per-element decay rates ``decay_p = MS_p / sum_q mean(MS_q)``, clipped at ``1/lambda``.

    Read literally from the MoS port of Krause et al. (2017), where it differs from a naive
    reading of "MS normalised by its mean":

    * the normaliser is the *sum over parameter tensors* of each tensor's mean MS: every
      tensor counts once whatever its size; it is neither the mean over all elements nor the
      average of the per-tensor means (Krause's later release divides by the tensor count);
    * the clip bounds ``decay`` itself at ``1 / lambda`` (so ``lambda * decay <= 1`` and the
      pull towards theta_0 never overshoots it), element-wise; ``lambda = 0`` clips nothing.
    """
    _check_non_negative("prior_decay", prior_decay)
    if not stats:
        raise ValueError("gradient statistics are empty; expected one MS tensor per parameter")
    total = sum(float(ms.double().mean()) for ms in stats.values())
    if not math.isfinite(total) or total <= 0.0:
        raise ValueError(
            f"gradient statistics sum to {total} (sum of per-tensor mean MS); expected a "
            "positive finite number: did the gradients vanish, or is the training stream empty?"
        )
    limit = math.inf if prior_decay == 0 else 1.0 / prior_decay
    return {key: (ms / total).clamp_(max=limit) for key, ms in stats.items()}


# ---- dynamic evaluation: the adaptive scoring loop -----------------------------------------


def dynamic_evaluate(
    model: LanguageModel,
    ids: TokenIds,
    stats: Mapping[str, torch.Tensor],
    *,
    lr: float,
    epsilon: float,
    prior_decay: float,
    batch_size: int = 1,
    bptt: int = 5,
    progress: bool = False,
    return_token_nll: bool = False,
    name: str = "evaluation stream",
) -> EvalResult:
    """Dynamic evaluation (Krause et al., 2017, Sec. 4, "RMS" update with a global prior).

    ``ids`` is laid out as ``batch_size`` columns (1) and read in segments of ``bptt`` (5) with
    the state carried. Each segment is scored first (its NLL counts before any update from it),
    then every trainable parameter (a tied embedding once) takes the step

        theta <- theta + lambda * decay ⊙ (theta_0 - theta) - eta * grad / (MS + epsilon)

    with ``eta = lr``, ``lambda = prior_decay``, ``MS = stats`` from
    :func:`gradient_statistics`, ``decay`` from :func:`decay_rates` and theta_0 the parameters
    on entry. ``grad`` is the gradient of the segment's *mean* NLL (over its L·B tokens), as
    in the reference code (``nll_loss``'s default reduction). Every dropout, weight drop
    included, is off while adapting (eval mode with gradients enabled).

    The caller's model is adapted in place during the call and restored to theta_0 exactly
    afterwards (also on error); no second copy of the model is made, so do not use it from
    another thread meanwhile. Module training flags and ``.grad`` are left as they were.
    """
    _check_dynamic_hyperparameters(lr, epsilon, prior_decay, bptt)
    params = _adaptable_parameters(model)
    stats = _match_stats(params, stats)
    source = _batchify_on(model, ids, batch_size, name)  # (T, B)
    rule = _UpdateRule(params, stats, decay_rates(stats, prior_decay), lr, epsilon, prior_decay)
    tally = _NllTally(source, ids, keep_tokens=return_token_nll)
    try:
        with _scoring_mode(model, adapting=True):
            state = model.init_state(batch_size)
            for tokens, target in _segments(source, bptt, progress, "dynamic eval"):
                nll, state = model.nll(tokens, target, state)  # (L, B)
                tally.add(nll.detach())  # scored before the update
                rule.step(_gradients(nll.mean(), params))
                state = model.backbone.detach_state(state)
    finally:
        rule.restore_prior()
    return tally.result()


class _UpdateRule:
    """The per-parameter constants of the dynamic-evaluation step, and the step itself."""

    def __init__(
        self,
        params: dict[str, nn.Parameter],
        stats: dict[str, torch.Tensor],
        decay: dict[str, torch.Tensor],
        lr: float,
        epsilon: float,
        prior_decay: float,
    ) -> None:
        self.params = list(params.values())
        self.prior = [p.detach().clone() for p in self.params]  # theta_0
        self.pull = [prior_decay * decay[key] for key in params]  # lambda * decay
        self.denominator = [stats[key] + epsilon for key in params]  # MS + epsilon
        self.lr = lr

    @torch.no_grad()
    def step(self, grads: Sequence[torch.Tensor | None]) -> None:
        """``theta += lambda * decay ⊙ (theta_0 - theta) - eta * grad / (MS + epsilon)``."""
        for p, g, prior, pull, denominator in zip(
            self.params, grads, self.prior, self.pull, self.denominator, strict=True
        ):
            delta = pull * (prior - p)
            if g is not None:
                delta -= self.lr * g / denominator
            p.add_(delta)

    @torch.no_grad()
    def restore_prior(self) -> None:
        """Put theta_0 back, bit for bit."""
        for p, prior in zip(self.params, self.prior, strict=True):
            p.copy_(prior)


def _check_dynamic_hyperparameters(lr: float, epsilon: float, prior_decay: float, bptt: int):
    _check_non_negative("lr", lr)
    _check_non_negative("prior_decay", prior_decay)
    _check_non_negative("epsilon", epsilon)
    if epsilon == 0:
        raise ValueError("epsilon must be > 0: it keeps grad / (MS + epsilon) finite where MS = 0")
    _check_positive_int("bptt", bptt)


def _match_stats(
    params: dict[str, nn.Parameter], stats: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``stats`` checked against the parameters (names, shapes), on their device and dtype."""
    missing, extra = sorted(set(params) - set(stats)), sorted(set(stats) - set(params))
    if missing or extra:
        raise ValueError(
            "gradient statistics do not match the model's trainable parameters: "
            f"missing {missing or 'none'}, unexpected {extra or 'none'}; compute them with "
            "gradient_statistics on this model"
        )
    matched = {}
    for key, p in params.items():
        if tuple(stats[key].shape) != tuple(p.shape):
            raise ValueError(
                f"gradient statistic {key!r} has shape {tuple(stats[key].shape)}; expected "
                f"the parameter's shape {tuple(p.shape)}"
            )
        matched[key] = stats[key].to(device=p.device, dtype=p.dtype)
    return matched


# ---- shared machinery ---------------------------------------------------------------------


class _NllTally:
    """Sums per-token NLL in float64 and, optionally, keeps it to export in stream order."""

    def __init__(self, source: torch.Tensor, ids: TokenIds, *, keep_tokens: bool) -> None:
        self.rows, self.columns = source.shape  # (T, B)
        self.total = torch.zeros((), dtype=torch.float64, device=source.device)
        self.count = 0
        self.pieces: list[torch.Tensor] | None = [] if keep_tokens else None
        self.stream = _stream_tensor(ids) if keep_tokens else None

    def add(self, nll: torch.Tensor) -> None:
        """nll: (L, B) for the next L rows of targets."""
        self.total += nll.sum(dtype=torch.float64)
        self.count += nll.numel()
        if self.pieces is not None:
            self.pieces.append(nll)

    def result(self) -> EvalResult:
        loss = float(self.total) / self.count
        if self.pieces is None:
            return EvalResult(loss, _perplexity(loss), self.count)
        matrix = torch.cat(self.pieces).cpu()  # (T - 1, B)
        token_nll = _stream_order(matrix, self.rows, self.stream.numel())
        return EvalResult(loss, _perplexity(loss), self.count, token_nll, self.stream[1:])


def _stream_tensor(ids: TokenIds) -> torch.Tensor:
    """The stream as a CPU tensor (a memory map read into int64, as the in-memory corpus has it:
    a per-token export holds the whole split anyway)."""
    if isinstance(ids, np.memmap):
        return torch.from_numpy(np.asarray(ids, dtype=np.int64))
    return torch.as_tensor(ids).cpu()


def _stream_order(matrix: torch.Tensor, rows: int, n_stream: int) -> torch.Tensor:
    """Undo batchify's layout: ``matrix (T - 1, B)`` -> ``(N - 1,)``, NaN where not scored.

    Column b holds stream positions ``b*T .. b*T + T - 1``, so ``matrix[t, b]`` predicts
    position ``b*T + t + 1`` from position ``i = b*T + t``.
    """
    columns = matrix.shape[1]
    flat = matrix.new_full((n_stream,), math.nan)
    flat[: rows * columns].view(columns, rows)[:, : rows - 1] = matrix.t()  # (B, T - 1)
    return flat[: n_stream - 1]


def _perplexity(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@contextmanager
def _scoring_mode(model: nn.Module, *, adapting: bool) -> Iterator[None]:
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


def _adaptable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Trainable parameters by name, each shared tensor once (``named_parameters`` dedups)."""
    params = {key: p for key, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError("the model has no trainable parameters (requires_grad) to adapt")
    return params


def _gradients(
    loss: torch.Tensor, params: dict[str, nn.Parameter]
) -> tuple[torch.Tensor | None, ...]:
    """d loss / d p for every parameter (None where p took no part), leaving ``.grad`` alone."""
    return torch.autograd.grad(loss, list(params.values()), allow_unused=True)


def _batchify_on(model: nn.Module, ids: TokenIds, batch_size: int, name: str) -> torch.Tensor:
    """``batchify(ids, batch_size)`` ``(T, B)`` on the model's device; errors name ``name``.
    A memory map (a ``data.memmap`` run's split) is laid out as a view that reads each segment
    from the map (:func:`highrank.data.streaming.batch_view`), never the whole split."""
    device = next(model.parameters()).device
    return batch_view(ids, batch_size, name=name).to(device)


def _segments(
    source: torch.Tensor, bptt: int, progress: bool, desc: str, limit: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(input, target)`` segments of ``source`` in order (at most ``limit``), with a
    progress bar when ``progress`` (:mod:`highrank.util.progress`)."""
    total = math.ceil((source.shape[0] - 1) / bptt)
    if limit is not None:
        total = min(total, limit)
    segments = iter_batches(source, bptt)
    with progress_bar(total=total, desc=desc, unit="seg", disable=not progress) as bar:
        for _ in range(total):
            yield next(segments)
            bar.update()


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")


def _check_non_negative(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0; got {value!r}")
