"""The one training loop: steps, validation, checkpoints, the non-finite guard, exact resume.

:class:`Trainer` runs one stage (training or finetuning) of a run with a recipe
(:mod:`highrank.train.recipe` says what the recipe decides and in which order it is asked).
What the loop guarantees whatever the recipe:

* ``last.pt`` every ``train.checkpoint_every`` steps and ``train.checkpoint_minutes``
  minutes, at every epoch end, and when ``TrainOptions.max_steps``, SIGINT or SIGTERM stops the
  stage between two steps (a signal then raises :class:`~highrank.train.state.Interrupted`
  naming the file; :mod:`highrank.train.interrupts`); resuming it continues bit-identically on
  the same machine (the payload holds the model, the recipe's state, every RNG, the progress
  and the metrics offset; :mod:`highrank.runs.checkpoint` documents the layout,
  :mod:`highrank.train.saving` writes it);
* the best checkpoint whenever validation improves on the best so far (after an epoch-end
  validation it is written once the next epoch has begun, so it resumes cleanly there);
* a step the recipe skipped as non-finite changes nothing; more than
  ``train.max_nonfinite_skips`` in a row stop the run with a :class:`TrainingError`, as does a
  non-finite validation loss;
* a finite training loss above :data:`DIVERGING` times a uniform distribution's (log V) is
  one warning with the recipe's advice (a learning rate too high for a head, say): the run
  goes on, since such a loss can still come down.
"""

from __future__ import annotations

import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

from highrank.config import Config
from highrank.runs.checkpoint import restore_rng
from highrank.runs.run_dir import MetricsLog, RunDir
from highrank.train import distributed
from highrank.train.interrupts import SignalCatcher
from highrank.train.recipe import Recipe, Stage, StepBatch
from highrank.train.reporting import say
from highrank.train.saving import Checkpoints
from highrank.train.state import (
    Interrupted,
    Meter,
    Progress,
    StepInfo,
    TrainingError,
    TrainOptions,
    TrainResult,
)

# A step's training loss above this many times log V (a uniform distribution's) is taken as
# divergence: every head starts near log V, and a run that learns does not climb to twice it.
DIVERGING = 2.0


