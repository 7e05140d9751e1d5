"""The Transformer language-model recipe: AdamW with warm-up and decay, on fixed-length windows.

The schedule of decoder-only Transformer LMs (GPT-2, Radford et al. 2019; minGPT/nanoGPT) for
:class:`highrank.models.backbones.transformer.CausalTransformer`,
``model.backbone = "transformer"``:

    windows     the training stream laid out as train.batch_size contiguous columns (T, B)
                (:func:`highrank.data.batchify`) and cut into non-overlapping windows of
                train.bptt rows; window i predicts rows [i bptt + 1, (i + 1) bptt] from rows
                [i bptt, (i + 1) bptt), and position t of a window sees only the tokens 0..t of
                that window. An epoch visits every window once, in an order shuffled by the
                recipe's own generator (seed train.seed + 1); the last window may be shorter.
    step        train.accumulate windows (micro-batches), each's mean head NLL weighted by its
                share of the step's tokens, backpropagated one after the other (gradient
                accumulation), the forward passes under bf16 autocast when train.bf16 is set
                (weights, gradients and optimizer state stay float32); gradient norm clipped
                to train.clip (0: not clipped); one AdamW update
    optimizer   AdamW (Loshchilov & Hutter, ICLR 2019): betas (0.9, train.adam_beta2), epsilon
                1e-8, decoupled weight decay train.weight_decay on the weight matrices of the
                linear layers only; no decay on biases, LayerNorm gains, embeddings (token and
                position tables, so neither on a tied decoder) or other free parameters such
                as Mixtape's token gates and PLIF's slopes (minGPT's ``configure_optimizers``)
    lr          each group's peak lr (train.lr; a head's own lr, e.g. PLIF's slopes, for its
                group) x linear warm-up over train.warmup_steps updates, then ``"cosine"`` (to
                0 at the last update of train.epochs) or ``"inverse-sqrt"`` (Vaswani et al.
                2017, eq. 3) (:func:`highrank.train.schedule.lr_factor`), set before every update
    validation  the valid split as train.eval_batch_size columns in windows of train.bptt,
                the same protocol (:func:`highrank.train.stream.evaluate_loss` with the
                Transformer's empty state), float32, every train.eval_every updates and at
                every epoch end; best.pt holds the weights with the lowest loss

The recipe's checkpoint state (``"training"``): ``optimizer`` (AdamW with its step counts and
each group's ``peak_lr``) and ``order`` (this epoch's window order), with the ``windows``
generator under ``rng``. The update number is the loop's step, so nothing else is kept, and
resuming is bit-identical. A resume that raises train.epochs stretches the cosine curve from
there on (its end moves), so it is no longer the curve of a run started with those epochs.
There is no finetuning stage (that is AWD-LSTM's averaged SGD).

Under torchrun (:mod:`highrank.train.distributed`) each process reads its share of the
train.batch_size columns of every window; gradients are averaged over the processes once per
update (after the last micro-batch), and the logged and validation losses are averaged too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from highrank.config import Config, ConfigError
from highrank.data import Corpus, get_batch
from highrank.data.streaming import epoch_view
from highrank.models import LanguageModel
from highrank.train.distributed import average, distribute, no_sync
from highrank.train.recipe import EpochSize, Stage, StepBatch, StepResult, Verdict
from highrank.train.schedule import lr_factor
from highrank.train.state import Progress
from highrank.train.steps import backward_or_skip, clip_or_skip, head_chunk_size
from highrank.train.stream import Splits, load_splits, validation_loss

ADAM_BETA1, ADAM_EPSILON = 0.9, 1e-8


def decayed_parameters(model: nn.Module) -> set[int]:
    """Ids of the parameters AdamW decays: the weight matrices of ``nn.Linear`` layers."""
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}


def adamw_groups(model: LanguageModel, lr: float, weight_decay: float) -> list[dict]:
    """``model.parameter_groups(lr)`` (a head may give a group its own lr), each split into
    a decayed group (linear weights) and an undecayed one; ``peak_lr`` keeps each group's lr
    before the schedule scales it."""
    decayed = decayed_parameters(model)
    groups = []
    for group in model.parameter_groups(lr):
        params = list(group["params"])
        for decay in (True, False):
            chosen = [p for p in params if (id(p) in decayed) == decay]
            if chosen:
                rate = weight_decay if decay else 0.0
                groups.append({"params": chosen, "weight_decay": rate, "peak_lr": group["lr"]})
    return groups


def window_starts(rows: int, bptt: int) -> list[int]:
    """First rows of the non-overlapping windows of a ``(rows, B)`` batch (the last row is
    only a target)."""
    return list(range(0, rows - 1, bptt))


class TransformerRecipe:
    """The Transformer LM schedule (see the module docstring), for the loop."""

    def __init__(
        self,
        config: Config,
        model: LanguageModel,
        corpus: Corpus,
        stage: Stage,
        device: torch.device,
    ) -> None:
        if stage.name != "train":
            raise ConfigError(
                f"a transformer run has no {stage.name!r} stage (finetuning is AWD-LSTM's "
                f"averaged SGD); only training"
            )
        self.config, self.model, self.device = config, model, device
        t = config.train
        self.eval_every = t.eval_every
        self.splits: Splits = load_splits(config, corpus, device)
        self.starts = window_starts(self.splits.train.size(0), t.bptt)
        self.updates_per_epoch = math.ceil(len(self.starts) / t.accumulate)
        self.total_updates = t.epochs * self.updates_per_epoch
        if t.lr_schedule == "cosine" and self.total_updates <= t.warmup_steps:
            raise ConfigError(
                f"train.warmup_steps = {t.warmup_steps} leaves no updates to decay over: "
                f"train.epochs = {t.epochs} x {self.updates_per_epoch} updates per epoch = "
                f"{self.total_updates}; lower train.warmup_steps or raise train.epochs"
            )
        groups = adamw_groups(model, t.lr, t.weight_decay)
        self.optimizer = torch.optim.AdamW(
            groups, lr=t.lr, betas=(ADAM_BETA1, t.adam_beta2), eps=ADAM_EPSILON
        )
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.forward = distribute(model, t.seed)  # DDP under torchrun
        self.shuffle = torch.Generator().manual_seed(t.seed + 1)
        self.order = self._new_order()
        self.update = 1  # the 1-based number of the next update (the loop's step + 1)
        self._set_lr()

    def _new_order(self) -> list[int]:
        return torch.randperm(len(self.starts), generator=self.shuffle).tolist()

    def _set_lr(self) -> None:
        t = self.config.train
        factor = lr_factor(
            self.update,
            warmup_steps=t.warmup_steps,
            schedule=t.lr_schedule,
            total_steps=self.total_updates,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = group["peak_lr"] * factor

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def phase(self) -> str:
        t = self.config.train
        return "warmup" if self.update <= t.warmup_steps else t.lr_schedule

    # ---- steps ------------------------------------------------------------------------------

    def epoch_size(self) -> EpochSize:
        return EpochSize(len(self.starts), self.config.train.bptt * self.splits.train.size(1))

    def start_epoch(self, progress: Progress) -> None:
        self.order = self._new_order()

    def next_batch(self, progress: Progress) -> StepBatch:
        """train.accumulate windows from the epoch's position in this epoch's order."""
        t = self.config.train
        self.update = progress.step + 1
        picked = self.order[progress.position : progress.position + t.accumulate]
        train_rows = epoch_view(self.splits.train, progress.epoch)  # data.batching
        windows = [get_batch(train_rows, self.starts[i], t.bptt) for i in picked]
        tokens = sum(target.numel() for _, target in windows)
        return StepBatch(windows, len(windows), tokens, t.bptt)

    def train_step(self, batch: StepBatch) -> StepResult:
        """Set this update's lr; forward and backward every window; clip; AdamW step."""
        self._set_lr()
        self.optimizer.zero_grad(set_to_none=True)
        total, bf16, chunk = 0.0, self.config.train.bf16, head_chunk_size(self.config)
        for i, (tokens, target) in enumerate(batch.data):  # (L, B) each
            share = target.numel() / batch.tokens
            last = i == len(batch.data) - 1  # torchrun: average the gradient sums once, here
            with no_sync(self.forward, not last):
                with torch.autocast(self.device.type, torch.bfloat16, enabled=bf16):
                    nll, _, _ = self.forward(tokens, target, chunk_size=chunk)
                reason = backward_or_skip(nll * share, self.optimizer)
            if reason:
                return StepResult(None, reason)
            total += average(nll) * share
        reason = clip_or_skip(self.optimizer, self.params, self.config.train.clip)
        if reason:
            return StepResult(None, reason)
        self.optimizer.step()
        return StepResult(total)

    def divergence_advice(self) -> str:
        t = self.config.train
        return (
            f"Try a lower peak learning rate (train.lr = {t.lr:g}, e.g. --train.lr={t.lr / 2:g}), "
            f"a longer warm-up (train.warmup_steps = {t.warmup_steps}) or a tighter gradient "
            f"clip (train.clip = {t.clip:g}, e.g. --train.clip={(t.clip or 2.0) / 2:g})"
        )

    # ---- validation -------------------------------------------------------------------------

    def validate(self) -> float:
        """Mean NLL per token of the validation windows, float32, eval mode."""
        return validation_loss(self.model, self.config, self.splits.valid)

    def after_validation(self, val_loss: float, progress: Progress) -> Verdict:
        return Verdict({})

    # ---- checkpoints ------------------------------------------------------------------------

    def evaluation_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "order": list(self.order)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.order = list(state["order"])

    def generators(self) -> dict[str, torch.Generator]:
        return {"windows": self.shuffle}


__all__ = [
    "TransformerRecipe",
    "adamw_groups",
    "decayed_parameters",
    "window_starts",
]
