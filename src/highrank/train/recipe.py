"""The recipe interface: what the generic loop (:mod:`highrank.train.loop`) asks of a schedule.

The loop owns what every language-model training run does the same way: steps through an
epoch, the step counter and ``--max-steps``, timing and the metrics lines, the progress bar,
validation (at every epoch end and, when the recipe asks, every ``eval_every`` steps), the best
and periodic checkpoints, the non-finite guard (``train.max_nonfinite_skips`` skipped steps in a
row stop the run), exact resume (model, progress, every RNG, the metrics offset), and the
``TrainOptions.callback``. A *recipe* owns everything that differs between model families:
which data a step reads, the optimizer and its learning-rate schedule, what one step computes,
how validation is computed and with which weights, and what happens after a validation.

A recipe is built by ``Recipe(config, model, corpus, stage, device)`` (a fresh one is at the
start of epoch 1 with a new optimizer) and registered under its ``model.backbone`` in
:data:`highrank.train.runner.RECIPES`. The loop then calls, in this order::

    size = recipe.epoch_size()                      # once per epoch
    while progress.position < size.positions:       # one step:
        (stop here on --max-steps, SIGINT, SIGTERM: the state between steps is saved)
        batch = recipe.next_batch(progress)         #   data at progress.position (may draw RNG)
        result = recipe.train_step(batch)           #   forward, backward, guard, update (timed)
        progress.position += batch.advance
        if recipe.eval_every and step % eval_every == 0 and the epoch is not over:
            evaluate()                              #   mid-epoch, "kind": "eval" record
    evaluate()                                      # at the epoch end, "kind": "epoch" record
    recipe.start_epoch(progress)                    # progress.epoch is the new epoch

    evaluate():  loss = recipe.validate()           # eval mode, the weights to evaluate
                 verdict = recipe.after_validation(loss, progress)   # e.g. NT-ASGD switch
                 log, print verdict.message, stop if verdict.stop_reason

Checkpoints hold ``recipe.evaluation_state_dict()`` as ``"model"`` and, under ``"training"``,
``recipe.model.state_dict()`` as ``"model"``, every key of ``recipe.state_dict()`` (optimizer,
schedule, carried hidden state, ...), the global RNGs plus ``recipe.generators()`` under
``"rng"``, the progress and the metrics offset. A resumed recipe is built as a fresh one and
then given ``recipe.load_state_dict(training)`` (the whole ``"training"`` dict); its generators
are restored after that, last.

Writing a second recipe (the Transformer schedule, say: AdamW, linear warm-up then cosine or
inverse-sqrt decay, gradient accumulation, bf16 autocast, fixed-length windows, evaluation
every N steps) means one class with these methods in its own module and one line in
``RECIPES``: set the step's lr in ``train_step`` from an update counter the recipe keeps (and
saves) or from ``progress.step`` read in ``next_batch``, accumulate micro-batches inside one
``train_step`` (``batch.tokens`` counts them all), use
:func:`highrank.train.steps.backward_or_skip` and :func:`highrank.train.steps.clip_or_skip`
for the non-finite guard, set ``eval_every``, keep the schedule's state in ``state_dict`` (an
AdamW ``state_dict`` already holds its step counts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from highrank.train.state import Progress


@dataclass(frozen=True)
class Stage:
    """One stage of a run: its name, epoch limit and checkpoint names under ``checkpoints/``."""

    name: str  # "train" | "finetune"
    epochs: int
    last: str  # the resumable checkpoint, saved every train.checkpoint_every steps
    best: str  # saved when validation improves on the best so far


class EpochSize(NamedTuple):
    """An epoch is ``positions`` positions (rows of a batched stream, windows, ...), each
    ``tokens_per_position`` tokens wide (for the progress bar)."""

    positions: int
    tokens_per_position: int


class StepBatch(NamedTuple):
    """What :meth:`Recipe.next_batch` hands to :meth:`Recipe.train_step`."""

    data: Any  # whatever train_step reads, e.g. (tokens, target), each (L, B)
    advance: int  # positions of the epoch this step consumes
    tokens: int  # target tokens of the step (micro-batches included): loss weight, tokens/s
    seq_len: int  # window length (StepInfo.seq_len)


class StepResult(NamedTuple):
    """What one step did: the mean head NLL per target token, or None when the non-finite
    guard skipped the step (no update, gradients zeroed) and why."""

    nll: float | None
    skip_reason: str = ""


class Verdict(NamedTuple):
    """What a recipe decided after a validation."""

    fields: Mapping[str, Any]  # added to the metrics record, e.g. {"switched": True}
    stop_reason: str = ""  # non-empty: the stage ends (TrainResult.stop_reason), e.g. "nonmono"
    message: str = ""  # printed after the validation line, e.g. "switching to averaged SGD"


class Recipe(Protocol):
    """A training schedule the loop runs (see the module docstring for the calling order)."""

    model: nn.Module  # a highrank.models.LanguageModel
    eval_every: int | None  # steps between mid-epoch validations; None: at epoch ends only

    @property
    def lr(self) -> float:
        """The learning rate now (logged; named in advice)."""

    @property
    def phase(self) -> str:
        """A short name of the optimizer phase, logged: "sgd", "asgd", "warmup", ..."""

    def epoch_size(self) -> EpochSize: ...

    def start_epoch(self, progress: Progress) -> None:
        """The loop moved to epoch ``progress.epoch`` (not called for the first epoch)."""

    def next_batch(self, progress: Progress) -> StepBatch:
        """The step's data, starting at ``progress.position`` of epoch ``progress.epoch``."""

    def train_step(self, batch: StepBatch) -> StepResult:
        """One optimizer update on ``batch``, or a skip when the loss or gradient is not
        finite (then the weights and optimizer state must be as before)."""

    def validate(self) -> float:
        """Mean NLL per token of the validation split with the weights to evaluate (e.g. the
        ASGD averages); may leave the model in eval mode."""

    def after_validation(self, val_loss: float, progress: Progress) -> Verdict:
        """React to a validation (``progress`` already holds the new best, if it is one)."""

    def evaluation_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights to evaluate, saved as the checkpoint's ``"model"``."""

    def state_dict(self) -> dict[str, Any]:
        """The recipe's resumable state (tensors, dicts, lists, numbers, strings, None)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from a checkpoint's ``"training"`` dict (it holds more keys than ours)."""

    def generators(self) -> dict[str, torch.Generator]:
        """The recipe's own random streams, checkpointed under ``training["rng"][name]``."""

    def divergence_advice(self) -> str:
        """One sentence on what to change when steps keep being non-finite."""