class Trainer:
    """One stage of a run with one recipe; :meth:`run` it."""

    def __init__(
        self,
        config: Config,
        run: RunDir,
        stage: Stage,
        recipe: Recipe,
        progress: Progress,
        options: TrainOptions,
        vocab_size: int,
    ) -> None:
        self.config, self.run_dir, self.stage, self.recipe = config, run, stage, recipe
        self.progress, self.options, self.vocab_size = progress, options, vocab_size
        self.log = distributed.run_log(run, stage.name, progress, options.progress)
        self.saves = Checkpoints(config, run, stage, recipe, progress, self.log.metrics, vocab_size)
        # Under torchrun a Ctrl-C reaches each process twice (terminal, then torchrun): only
        # the next step boundary acts on either.
        self.signals = SignalCatcher(options.catch_signals, once=not distributed.active())
        self._skip_reason = ""
        self._warned = False

    def run(self) -> TrainResult:
        """Epochs until the stage ends, ``options.max_steps`` is reached or a signal arrives."""
        try:
            with self.signals:
                while not self.progress.done:
                    if not self._run_epoch():
                        break
                    self._end_epoch()
        finally:
            self.log.close()
        p = self.progress
        return TrainResult(
            self.run_dir.path, self.stage.name, p.epoch - 1, p.step, p.best_val_loss,
            p.best_epoch, self.recipe.phase, p.stop_reason,
        )  # fmt: skip

    # ---- steps ------------------------------------------------------------------------------

    def _run_epoch(self) -> bool:
        """Steps from the saved position to the end of the epoch; False if stopped early."""
        self.recipe.model.train()
        size = self.recipe.epoch_size()
        with self.log.bar(size, self.options.max_steps) as bar:
            while self.progress.position < size.positions:
                if self._stop_here():
                    return False
                batch, loss = self._step()
                self.log.show(bar, batch.tokens)
                self._after_step(batch, loss, epoch_over=self.progress.position >= size.positions)
        return True

    def _stop_here(self) -> bool:
        """Between two steps: save and raise on a signal; save and stop at --max-steps."""
        p, limit = self.progress, self.options.max_steps
        number = distributed.any_rank(self.signals.signal)  # a signal to any process stops all
        if number is not None:
            p.stop_reason = "interrupted"
            name = signal.Signals(number).name
            raise Interrupted(name, 128 + number, self.saves.save_last(), p.step)
        if limit is not None and p.step >= limit:
            p.stop_reason = "max_steps"
            self.saves.save_last()
            return True
        return False

    def _step(self) -> tuple[StepBatch, float | None]:
        p = self.progress
        batch = self.recipe.next_batch(p)
        start = time.perf_counter()
        result = self.recipe.train_step(batch)
        seconds = time.perf_counter() - start
        p.position += batch.advance
        p.step += 1
        for meter in (p.epoch_meter, p.window_meter):
            meter.add(result.nll, batch.tokens, seconds)
        self._skip_reason = result.skip_reason
        self._count_skip(result.nll is None)
        self._warn_if_diverging(result.nll)
        return batch, result.nll

    def _warn_if_diverging(self, loss: float | None) -> None:
        """Once a stage: a finite loss above :data:`DIVERGING` log V, with what to change."""
        uniform = math.log(self.vocab_size)
        if self._warned or loss is None or not loss > DIVERGING * uniform:
            return
        self._warned = True
        if distributed.is_writer():
            p = self.progress
            say(f"warning: {self.stage.name} step {p.step} (epoch {p.epoch}): the training loss "
                f"{loss:.4g} is above {DIVERGING:g} x a uniform distribution's (log V = "
                f"{uniform:.2f}): the run is diverging. {self.recipe.divergence_advice()}")

    def _count_skip(self, skipped: bool) -> None:
        p = self.progress
        p.consecutive_skips = p.consecutive_skips + 1 if skipped else 0
        allowed = self.config.train.max_nonfinite_skips
        if p.consecutive_skips > allowed:
            last = self.saves.last_path
            advice = self.recipe.divergence_advice()
            raise TrainingError(
                _diverged(self.stage.name, p, self._skip_reason, allowed, last, advice)
            )

    def _after_step(self, batch: StepBatch, loss: float | None, epoch_over: bool) -> None:
        p, every = self.progress, self.recipe.eval_every
        if p.step % self.config.train.log_every == 0:
            self.log.write(self._record("step", p.window_meter))
            p.window_meter = Meter()
        if every and p.step % every == 0 and not epoch_over:  # the epoch end validates anyway
            if self._validate("eval"):
                self.saves.save_best()
            self.recipe.model.train()
        if self.saves.due():
            self.saves.save_last()
        if self.options.callback is not None:
            lost = math.nan if loss is None else loss
            info = StepInfo(self.stage.name, p.epoch, p.step, batch.seq_len, lost, loss is None)
            self.options.callback(info)

    # ---- validation -------------------------------------------------------------------------

    def _end_epoch(self) -> None:
        """Validate (the recipe may switch or stop), move to the next epoch, save."""
        improved = self._validate("epoch")
        p = self.progress
        p.epoch, p.position, p.epoch_meter = p.epoch + 1, 0, Meter()
        self.recipe.start_epoch(p)
        if p.epoch > self.stage.epochs and not p.done:
            p.done, p.stop_reason = True, "epochs"
        if improved:  # after the epoch advanced: the best checkpoint resumes at this boundary
            self.saves.save_best()
        self.saves.save_last()

    def _validate(self, kind: str) -> bool:
        """Validate, log, ask the recipe; True when the loss is the best so far."""
        p = self.progress
        start = time.perf_counter()
        val_loss = self.recipe.validate()
        if not math.isfinite(val_loss):
            raise TrainingError(_bad_validation(self.stage.name, p.epoch, val_loss, self.recipe))
        seconds = time.perf_counter() - start
        improved = val_loss < p.best_val_loss
        if improved:
            p.best_val_loss, p.best_epoch = val_loss, p.epoch
        record = self._record(kind, p.epoch_meter)  # the phase before the recipe's verdict
        verdict = self.recipe.after_validation(val_loss, p)
        self.log.validation(record, val_loss, improved, seconds, verdict)
        if verdict.stop_reason:
            p.done, p.stop_reason = True, verdict.stop_reason
        elif kind == "epoch" and self._out_of_patience(val_loss):
            p.done, p.stop_reason = True, "patience"
        return improved

    def _out_of_patience(self, val_loss: float) -> bool:
        """train.patience: whether this many epoch-end validations in a row have not lowered
        the best loss by more than train.patience_min_delta, counted within the recipe's
        phase: a switch (SGD -> averaged SGD, which NT-ASGD makes when validation stalls, the
        moment patience would also run out) starts the count again, so that a run is never
        stopped at the switch before the averaged weights had their epochs."""
        p, train = self.progress, self.config.train
        if train.patience is None:
            return False
        if self.recipe.phase != p.patience_phase:
            p.patience_phase, p.patience_loss, p.patience_epoch = (
                self.recipe.phase, val_loss, p.epoch,
            )  # fmt: skip
            return False
        if val_loss < p.patience_loss - train.patience_min_delta:
            p.patience_loss, p.patience_epoch = val_loss, p.epoch
            return False
        return p.epoch - p.patience_epoch >= train.patience

    def _record(self, kind: str, meter: Meter) -> dict[str, Any]:
        return self.log.record(kind, meter, self.recipe.lr, self.recipe.phase)


