"""What a training stage writes as it goes: metrics.jsonl, TensorBoard, the progress bar and
the one-line summary of each validation (on stderr).

Records (one JSON object per line of ``metrics.jsonl``, see :mod:`highrank.runs.run_dir`):

* ``"kind": "step"`` every ``train.log_every`` steps: the training loss of that window;
* ``"kind": "epoch"`` after each epoch's validation, ``"kind": "eval"`` after a mid-epoch one:
  the training loss of the epoch so far, ``val_loss``, ``val_ppl``, ``best_val_loss``,
  ``improved``, ``eval_seconds`` and the recipe's fields (AWD-LSTM: ``switched``/``stopped``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

from tqdm.auto import tqdm

from highrank.runs.run_dir import MetricsLog, RunDir, TensorBoardLog
from highrank.train.recipe import EpochSize, Verdict
from highrank.train.state import Meter, Progress
from highrank.util.progress import progress_bar


class RunLog:
    """metrics.jsonl and TensorBoard for one stage of a run, and its progress bar."""

    def __init__(self, run: RunDir, stage: str, progress: Progress, show_bar: bool) -> None:
        self.stage, self.progress, self.show_bar = stage, progress, show_bar
        self.counts_steps = False  # the bar counts tokens of the epoch, or steps (--max-steps)
        self.metrics = MetricsLog(run.metrics_file)
        self.tensorboard = TensorBoardLog(
            run.path / "tensorboard" / stage, purge_step=progress.step or None
        )

    def record(self, kind: str, meter: Meter, lr: float, phase: str) -> dict[str, Any]:
        """The fields every record has, from the training steps of ``meter``."""
        p = self.progress
        return {
            "kind": kind,
            "stage": self.stage,
            "epoch": p.epoch,
            "step": p.step,
            "train_loss": finite_or_none(meter.mean_loss),
            "train_ppl": finite_or_none(perplexity(meter.mean_loss)),
            "lr": lr,
            "phase": phase,
            "tokens_per_s": round(meter.tokens_per_s, 1),
            "skipped_steps": meter.skipped,
            "seconds": round(meter.seconds, 3),
        }

    def validation(
        self,
        record: dict[str, Any],
        val_loss: float,
        improved: bool,
        seconds: float,
        verdict: Verdict,
    ) -> None:
        """Complete a validation's ``record`` (from :meth:`record`), write it, and print its
        line and the recipe's message."""
        record.update(
            val_loss=val_loss,
            val_ppl=finite_or_none(perplexity(val_loss)),
            best_val_loss=self.progress.best_val_loss,
            improved=improved,
            eval_seconds=round(seconds, 3),
            **verdict.fields,
        )
        self.write(record)
        say(validation_line(record))
        if verdict.message:
            say(verdict.message)

    def write(self, record: Mapping[str, Any]) -> None:
        self.metrics.write(record)
        self.tensorboard.write(record, self.progress.step)

    def close(self) -> None:
        self.tensorboard.close()

    def bar(self, size: EpochSize, max_steps: int | None = None):
        """A bar over the epoch's tokens, starting at the progress position (a line now and
        then when stderr is not a terminal: :mod:`highrank.util.progress`); with
        ``max_steps``, a bar over the steps to that limit instead, so its end and time
        estimate are the run's, not the epoch's."""
        self.counts_steps = max_steps is not None
        if self.counts_steps:
            return progress_bar(
                total=max_steps,
                initial=min(self.progress.step, max_steps),
                desc=f"{self.stage} to --max-steps {max_steps}",
                unit="step",
                leave=False,
                dynamic_ncols=True,
                file=sys.stderr,
                disable=not self.show_bar,
            )
        return progress_bar(
            total=size.positions * size.tokens_per_position,
            initial=self.progress.position * size.tokens_per_position,
            desc=f"{self.stage} epoch {self.progress.epoch}",
            unit="tok",
            unit_scale=True,
            leave=False,
            dynamic_ncols=True,
            file=sys.stderr,
            disable=not self.show_bar,
        )

    def show(self, bar, tokens: int) -> None:
        if bar.disable:
            return
        meter = self.progress.epoch_meter
        bar.update(1 if self.counts_steps else tokens)
        postfix = {"loss": f"{meter.mean_loss:.3f}", "ppl": f"{perplexity(meter.mean_loss):.1f}"}
        bar.set_postfix(postfix | {"tok/s": f"{meter.tokens_per_s:,.0f}"}, refresh=False)


def perplexity(loss: float) -> float:
    return math.exp(loss) if math.isfinite(loss) and loss < 700 else math.inf


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN/inf: such values are written as null."""
    return value if math.isfinite(value) else None


def validation_line(record: Mapping[str, Any]) -> str:
    """``| train epoch   3 | step 99 | train ppl ... | valid ppl ... (best) | lr 30 | ...``"""
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


def say(line: str) -> None:
    """A line on stderr that does not break the progress bar."""
    tqdm.write(line, file=sys.stderr)


__all__ = ["RunLog", "finite_or_none", "perplexity", "say", "validation_line"]