@dataclass(frozen=True)
class RunKind:
    """How runs of a family start and continue, besides its recipe: the word-corpus language
    models share one (:data:`highrank.train.runner.LANGUAGE_MODEL`), translation has its own
    (:data:`highrank.train.seq2seq.TRANSLATION`); :data:`highrank.train.runner.RUN_KINDS`
    maps ``model.backbone`` to it.

    Attributes:
        name: what its training is called in messages (``"translation training"``).
        start: ``start(config, stage, device, options, command, init_from) -> TrainResult``,
            a new run in ``config.run.out_dir`` (absolute paths, the run locked).
        resume: ``resume(run, stage, payload, path, config, options) -> Trainer``, a trainer
            in exactly the state of the checkpoint ``payload`` (read from ``path``).
        vocab_size: ``vocab_size(config) -> int``, the vocabulary the model is built for.
        torchrun: whether it trains as several processes under torchrun (False: process 0
            alone does it all).
        no_finetune: why ``highrank finetune`` does not apply, ``{run}`` standing for the run
            directory; None: it does.
    """

    name: str
    start: Callable[..., Any]
    resume: Callable[..., Any]
    vocab_size: Callable[[Any], int]
    torchrun: bool = True
    no_finetune: str | None = None


__all__ = ["EpochSize", "Recipe", "RunKind", "Stage", "StepBatch", "StepResult", "Verdict"]
