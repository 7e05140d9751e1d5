"""Dynamic evaluation (Krause, Kahembwe, Murray & Renals, "Dynamic Evaluation of Neural Sequence
Models", 2017; the "RMS" variant of Sec. 4 as shipped with the MoS code, Yang et al. 2018)
adapts the model to the recent history while it is being scored:

1. :func:`gradient_statistics`: ``MS_p = sqrt(sum_s grad_s(p)^2)`` over the training set
   (B = 100, segments of 5, state carried).
2. :func:`decay_rates`: ``decay_p = MS_p / sum_q mean(MS_q)``, clipped at ``1 / lambda``.
3. :func:`dynamic_evaluate`: B = 1, segments of 5; score a segment, then
   ``theta <- theta + lambda * decay ⊙ (theta_0 - theta) - eta * grad / (MS + epsilon)``,
   theta_0 being the trained parameters (the global prior). :data:`DYNAMIC_EVAL_DEFAULTS`
   holds the published (eta, epsilon, lambda). A segment whose NLL is not finite stops it
   (:class:`~highrank.train.TrainingError`, naming the segment and any statistics of 0:
   their elements step by ``eta * grad / epsilon``), the parameters restored.

Unlike the public MoS port (which adapts in train mode and so keeps weight drop on), every
dropout is off both while collecting the statistics and while adapting. Gradients are taken
with :func:`torch.autograd.grad`, so no ``.grad`` attribute of the caller's model is touched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from highrank.evaluate.scoring import (
    EvalResult,
    NllTally,
    TokenIds,
    batchify_on,
    scoring_mode,
    segments,
)
from highrank.models import LanguageModel
from highrank.runs.run_dir import RunDirError
from highrank.train.state import TrainingError
from highrank.util.checks import check_positive_int
from highrank.util.denormals import flush_denormals

# Krause et al. (2017) hyperparameters as used for AWD-LSTM-MoS (Yang et al., 2018, Sec. 3);
# the keys are the keyword arguments of dynamic_evaluate (and the [dynamic_eval] config keys).
DYNAMIC_EVAL_DEFAULTS: dict[str, dict[str, float]] = {
    "ptb": {"lr": 0.002, "epsilon": 0.001, "prior_decay": 0.075},
    "wt2": {"lr": 0.002, "epsilon": 0.002, "prior_decay": 0.02},
}


def refuse_transformer_dynamic_eval(config) -> None:
    """Dynamic evaluation (segments of 5, state carried) is defined for recurrent models: a
    Transformer window would see only its own 5 tokens, so the figure would mean nothing."""
    if config.model.backbone != "awd-lstm":
        raise RunDirError(
            f'dynamic evaluation needs a recurrent run (model.backbone = "awd-lstm"); this run '
            f"is a {config.model.backbone!r} model, whose windows carry no state between the "
            f"segments of {config.dynamic_eval.bptt} tokens that dynamic evaluation scores; "
            f"use `highrank eval` instead"
        )


# ---- dynamic evaluation: gradient statistics and decay rates --------------------------------


@flush_denormals()
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
    check_positive_int("bptt", bptt)
    if max_batches is not None:
        check_positive_int("max_batches", max_batches)
    params = _adaptable_parameters(model)
    source = batchify_on(model, train_ids, batch_size, name)  # (T, B)
    squares = {key: torch.zeros_like(p) for key, p in params.items()}
    with scoring_mode(model, adapting=True):
        state = model.init_state(batch_size)
        for tokens, target in segments(source, bptt, progress, "grad stats", max_batches):
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


@flush_denormals()
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
    source = batchify_on(model, ids, batch_size, name)  # (T, B)
    rule = _UpdateRule(params, stats, decay_rates(stats, prior_decay), lr, epsilon, prior_decay)
    tally = NllTally(source, ids, keep_tokens=return_token_nll)
    try:
        with scoring_mode(model, adapting=True):
            state = model.init_state(batch_size)
            finite = FiniteWatch(bptt, stats)
            for tokens, target in segments(source, bptt, progress, "dynamic eval"):
                nll, state = model.nll(tokens, target, state)  # (L, B)
                finite.add(nll)
                tally.add(nll.detach())  # scored before the update
                rule.step(_gradients(nll.mean(), params))
                state = model.backbone.detach_state(state)
            finite.check()
    finally:
        rule.restore_prior()
    return tally.result()


class FiniteWatch:
    """Stops dynamic evaluation once a segment's NLL is not finite (TrainingError naming the
    first such segment). Checked every segment on the CPU; on an accelerator the flags stay
    on the device and are read every ``ACCELERATOR_EVERY`` segments (a read waits for it)."""

    ACCELERATOR_EVERY = 64

    def __init__(self, bptt: int, stats: Mapping[str, torch.Tensor]) -> None:
        self.bptt, self.stats = bptt, stats
        self.checked = 0  # segments read so far
        self.pending: list[torch.Tensor] = []  # per segment since: a 0-d bool, True: not finite

    def add(self, nll: torch.Tensor) -> None:
        self.pending.append(~torch.isfinite(nll.detach()).all())
        if nll.device.type == "cpu" or len(self.pending) == self.ACCELERATOR_EVERY:
            self.check()

    def check(self) -> None:
        """Read the pending flags; raise at the first non-finite segment."""
        if not self.pending:
            return
        bad = torch.stack(self.pending).nonzero()
        if len(bad):
            raise TrainingError(_diverged(self.checked + int(bad[0, 0]), self.bptt, self.stats))
        self.checked += len(self.pending)
        self.pending = []


def unmeasured_statistics(stats: Mapping[str, torch.Tensor]) -> tuple[int, list[str]]:
    """How many elements of ``stats`` are 0 (their parameters took no part in the segments
    the statistics came from), and the names of the tensors holding them. Such an element's
    step is ``lr * grad / epsilon``: with the published epsilon, a thousand times a measured
    one's."""
    names = [key for key, ms in stats.items() if bool((ms == 0).any())]
    return sum(int((stats[key] == 0).sum()) for key in names), names


def _diverged(index: int, bptt: int, stats: Mapping[str, torch.Tensor]) -> str:
    if index == 0:
        return (
            "dynamic evaluation stopped: the first segment's NLL is not finite before any "
            "adaptation: the checkpoint itself scores non-finite values (check it with "
            "`highrank eval`)"
        )
    zeros, names = unmeasured_statistics(stats)
    advice = "lower --lr or raise --epsilon"
    if zeros:
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        advice = (
            f"{zeros:,} elements of the gradient statistics are 0 ({shown}), and their steps "
            "lr * grad / epsilon: compute the statistics over more training segments "
            f"(--max-stats-batches), or {advice}"
        )
    return (
        f"dynamic evaluation diverged: segment {index + 1} (from token {index * bptt:,} of "
        f"each column) scores a non-finite NLL after {index} adapting steps; the model's "
        f"parameters are restored; {advice}"
    )


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
    check_positive_int("bptt", bptt)


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


def _check_non_negative(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{name} must be a number >= 0; got {value!r}")
