"""Training AWD-LSTM language models: SGD, then averaged SGD, with checkpoints that resume exactly.

The recipe of Merity, Keskar & Socher, "Regularizing and Optimizing LSTM Language Models"
(ICLR 2018) as the AWD-LSTM and MoS (Yang et al., ICLR 2018) code run it. One training step:

    seq_len ~ variable BPTT (Sec. 4.1)                   highrank.backbones.variable_bptt_length
    tokens, target = rows [i, i + L) of the (T, B) training batch, L = min(seq_len, rows left)
    loss = head NLL (mean over L x B tokens; head loss chunked by train.chunk_size, "auto" when
           unset) + AR + TAR (Sec. 4.6), hidden state carried in
    backward; clip the gradient norm to train.clip
    SGD step (weight decay train.weight_decay on every parameter) with every group's lr scaled
    by L / bptt for this step (Sec. 4.1); the hidden state is detached for the next window

The lr is scaled by the length actually used: the reference scales the shorter last window of
an epoch by the drawn length instead. A step whose loss or gradient norm is NaN/inf is skipped
(no update, gradients zeroed, hidden state kept); more than train.max_nonfinite_skips in a row
stop the run with a :class:`TrainingError`.

After each epoch: validation loss (batch train.eval_batch_size, segments of bptt, state
carried, ``exp(total NLL / tokens)`` = perplexity) with the ASGD *averaged* weights once
switched; ``best.pt`` when it improves; then the switch policy (:mod:`highrank.optim`: NT-ASGD,
ET-ASGD, or plain SGD) may switch to averaged SGD. Finetuning (:func:`finetune`) restarts
averaged SGD from ``best.pt`` with finetune.lr and stops by the same non-monotone rule (MoS
``finetune.py``).

Public API::

    train(config, *, options=TrainOptions(), command=None) -> TrainResult
    resume(run_dir, *, overrides=(), options=TrainOptions(), command=None) -> TrainResult
    finetune(run_dir, *, resume=False, overrides=(), options=TrainOptions(), command=None)
    optimization_step(model, optimizer, params, tokens, target, state, *, chunk_size, clip,
                      lr_scale) -> StepOutcome          # one training step, as the trainer's
    evaluate_loss(model, source, bptt, *, chunk_size="auto") -> float  # mean NLL per token
    parameter_count(config, vocab_size) -> int                        # on the meta device
    corpus_vocab_size(config) -> int

``last.pt`` is saved every ``train.checkpoint_every`` steps, at every epoch end and when
``TrainOptions.max_steps`` stops a run after that many steps in total: resuming it continues
bit-identically (same losses, same weights) on the same machine.
The run directory and checkpoint layouts are described in :mod:`highrank.runs` and
:mod:`highrank.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from tqdm.auto import tqdm

from highrank.backbones import AWDLSTMState, variable_bptt_length
from highrank.checkpoint import (
    CheckpointError,
    capture_rng,
    config_of,
    evaluation_state_dict,
    load_checkpoint,
    load_resumable,
    load_weights,
    restore_rng,
    save_checkpoint,
)
from highrank.config import (
    Config,
    ConfigError,
    config_from_dict,
    config_to_dict,
    parse_override,
)
from highrank.data import Corpus, get_batch, iter_batches, load_corpus
from highrank.model import LanguageModel, build_model, count_parameters
from highrank.optim import (
    NonMonotoneTrigger,
    SwitchTrigger,
    averaged_parameters,
    build_trigger,
    scaled_lr,
    switch_to_asgd,
)
from highrank.runs import MetricsLog, RunDir, TensorBoardLog

# Keys a resumed run may change: they do not alter the computation already done.
RESUME_OVERRIDES = (
    "train.epochs",
    "train.log_every",
    "train.checkpoint_every",
    "train.max_nonfinite_skips",
    "run.device",
)
FINETUNE_OVERRIDES = ("finetune.lr", "finetune.epochs", *RESUME_OVERRIDES[1:], "train.nonmono")
FINETUNE_RESUME_OVERRIDES = ("finetune.epochs", *RESUME_OVERRIDES[1:])


class TrainingError(RuntimeError):
    """Training cannot go on (diverged); the message names the step and what to try."""


# ---- state that advances, all of it checkpointed ----------------------------------------------


@dataclass
class Meter:
    """Running totals of training steps (an epoch, or a logging window)."""

    loss_sum: float = 0.0  # sum over steps of (mean head NLL x tokens)
    tokens: int = 0  # tokens of the steps that were not skipped
    steps: int = 0
    skipped: int = 0
    seconds: float = 0.0  # time in training steps (not in validation)

    def add(self, loss: float | None, tokens: int, seconds: float) -> None:
        """One step; ``loss`` None: the step was skipped."""
        self.steps += 1
        self.seconds += seconds
        if loss is None:
            self.skipped += 1
            return
        self.loss_sum += loss * tokens
        self.tokens += tokens

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.tokens if self.tokens else math.nan

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Progress:
    """Where a run is: stage, epoch (1-based), the next row of the epoch's training batch, the
    step counter, the best validation loss, and the counters of the metrics lines."""

    stage: str = "train"
    epoch: int = 1
    position: int = 0
    step: int = 0
    best_val_loss: float = math.inf
    best_epoch: int = 0
    consecutive_skips: int = 0
    done: bool = False
    stop_reason: str = ""
    epoch_meter: Meter = field(default_factory=Meter)
    window_meter: Meter = field(default_factory=Meter)

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> Progress:
        values = dict(state)
        values["epoch_meter"] = Meter(**values["epoch_meter"])
        values["window_meter"] = Meter(**values["window_meter"])
        return cls(**values)


@dataclass(frozen=True)
class Stage:
    """What differs between training and finetuning."""

    name: str  # "train" | "finetune"
    lr: float
    epochs: int
    last: str  # checkpoint names under <run>/checkpoints
    best: str
    trigger_stops: bool  # finetuning: the non-monotone rule stops instead of switching


def train_stage(config: Config) -> Stage:
    return Stage("train", config.train.lr, config.train.epochs, "last", "best", False)


def finetune_stage(config: Config) -> Stage:
    return Stage(
        "finetune", config.finetune.lr, config.finetune.epochs, "finetune-last", "finetuned", True
    )


class StepInfo(NamedTuple):
    """What a :attr:`TrainOptions.callback` sees after each step."""

    stage: str
    epoch: int
    step: int
    seq_len: int
    loss: float  # mean head NLL of the step; NaN when skipped
    skipped: bool


@dataclass
class TrainOptions:
    """How to run (not what to train: that is the config).

    Attributes:
        max_steps: stop once this many steps were taken in total (over all epochs and
            resumes), saving last.pt; None: run to the end.
        progress: show a tqdm bar per epoch.
        callback: called with a :class:`StepInfo` after every step (and after a checkpoint due
            at that step); an exception it raises ends the run as a crash would.
    """

    max_steps: int | None = None
    progress: bool = True
    callback: Callable[[StepInfo], None] | None = None


@dataclass(frozen=True)
class TrainResult:
    """How a run (or one stage of it) ended."""

    run_dir: Path
    stage: str
    epochs_completed: int
    steps: int
    best_val_loss: float
    best_epoch: int
    phase: str  # "sgd" | "asgd"
    stop_reason: str  # "epochs" | "nonmono" | "max_steps"

    @property
    def best_val_ppl(self) -> float:
        return math.exp(self.best_val_loss) if math.isfinite(self.best_val_loss) else math.inf


class Splits(NamedTuple):
    train: torch.Tensor  # (T, batch_size)
    valid: torch.Tensor  # (T, eval_batch_size)


# ---- the pieces of a step ---------------------------------------------------------------------


def training_loss(
    model: LanguageModel,
    tokens: torch.Tensor,
    target: torch.Tensor,
    state: AWDLSTMState | None,
    chunk_size: int | None | str,
) -> tuple[torch.Tensor, torch.Tensor, AWDLSTMState]:
    """``(loss to minimise, head NLL, new state)`` of one window ``(L, B)``: the mean NLL plus
    AR/TAR (Merity et al., 2018, Sec. 4.6)."""
    nll, state, extras = model(tokens, target, state, chunk_size=chunk_size)
    return nll + model.backbone.regularization_loss(extras), nll, state


class StepOutcome(NamedTuple):
    """What :func:`optimization_step` did."""

    nll: float | None  # mean head NLL of the window; None: the step was skipped
    state: AWDLSTMState  # the new state, detached; the state passed in when skipped
    skip_reason: str  # why it was skipped ("" when it was not)


def optimization_step(
    model: LanguageModel,
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    tokens: torch.Tensor,
    target: torch.Tensor,
    state: AWDLSTMState,
    *,
    chunk_size: int | None | str,
    clip: float,
    lr_scale: float,
) -> StepOutcome:
    """One training step on a window ``(L, B)``: forward (:func:`training_loss`), backward,
    clip the gradient norm of ``params`` to ``clip`` (0: no clipping), optimizer step with
    every group's lr scaled by ``lr_scale``. A non-finite loss or gradient norm skips the step
    (no update, gradients zeroed) and says why."""
    optimizer.zero_grad(set_to_none=True)
    loss, nll, new_state = training_loss(model, tokens, target, state, chunk_size)
    if not bool(torch.isfinite(loss.detach())):
        return StepOutcome(None, state, f"loss was {loss.detach().item()}")
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, clip or math.inf)  # norm checked even so
    if not bool(torch.isfinite(norm)):
        optimizer.zero_grad(set_to_none=True)
        return StepOutcome(None, state, f"gradient norm was {float(norm)}")
    with scaled_lr(optimizer, lr_scale):
        optimizer.step()
    return StepOutcome(nll.detach().item(), model.backbone.detach_state(new_state), "")


@torch.no_grad()
def evaluate_loss(
    model: LanguageModel,
    source: torch.Tensor,
    bptt: int,
    *,
    chunk_size: int | None | str = "auto",
) -> float:
    """Mean NLL per predicted token of ``source (T, B)`` (from :func:`highrank.data.batchify`),
    read in segments of ``bptt`` with the hidden state carried (AWD-LSTM ``evaluate``).
    Perplexity is ``exp`` of it. Leaves the model in eval mode."""
    model.eval()
    state = model.init_state(source.size(1))
    total, count = 0.0, 0
    for tokens, target in iter_batches(source, bptt):
        hidden, state, _ = model.backbone(tokens, state)  # (L, B, d_last)
        total += float(model.head.loss(hidden, target, reduction="sum", chunk_size=chunk_size))
        count += target.numel()
    return total / count


def head_chunk_size(config: Config) -> int | str:
    """``train.chunk_size``, or ``"auto"`` when unset: the heads' default, chunks of about
    2**21 logits, which bounds memory and avoids allocating (N, K, V) tensors every step (on
    2 CPU cores the small MoS recipe, K = 5, ran about 1,300 tokens/s unchunked at best and
    2,600 with "auto"; the small softmax recipe 5,100 and 6,600)."""
    return "auto" if config.train.chunk_size is None else config.train.chunk_size


def build_optimizer(
    model: LanguageModel, lr: float, weight_decay: float, phase: str = "sgd"
) -> torch.optim.Optimizer:
    """SGD over the model's parameter groups (PLIF's slopes keep their own lr), weight decay on
    all of them; ``phase="asgd"``: the same groups under averaged SGD."""
    optimizer = torch.optim.SGD(model.parameter_groups(lr), lr=lr, weight_decay=weight_decay)
    return switch_to_asgd(optimizer) if phase == "asgd" else optimizer


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def bptt_generator(seed: int) -> torch.Generator:
    """The generator of the variable BPTT lengths, its own stream (checkpointed separately)."""
    return torch.Generator().manual_seed(seed + 1)


def resolve_device(name: str) -> torch.device:
    """``run.device``: ``"auto"`` is CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ---- the trainer ------------------------------------------------------------------------------


