"""The state a training run advances (all of it checkpointed), and what a run reports."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple


class TrainingError(RuntimeError):
    """Training cannot go on (diverged); the message names the step and what to try."""


class Interrupted(KeyboardInterrupt):
    """A run stopped by SIGINT or SIGTERM between two steps, after saving ``saved`` (the path
    of its last checkpoint); ``exit_status`` is the shell's 128 + signal number."""

    def __init__(self, signal_name: str, exit_status: int, saved: Path, step: int) -> None:
        super().__init__(f"{signal_name} at step {step}; saved {saved}")
        self.signal_name, self.exit_status, self.saved, self.step = (
            signal_name, exit_status, saved, step,
        )  # fmt: skip


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
    """Where a run is: stage, epoch (1-based), the next position of the epoch's data, the
    step counter, the best validation loss, and the counters of the metrics lines."""

    stage: str = "train"
    epoch: int = 1
    position: int = 0
    step: int = 0
    best_val_loss: float = math.inf
    best_epoch: int = 0
    # train.patience: the recipe's phase it counts in, the best loss by more than
    # patience_min_delta in that phase, and its epoch
    patience_phase: str = ""
    patience_loss: float = math.inf
    patience_epoch: int = 0
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
        catch_signals: while the run goes on, SIGINT and SIGTERM stop it between two steps
            with last.pt saved (:class:`Interrupted`); False leaves the process's own handlers
            alone (an application that handles them itself).
    """

    max_steps: int | None = None
    progress: bool = True
    callback: Callable[[StepInfo], None] | None = None
    catch_signals: bool = True


@dataclass(frozen=True)
class TrainResult:
    """How a run (or one stage of it) ended."""

    run_dir: Path
    stage: str
    epochs_completed: int
    steps: int
    best_val_loss: float
    best_epoch: int
    phase: str  # the recipe's phase at the end, e.g. "sgd" | "asgd"
    stop_reason: str  # "epochs" | "max_steps" | the recipe's (e.g. "nonmono")

    @property
    def best_val_ppl(self) -> float:
        return math.exp(self.best_val_loss) if math.isfinite(self.best_val_loss) else math.inf


__all__ = [
    "Interrupted",
    "Meter",
    "Progress",
    "StepInfo",
    "TrainOptions",
    "TrainResult",
    "TrainingError",
]
