"""The checkpoints of one training stage: what goes in them and when the last one is due.

``last`` (the stage's resumable checkpoint, the previous one kept as ``.prev``) is written every
``train.checkpoint_every`` steps, every ``train.checkpoint_minutes`` minutes of wall time
(checked after each step), at every epoch end and whenever the loop stops between steps; at
most once per position. ``best`` is written when validation improves. The payload layout is
:mod:`highrank.runs.checkpoint`'s: the loop's keys here, the recipe's from ``recipe.state_dict()``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from highrank.config import Config, config_to_dict
from highrank.runs.checkpoint import FORMAT, VERSION, capture_rng, save_checkpoint
from highrank.runs.run_dir import MetricsLog, RunDir
from highrank.train import distributed
from highrank.train.recipe import Recipe, Stage
from highrank.train.state import Progress


def training_state(
    recipe: Recipe, progress: Progress, metrics_offset: int, metrics_lines: int | None = None
) -> dict[str, Any]:
    """A checkpoint's ``"training"``: what :func:`highrank.train.loop.restore` needs to
    continue exactly (``metrics_lines``: this stage's lines of metrics.jsonl so far). With
    several processes every one calls it (it gathers their RNG states and hidden states)."""
    rng = capture_rng()
    rng.update({name: g.get_state() for name, g in recipe.generators().items()})
    return {
        "model": recipe.model.state_dict(),
        **recipe.state_dict(),
        "rng": distributed.gather_rng(rng),
        "world_size": distributed.world_size(),
        "progress": dataclasses.asdict(progress),
        "metrics_offset": metrics_offset,
        **({} if metrics_lines is None else {"metrics_lines": metrics_lines}),
    }


@dataclasses.dataclass
class Checkpoints:
    """Writes one stage's checkpoints (see the module docstring)."""

    config: Config
    run: RunDir
    stage: Stage
    recipe: Recipe
    progress: Progress
    metrics: MetricsLog
    vocab_size: int

    def __post_init__(self) -> None:
        self._last_saved: tuple[int, int, int] | None = None
        self._saved_at = time.monotonic()
        self._run_id = self.run.run_id

    @property
    def last_path(self) -> Path:
        return self.run.checkpoint(self.stage.last)

    def due(self) -> bool:
        """Whether the last checkpoint is due after this step, by steps or by time."""
        train = self.config.train
        minutes = train.checkpoint_minutes
        late = minutes > 0 and time.monotonic() - self._saved_at >= 60 * minutes
        if minutes > 0:  # each process has its own clock: save when any one is late
            late = bool(distributed.any_rank(int(late)))
        return self.progress.step % train.checkpoint_every == 0 or late

    def save_last(self) -> Path:
        """Save the resumable state as the stage's last checkpoint (keeping the previous one),
        once per position; returns its path."""
        p = self.progress
        key = (p.epoch, p.position, p.step)
        if key != self._last_saved:
            self._save(self.stage.last, keep_previous=True)
            self._last_saved, self._saved_at = key, time.monotonic()
        return self.last_path

    def save_best(self) -> None:
        self._save(self.stage.best, keep_previous=False)

    def _save(self, name: str, *, keep_previous: bool) -> None:
        path = self.run.checkpoint(name)
        payload = self.payload(name)  # on every process: it gathers their states
        if distributed.is_writer():
            save_checkpoint(payload, path, keep_previous=keep_previous)
        distributed.barrier()

    def payload(self, kind: str) -> dict[str, Any]:
        """The checkpoint contents (see :mod:`highrank.runs.checkpoint`)."""
        metrics = (self.metrics.offset(), self.metrics.lines(self.stage.name))
        return {
            "format": FORMAT,
            "version": VERSION,
            "kind": kind,
            "stage": self.stage.name,
            **({} if self._run_id is None else {"run_id": self._run_id}),
            "config": config_to_dict(self.config),
            "vocab_size": self.vocab_size,
            "model": self.recipe.evaluation_state_dict(),
            "training": training_state(self.recipe, self.progress, *metrics),
        }


__all__ = ["Checkpoints", "training_state"]