class Trainer:
    """One stage (training or finetuning) of a run; :meth:`run` it."""

    def __init__(
        self,
        config: Config,
        run: RunDir,
        stage: Stage,
        model: LanguageModel,
        optimizer: torch.optim.Optimizer,
        trigger: SwitchTrigger,
        splits: Splits,
        progress: Progress,
        bptt_rng: torch.Generator,
        options: TrainOptions,
        hidden: AWDLSTMState | None = None,
    ) -> None:
        self.config, self.run_dir, self.stage = config, run, stage
        self.model, self.optimizer, self.trigger = model, optimizer, trigger
        self.splits, self.progress, self.bptt_rng = splits, progress, bptt_rng
        self.options = options
        self.hidden = hidden if hidden is not None else model.init_state(splits.train.size(1))
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.metrics = MetricsLog(run.metrics_file)
        self.tensorboard = TensorBoardLog(
            run.path / "tensorboard" / stage.name, purge_step=progress.step or None
        )
        self._last_saved: tuple[int, int, int] | None = None
        self._skip_reason = ""
        self._last_loss = math.nan

    @property
    def phase(self) -> str:
        return "asgd" if isinstance(self.optimizer, torch.optim.ASGD) else "sgd"

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def run(self) -> TrainResult:
        """Epochs until the stage ends or ``options.max_steps`` is reached."""
        try:
            while not self.progress.done:
                if not self._run_epoch():
                    break
                self._end_epoch()
        finally:
            self.tensorboard.close()
        return self.result()

    def result(self) -> TrainResult:
        p = self.progress
        return TrainResult(
            self.run_dir.path,
            self.stage.name,
            p.epoch - 1,
            p.step,
            p.best_val_loss,
            p.best_epoch,
            self.phase,
            p.stop_reason,
        )

    # ---- an epoch of steps ------------------------------------------------------------------

    def _run_epoch(self) -> bool:
        """Steps from the saved position to the end of the epoch; False if stopped early."""
        self.model.train()
        rows, batch = self.splits.train.shape
        with self._progress_bar(rows, batch) as bar:
            while self.progress.position < rows - 1:
                if self._reached_max_steps():
                    self.progress.stop_reason = "max_steps"
                    self.save_last()
                    return False
                length = self._step()
                self._show(bar, length * batch)
                self._after_step(length)
        return True

    def _reached_max_steps(self) -> bool:
        limit = self.options.max_steps
        return limit is not None and self.progress.step >= limit

    def _step(self) -> int:
        """One window of variable length; returns its length L."""
        p, train = self.progress, self.config.train
        drawn = variable_bptt_length(train.bptt, self.bptt_rng, train.max_seq_len_delta).seq_len
        tokens, target = get_batch(self.splits.train, p.position, drawn)  # (L, B) each
        start = time.perf_counter()
        loss = self._optimize(tokens, target)
        seconds = time.perf_counter() - start
        p.position += tokens.size(0)
        p.step += 1
        for meter in (p.epoch_meter, p.window_meter):
            meter.add(loss, tokens.numel(), seconds)
        self._count_skip(loss is None)
        self._last_loss = math.nan if loss is None else loss
        return tokens.size(0)

    def _optimize(self, tokens: torch.Tensor, target: torch.Tensor) -> float | None:
        """Forward, backward, clip, scaled SGD step; the head NLL, or None if skipped."""
        train = self.config.train
        outcome = optimization_step(
            self.model,
            self.optimizer,
            self.params,
            tokens,
            target,
            self.hidden,
            chunk_size=head_chunk_size(self.config),
            clip=train.clip,
            lr_scale=tokens.size(0) / train.bptt,
        )
        if outcome.nll is None:
            self._skip_reason = outcome.skip_reason
            return None
        self.hidden = outcome.state
        return outcome.nll

    def _count_skip(self, skipped: bool) -> None:
        p = self.progress
        p.consecutive_skips = p.consecutive_skips + 1 if skipped else 0
        allowed = self.config.train.max_nonfinite_skips
        if p.consecutive_skips > allowed:
            raise TrainingError(self._divergence_message(allowed))

    def _divergence_message(self, allowed: int) -> str:
        p, train = self.progress, self.config.train
        last = self.run_dir.checkpoint(self.stage.last)
        return (
            f"{self.stage.name} step {p.step} (epoch {p.epoch}): the {self._skip_reason}; "
            f"{p.consecutive_skips} consecutive steps were non-finite, more than "
            f"train.max_nonfinite_skips = {allowed}. Those steps changed nothing and the last "
            f"checkpoint ({last}) holds finite weights. Try a lower learning rate (now "
            f"lr = {self.lr:g}, e.g. --train.lr={self.lr / 2:g}) or a tighter gradient clip "
            f"(train.clip = {train.clip:g}, e.g. --train.clip={(train.clip or 1.0) / 2:g})"
        )

    def _after_step(self, length: int) -> None:
        p = self.progress
        if p.step % self.config.train.log_every == 0:
            self._log_window()
        if p.step % self.config.train.checkpoint_every == 0:
            self.save_last()
        if self.options.callback is not None:
            skipped = math.isnan(self._last_loss)
            info = StepInfo(self.stage.name, p.epoch, p.step, length, self._last_loss, skipped)
            self.options.callback(info)

    # ---- the end of an epoch ----------------------------------------------------------------

    def _end_epoch(self) -> None:
        """Validate, maybe switch (or stop), log, move to the next epoch, save."""
        p = self.progress
        start = time.perf_counter()
        val_loss = self.validate()
        eval_seconds = time.perf_counter() - start
        improved = val_loss < p.best_val_loss
        if improved:
            p.best_val_loss, p.best_epoch = val_loss, p.epoch
        phase = self.phase
        fired = self.trigger.update(val_loss)
        self._log_epoch(val_loss, phase, improved, fired, eval_seconds)
        self._apply_trigger(fired)
        self._next_epoch()
        if improved:  # after the epoch advanced: best.pt resumes cleanly at this boundary
            self._save(self.stage.best, keep_previous=False)
        self.save_last()

    def validate(self) -> float:
        """Validation loss of the weights to evaluate (the averages once on ASGD)."""
        with averaged_parameters(self.optimizer):
            loss = evaluate_loss(
                self.model,
                self.splits.valid,
                self.config.train.bptt,
                chunk_size=head_chunk_size(self.config),
            )
        if not math.isfinite(loss):
            raise TrainingError(
                f"{self.stage.name} epoch {self.progress.epoch}: the validation loss is {loss} "
                f"although the weights are finite; try a lower learning rate (train.lr = "
                f"{self.lr:g}) and restart from an earlier checkpoint"
            )
        return loss

    def _apply_trigger(self, fired: bool) -> None:
        if not fired:
            return
        if self.stage.trigger_stops:
            self.progress.done, self.progress.stop_reason = True, "nonmono"
            _say(f"{self.stage.name}: validation stopped improving (non-monotone rule); done")
            return
        self.optimizer = switch_to_asgd(self.optimizer)
        policy = self.config.train.optimizer
        _say(f"epoch {self.progress.epoch}: switching to averaged SGD ({policy})")

    def _next_epoch(self) -> None:
        p = self.progress
        p.epoch, p.position, p.epoch_meter = p.epoch + 1, 0, Meter()
        self.hidden = self.model.init_state(self.splits.train.size(1))  # as AWD-LSTM, per epoch
        if p.epoch > self.stage.epochs and not p.done:
            p.done, p.stop_reason = True, "epochs"

    # ---- logging ----------------------------------------------------------------------------

    def _record(self, kind: str, meter: Meter) -> dict[str, Any]:
        p = self.progress
        return {
            "kind": kind,
            "stage": self.stage.name,
            "epoch": p.epoch,
            "step": p.step,
            "train_loss": _finite_or_none(meter.mean_loss),
            "train_ppl": _finite_or_none(_ppl(meter.mean_loss)),
            "lr": self.lr,
            "phase": self.phase,
            "tokens_per_s": round(meter.tokens_per_s, 1),
            "skipped_steps": meter.skipped,
            "seconds": round(meter.seconds, 3),
        }

    def _log_window(self) -> None:
        self._write(self._record("step", self.progress.window_meter))
        self.progress.window_meter = Meter()

    def _log_epoch(
        self, val_loss: float, phase: str, improved: bool, fired: bool, eval_seconds: float
    ) -> None:
        record = self._record("epoch", self.progress.epoch_meter)
        record.update(
            phase=phase,
            val_loss=val_loss,
            val_ppl=_finite_or_none(_ppl(val_loss)),
            best_val_loss=self.progress.best_val_loss,
            improved=improved,
            eval_seconds=round(eval_seconds, 3),
        )
        record["stopped" if self.stage.trigger_stops else "switched"] = fired
        self._write(record)
        _say(_epoch_line(record))

    def _write(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        self.tensorboard.write(record, self.progress.step)

    def _progress_bar(self, rows: int, batch: int) -> tqdm:
        return tqdm(
            total=(rows - 1) * batch,
            initial=self.progress.position * batch,
            desc=f"{self.stage.name} epoch {self.progress.epoch}",
            unit="tok",
            unit_scale=True,
            leave=False,
            dynamic_ncols=True,
            file=sys.stderr,
            disable=not self.options.progress,
        )

    def _show(self, bar: tqdm, tokens: int) -> None:
        if bar.disable:
            return
        meter = self.progress.epoch_meter
        bar.update(tokens)
        postfix = {"loss": f"{meter.mean_loss:.3f}", "ppl": f"{_ppl(meter.mean_loss):.1f}"}
        bar.set_postfix(postfix | {"tok/s": f"{meter.tokens_per_s:,.0f}"}, refresh=False)

    # ---- checkpoints ------------------------------------------------------------------------

    def save_last(self) -> None:
        """Save the resumable state as last.pt (keeping the previous one), once per position."""
        p = self.progress
        key = (p.epoch, p.position, p.step)
        if key != self._last_saved:
            self._save(self.stage.last, keep_previous=True)
            self._last_saved = key

    def _save(self, name: str, *, keep_previous: bool) -> None:
        save_checkpoint(
            self.payload(name), self.run_dir.checkpoint(name), keep_previous=keep_previous
        )

    def payload(self, kind: str) -> dict[str, Any]:
        """The checkpoint contents (see :mod:`highrank.checkpoint`)."""
        return {
            "format": "highrank-checkpoint",
            "version": 1,
            "kind": kind,
            "stage": self.stage.name,
            "config": config_to_dict(self.config),
            "vocab_size": self.model.backbone.vocab_size,
            "model": evaluation_state_dict(self.model, self.optimizer),
            "training": {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "phase": self.phase,
                "trigger": self.trigger.state_dict(),
                "rng": capture_rng(self.bptt_rng),
                "progress": dataclasses.asdict(self.progress),
                "hidden": [[h, c] for h, c in self.hidden],
                "metrics_offset": self.metrics.offset(),
            },
        }


def _ppl(loss: float) -> float:
    return math.exp(loss) if math.isfinite(loss) and loss < 700 else math.inf


def _finite_or_none(value: float) -> float | None:
    """JSON has no NaN/inf: such values are written as null."""
    return value if math.isfinite(value) else None


def _epoch_line(record: Mapping[str, Any]) -> str:
    val_ppl = record["val_ppl"]
    train_ppl = record["train_ppl"]
    return (
        f"| {record['stage']} epoch {record['epoch']:3d} | step {record['step']} "
        f"| train ppl {train_ppl if train_ppl is None else f'{train_ppl:8.2f}'} "
        f"| valid ppl {val_ppl if val_ppl is None else f'{val_ppl:8.2f}'}"
        f"{' (best)' if record['improved'] else ''} | lr {record['lr']:g} | {record['phase']} "
        f"| {record['tokens_per_s']:,.0f} tok/s | {record['skipped_steps']} skipped "
        f"| {record['seconds']:.1f} s |"
    )


def _say(line: str) -> None:
    tqdm.write(line, file=sys.stderr)


# ---- building a trainer: fresh, resumed, finetuning -------------------------------------------


def _absolute_paths(config: Config) -> Config:
    """The config with data.dir (and data.cache_dir) absolute, so a run resumes from anywhere."""
    data = config.data
    cache = None if data.cache_dir is None else os.path.abspath(data.cache_dir)
    data = dataclasses.replace(data, dir=os.path.abspath(data.dir), cache_dir=cache)
    return dataclasses.replace(config, data=data)


def load_splits(config: Config, device: torch.device) -> tuple[Corpus, Splits]:
    """The corpus of ``config.data`` and its train / validation batches on ``device``."""
    corpus = load_corpus(config.data.dir, mode=config.data.mode, cache_dir=config.data.cache_dir)
    train = corpus.batchify("train", config.train.batch_size).to(device)
    valid = corpus.batchify("valid", config.train.eval_batch_size).to(device)
    return corpus, Splits(train, valid)


def _restore_trainer(
    config: Config,
    run: RunDir,
    stage: Stage,
    payload: Mapping[str, Any],
    path: Path,
    options: TrainOptions,
) -> Trainer:
    """A trainer in exactly the state of a checkpoint with training state."""
    device = resolve_device(config.run.device)
    corpus, splits = load_splits(config, device)
    _check_same_vocab(run, corpus, path)
    training = payload["training"]
    model = build_model(config, len(corpus.vocab)).to(device)
    load_weights(model, training["model"], path)
    optimizer = build_optimizer(model, stage.lr, config.train.weight_decay, training["phase"])
    optimizer.load_state_dict(training["optimizer"])
    trigger = _stage_trigger(config, stage)
    trigger.load_state_dict(training["trigger"])
    progress = Progress.from_dict(training["progress"])
    _reopen_if_extended(progress, stage)
    hidden = [(h.to(device), c.to(device)) for h, c in training["hidden"]]
    rng = torch.Generator()
    restore_rng(training["rng"], rng)  # last: building the model drew from the global RNG
    MetricsLog(run.metrics_file).truncate(training["metrics_offset"])
    args = (config, run, stage, model, optimizer, trigger, splits, progress, rng, options)
    return Trainer(*args, hidden=hidden)


def _stage_trigger(config: Config, stage: Stage) -> SwitchTrigger:
    if stage.trigger_stops:
        return NonMonotoneTrigger(config.train.nonmono)
    t = config.train
    return build_trigger(t.optimizer, nonmono=t.nonmono, switch_epoch=t.switch_epoch)


def _reopen_if_extended(progress: Progress, stage: Stage) -> None:
    """A run that ended by its epoch limit continues when the limit was raised on resume."""
    if progress.done and progress.stop_reason == "epochs" and progress.epoch <= stage.epochs:
        progress.done, progress.stop_reason = False, ""


def _check_same_vocab(run: RunDir, corpus: Corpus, path: Path) -> None:
    if run.load_vocab() != corpus.vocab:
        raise CheckpointError(
            f"the corpus at {corpus.directory} has a different vocabulary from the run's "
            f"{run.vocab_file} ({len(corpus.vocab)} vs {len(run.load_vocab())} tokens): "
            f"checkpoint {path} cannot continue on it; point --data.dir at the run's corpus"
        )


def _apply_overrides(
    payload: Mapping[str, Any], path: Path, overrides: Sequence[str], allowed: Sequence[str]
) -> Config:
    """The checkpoint's config with ``overrides``, each of which must be in ``allowed``."""
    for text in overrides:
        section, key, _ = parse_override(text)
        if f"{section}.{key}" not in allowed:
            raise ConfigError(
                f"override {text!r}: {section}.{key} cannot change when continuing a run (it "
                f"would change what was already computed); allowed here: {', '.join(allowed)}"
            )
    if not overrides:
        return config_of(payload, path)
    return config_from_dict(payload["config"], overrides, source=f"{path} (stored config)")


def _command(command: Sequence[str] | None, default: Sequence[str]) -> list[str]:
    return list(command) if command is not None else list(default)


# ---- public entry points ----------------------------------------------------------------------


def train(
    config: Config, *, options: TrainOptions | None = None, command: Sequence[str] | None = None
) -> TrainResult:
    """Train the model ``config`` describes in a new run directory ``config.run.out_dir``.

    ``command`` is written to command.txt (default: ``highrank train``).
    """
    options = options or TrainOptions()
    config = _absolute_paths(config)
    device = resolve_device(config.run.device)
    corpus, splits = load_splits(config, device)
    seed_everything(config.train.seed)
    model = build_model(config, len(corpus.vocab)).to(device)
    stage = train_stage(config)
    optimizer = build_optimizer(model, stage.lr, config.train.weight_decay)
    trigger = _stage_trigger(config, stage)
    rng = bptt_generator(config.train.seed)
    command = _command(command, ["highrank", "train"])
    run = RunDir.create(config.run.out_dir, config, corpus.vocab, command)  # inputs all good
    args = (config, run, stage, model, optimizer, trigger, splits, Progress(), rng, options)
    return Trainer(*args).run()


def resume(
    run_dir: str | os.PathLike,
    *,
    overrides: Sequence[str] = (),
    options: TrainOptions | None = None,
    command: Sequence[str] | None = None,
) -> TrainResult:
    """Continue the training of ``run_dir`` from ``last.pt`` exactly where it stopped.

    An unreadable ``last.pt`` falls back to ``last.prev.pt``, then ``best.pt`` (with a
    warning). ``overrides`` may only change :data:`RESUME_OVERRIDES` (e.g. raise
    ``train.epochs``).
    """
    run = RunDir.open(run_dir)
    payload, path = load_resumable(run.checkpoints)
    if payload["stage"] != "train":
        raise CheckpointError(f"{path} is a {payload['stage']} checkpoint, not a training one")
    config = _apply_overrides(payload, path, overrides, RESUME_OVERRIDES)
    run.append_command(_command(command, ["highrank", "train", "--resume", str(run_dir)]))
    trainer = _restore_trainer(
        config, run, train_stage(config), payload, path, options or TrainOptions()
    )
    return trainer.run()


def finetune(
    run_dir: str | os.PathLike,
    *,
    resume: bool = False,
    overrides: Sequence[str] = (),
    options: TrainOptions | None = None,
    command: Sequence[str] | None = None,
) -> TrainResult:
    """Finetune a trained run (MoS ``finetune.py``): averaged SGD restarted from ``best.pt``
    with ``finetune.lr``; ``finetuned.pt`` holds the averaged weights whenever validation
    improves on the best so far; stops by the non-monotone rule (n = train.nonmono) or after
    ``finetune.epochs``. ``resume=True`` continues an interrupted finetuning exactly.
    """
    run = RunDir.open(run_dir)
    default = ["highrank", "finetune", str(run_dir), *(["--resume"] if resume else [])]
    options = options or TrainOptions()
    if resume:
        names = ("finetune-last.pt", "finetune-last.prev.pt")
        payload, path = load_resumable(run.checkpoints, names)
        config = _apply_overrides(payload, path, overrides, FINETUNE_RESUME_OVERRIDES)
        run.append_command(_command(command, default))
        trainer = _restore_trainer(config, run, finetune_stage(config), payload, path, options)
        return trainer.run()
    trainer = _start_finetune(run, overrides, options)
    run.append_command(_command(command, default))
    return trainer.run()


def _start_finetune(run: RunDir, overrides: Sequence[str], options: TrainOptions) -> Trainer:
    """A finetuning trainer on best.pt's evaluation weights with a fresh ASGD optimizer."""
    started = run.checkpoint("finetune-last")
    if started.exists():
        raise CheckpointError(
            f"{run.path} was already finetuned ({started} exists); continue it with "
            f"`highrank finetune {run.path} --resume`"
        )
    best = run.checkpoint("best")
    payload = load_checkpoint(best)
    config = _apply_overrides(payload, best, overrides, FINETUNE_OVERRIDES)
    stage = finetune_stage(config)
    if stage.epochs == 0:
        raise ConfigError("finetune.epochs = 0: nothing to finetune; set --finetune.epochs=N")
    device = resolve_device(config.run.device)
    corpus, splits = load_splits(config, device)
    _check_same_vocab(run, corpus, best)
    seed_everything(config.train.seed)
    model = build_model(config, len(corpus.vocab)).to(device)
    load_weights(model, payload["model"], best)
    optimizer = build_optimizer(model, stage.lr, config.train.weight_decay, "asgd")
    best_loss = payload["training"]["progress"]["best_val_loss"]
    progress = Progress(stage="finetune", best_val_loss=best_loss, step=0)
    trigger = _stage_trigger(config, stage)
    rng = bptt_generator(config.train.seed)
    return Trainer(config, run, stage, model, optimizer, trigger, splits, progress, rng, options)


# ---- facts about a config ---------------------------------------------------------------------


def parameter_count(config: Config, vocab_size: int) -> int:
    """Trainable parameters of the model ``config`` describes, built on the ``meta`` device
    (nothing allocated)."""
    with torch.device("meta"):
        model = build_model(config, vocab_size)
    return count_parameters(model)


def corpus_vocab_size(config: Config) -> int:
    """Vocabulary size of the corpus at ``config.data.dir`` (read once, then cached)."""
    data = config.data
    return len(load_corpus(data.dir, mode=data.mode, cache_dir=data.cache_dir).vocab)


__all__ = [
    "Meter",
    "Progress",
    "StepInfo",
    "StepOutcome",
    "TrainOptions",
    "TrainResult",
    "Trainer",
    "TrainingError",
    "build_optimizer",
    "corpus_vocab_size",
    "evaluate_loss",
    "finetune",
    "optimization_step",
    "parameter_count",
    "resume",
    "train",
    "training_loss",
]