def _diverged(stage: str, p: Progress, reason: str, allowed: int, last: Path, advice: str) -> str:
    saved = (
        f"the last checkpoint ({last}) holds finite weights"
        if last.is_file()
        else "no checkpoint of this stage was saved yet"
    )
    return (
        f"{stage} step {p.step} (epoch {p.epoch}): the {reason}; {p.consecutive_skips} "
        f"consecutive steps were non-finite, more than train.max_nonfinite_skips = {allowed}. "
        f"Those steps changed nothing and {saved}. {advice}"
    )


def _bad_validation(stage: str, epoch: int, val_loss: float, recipe: Recipe) -> str:
    return (
        f"{stage} epoch {epoch}: the validation loss is {val_loss} although the weights are "
        f"finite; try a lower learning rate (train.lr = {recipe.lr:g}) and restart from an "
        f"earlier checkpoint"
    )


def restore(
    config: Config,
    run: RunDir,
    stage: Stage,
    recipe: Recipe,
    training: dict[str, Any],
    options: TrainOptions,
    vocab_size: int,
) -> Trainer:
    """A trainer in exactly the state of a checkpoint's ``training`` dict; ``recipe`` is a
    fresh one on the checkpoint's weights. The RNGs are restored last (building the model drew
    from the global one) and the metrics lines this stage wrote after the checkpoint are dropped
    (other stages' lines stay: resuming training keeps a finetuning's records). With several
    processes each restores its own RNG states (:mod:`highrank.train.distributed`)."""
    recipe.load_state_dict(training)
    progress = Progress.from_dict(training["progress"])
    if progress.done and progress.stop_reason == "epochs" and progress.epoch <= stage.epochs:
        progress.done, progress.stop_reason = False, ""  # the epoch limit was raised
    if not progress.done:
        progress.stop_reason = ""  # "interrupted" / "max_steps" said why it paused: it runs again
    saved_world = training.get("world_size", 1)  # absent before torchrun runs existed
    distributed.note_world_size(saved_world, f"the {stage.name} checkpoint")
    own = distributed.rank_rng(training["rng"], saved_world)
    if own is not None:  # None: a process the checkpoint had no state for keeps its own
        restore_rng(own)
    for name, generator in recipe.generators().items():
        generator.set_state(training["rng"][name])
    lines = training.get("metrics_lines")  # absent in checkpoints written before it existed
    if distributed.is_writer():
        missing = MetricsLog(run.metrics_file).rewind(training["metrics_offset"], stage.name, lines)
        if missing:  # the history has a hole: say so, the run itself continues exactly
            unit = "lines" if lines is not None else "bytes"
            print(
                f"warning: {run.metrics_file} lacks {missing} {unit} of the {stage.name} history "
                "that the checkpoint recorded (the file was cut or replaced); the run continues "
                "exactly, but its metrics have a gap there",
                file=sys.stderr,
            )
    return Trainer(config, run, stage, recipe, progress, options, vocab_size)


__all__ = ["Trainer", "restore"]
