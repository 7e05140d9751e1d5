"""highrank.train.loop with a recipe that is not AWD-LSTM's: the loop is generic.

``WindowRecipe`` is a Transformer-style schedule (AdamW with linear warm-up, fixed-length
windows shuffled every epoch by the recipe's own generator, two micro-batches accumulated per
step, validation every 3 steps) run on a tiny model; it uses only the Recipe protocol, so these
tests check that such a schedule plugs into the loop unchanged and resumes bit-identically.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from highrank.config import load_config
from highrank.data import get_batch, iter_batches, load_corpus
from highrank.models import build_model
from highrank.runs.checkpoint import load_checkpoint
from highrank.runs.run_dir import RunDir, read_metrics
from highrank.train import Progress, TrainingError, TrainOptions
from highrank.train.loop import Trainer, restore
from highrank.train.recipe import EpochSize, Stage, StepBatch, StepResult, Verdict
from highrank.train.startup import seed_everything
from highrank.train.steps import backward_or_skip, clip_or_skip

WINDOW, ACCUMULATE, WARMUP, EVAL_EVERY = 5, 2, 4, 3
STAGE = Stage("train", 2, "last", "best")


class WindowRecipe:
    """AdamW, lr warmed up linearly over WARMUP steps, ACCUMULATE fixed windows per step."""

    eval_every = EVAL_EVERY

    def __init__(self, model, corpus, poison_from: int | None = None) -> None:
        self.model = model
        self.train_rows = corpus.batchify("train", 4)  # (T, 4)
        self.valid_rows = corpus.batchify("valid", 2)
        self.n_windows = (self.train_rows.size(0) - 1) // WINDOW
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        self.shuffle = torch.Generator().manual_seed(7)
        self.order = torch.randperm(self.n_windows, generator=self.shuffle)
        self.updates = 0
        self.poison_from = poison_from  # make every step from this one non-finite

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def phase(self) -> str:
        return "warmup" if self.updates < WARMUP else "constant"

    def epoch_size(self) -> EpochSize:
        return EpochSize(self.n_windows, WINDOW * self.train_rows.size(1))

    def start_epoch(self, progress: Progress) -> None:
        self.order = torch.randperm(self.n_windows, generator=self.shuffle)

    def next_batch(self, progress: Progress) -> StepBatch:
        picked = self.order[progress.position : progress.position + ACCUMULATE].tolist()
        windows = [get_batch(self.train_rows, i * WINDOW, WINDOW) for i in picked]
        tokens = sum(target.numel() for _, target in windows)
        return StepBatch(windows, len(windows), tokens, WINDOW)

    def train_step(self, batch: StepBatch) -> StepResult:
        for group in self.optimizer.param_groups:
            group["lr"] = 0.01 * min(1.0, (self.updates + 1) / WARMUP)
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for tokens, target in batch.data:  # micro-batches, each weighted by its tokens
            nll, _, _ = self.model(tokens, target)
            if self.poison_from is not None and self.updates >= self.poison_from:
                nll = nll * torch.nan
            reason = backward_or_skip(nll * target.numel() / batch.tokens, self.optimizer)
            if reason:
                return StepResult(None, reason)
            total += float(nll.detach()) * target.numel() / batch.tokens
        reason = clip_or_skip(self.optimizer, list(self.model.parameters()), 1.0)
        if reason:
            return StepResult(None, reason)
        self.optimizer.step()
        self.updates += 1
        return StepResult(total)

    @torch.no_grad()
    def validate(self) -> float:
        self.model.eval()
        nll, count = 0.0, 0
        for tokens, target in iter_batches(self.valid_rows, WINDOW):
            nll += float(self.model.nll(tokens, target)[0].sum())
            count += target.numel()
        return nll / count

    def after_validation(self, val_loss: float, progress: Progress) -> Verdict:
        return Verdict({"updates": self.updates})

    def evaluation_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "order": self.order,
            "updates": self.updates,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.order, self.updates = state["order"], state["updates"]

    def generators(self) -> dict[str, torch.Generator]:
        return {"shuffle": self.shuffle}

    def divergence_advice(self) -> str:
        return "Lower the peak learning rate."


def config_for(corpus: Path, out: Path):
    tiny = ["model.d_embed=8", "model.d_hidden=12", "model.n_layers=2", "train.log_every=1"]
    return load_config(None, [f"data.dir={corpus}", f"run.out_dir={out}", *tiny])


def start(corpus: Path, out: Path, max_steps: int | None = None, **recipe_kwargs) -> Trainer:
    config = config_for(corpus, out)
    data = load_corpus(corpus)
    seed_everything(0)
    model = build_model(config, len(data.vocab))
    run = RunDir.create(out, config, data.vocab, ["test"])
    options = TrainOptions(max_steps=max_steps, progress=False)
    recipe = WindowRecipe(model, data, **recipe_kwargs)
    return Trainer(config, run, STAGE, recipe, Progress(), options, len(data.vocab))


def resumed(corpus: Path, out: Path) -> Trainer:
    config = config_for(corpus, out)
    data = load_corpus(corpus)
    training = load_checkpoint(out / "checkpoints" / "last.pt")["training"]
    model = build_model(config, len(data.vocab))
    model.load_state_dict(training["model"])
    options = TrainOptions(progress=False)
    recipe = WindowRecipe(model, data)
    return restore(config, RunDir(out), STAGE, recipe, training, options, len(data.vocab))


def trajectory(out: Path) -> list[tuple]:
    keys = ("kind", "epoch", "step", "phase", "lr", "train_loss", "val_loss", "updates")
    return [tuple(r.get(k) for k in keys) for r in read_metrics(out / "metrics.jsonl")]


def test_a_recipe_with_mid_epoch_validation_logs_and_saves_through_the_loop(corpus, tmp_path):
    out = tmp_path / "run"
    result = start(corpus, out).run()
    epochs = read_metrics(out / "metrics.jsonl", "epoch")
    evals = read_metrics(out / "metrics.jsonl", "eval")
    assert result.stop_reason == "epochs" and result.epochs_completed == 2
    assert result.phase == "constant" and [r["epoch"] for r in epochs] == [1, 2]
    ends = {r["step"] for r in epochs}
    expected = [s for s in range(EVAL_EVERY, result.steps + 1, EVAL_EVERY) if s not in ends]
    assert [r["step"] for r in evals] == expected  # every 3 steps, but not at an epoch end
    assert all("val_loss" in r and r["updates"] == r["step"] for r in evals)
    steps = read_metrics(out / "metrics.jsonl", "step")
    assert steps[0]["lr"] == pytest.approx(0.01 / WARMUP) and steps[-1]["lr"] == 0.01
    best = load_checkpoint(out / "checkpoints" / "best.pt")["training"]["progress"]
    validations = sorted(evals + epochs, key=lambda r: r["step"])
    assert best["best_val_loss"] == min(r["val_loss"] for r in validations)


@pytest.mark.parametrize("stop", [4, 6, 7])  # after a validation, at one, mid-epoch elsewhere
def test_a_recipe_with_its_own_generator_and_schedule_resumes_bit_identically(
    corpus, tmp_path, stop
):
    start(corpus, tmp_path / "straight").run()
    out = tmp_path / "interrupted"
    first = start(corpus, out, max_steps=stop).run()
    assert first.stop_reason == "max_steps" and first.steps == stop
    second = resumed(corpus, out).run()
    assert second.stop_reason == "epochs"
    assert trajectory(out) == trajectory(tmp_path / "straight")
    for name in ("last.pt", "best.pt"):
        ours = load_checkpoint(out / "checkpoints" / name)["model"]
        theirs = load_checkpoint(tmp_path / "straight" / "checkpoints" / name)["model"]
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_the_loop_stops_a_recipe_whose_steps_stay_non_finite(corpus, tmp_path):
    trainer = start(corpus, tmp_path / "run", poison_from=2)
    with pytest.raises(TrainingError, match=r"step 13 .*Lower the peak learning rate"):
        trainer.run()
