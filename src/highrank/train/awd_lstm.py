"""The AWD-LSTM recipe: SGD, then averaged SGD, on variable-length BPTT windows.

Merity, Keskar & Socher, "Regularizing and Optimizing LSTM Language Models" (ICLR 2018), as
the AWD-LSTM and MoS (Yang et al., ICLR 2018) code run it. One training step:

    seq_len ~ variable BPTT (Sec. 4.1)          highrank.models.backbones.variable_bptt_length
    tokens, target = rows [i, i + L) of the (T, B) training batch, L = min(seq_len, rows left)
    loss = head NLL (mean over L x B tokens; head loss chunked by train.chunk_size, "auto" when
           unset) + AR + TAR (Sec. 4.6), hidden state carried in
    backward; clip the gradient norm to train.clip
    SGD step (weight decay train.weight_decay on every parameter) with every group's lr scaled
    by L / bptt for this step (Sec. 4.1); the hidden state is detached for the next window

The lr is scaled by the length actually used: the reference scales the shorter last window of
an epoch by the drawn length instead. As the references do, an epoch does not train a last
window of a single token, and finetuning caps windows at bptt + finetune.max_seq_len_delta
(10, awd-lstm-lm ``finetune.py``). The hidden state restarts from zeros every epoch.

After each epoch (the loop validates; :meth:`AWDLSTMRecipe.validate`): validation loss (batch
train.eval_batch_size, segments of bptt, state carried, ``exp(total NLL / tokens)`` =
perplexity) with the ASGD *averaged* weights once switched; then the switch policy
(:mod:`highrank.train.asgd`: NT-ASGD, ET-ASGD, or plain SGD) may switch to averaged SGD.
Finetuning (stage ``"finetune"``) restarts averaged SGD from ``best.pt`` with finetune.lr and
stops by the same non-monotone rule (MoS ``finetune.py``).

The recipe's checkpoint state (``"training"``): ``optimizer`` (SGD, or ASGD with its averages
``ax``), ``phase`` ("sgd" | "asgd"), ``trigger`` (NT-ASGD history / ET-ASGD epoch count),
``hidden`` (``[[h, c], ...]``, each ``(1, B, H_layer)``) and the ``bptt`` generator under
``rng``.

Under torchrun (:mod:`highrank.train.distributed`) each process trains its share of the B
columns with its own hidden state, every process draws the same window lengths, the
gradients, step NLL and validation loss are averaged over the processes (so NT-ASGD decides
alike everywhere and the averaged weights stay identical), and ``hidden`` is saved whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from highrank.config import Config
from highrank.data import Corpus, get_batch
from highrank.data.streaming import epoch_view
from highrank.models import LanguageModel
from highrank.models.backbones import AWDLSTMState, variable_bptt_length
from highrank.runs.checkpoint import evaluation_state_dict
from highrank.train.asgd import (
    NonMonotoneTrigger,
    SwitchTrigger,
    averaged_parameters,
    build_trigger,
    scaled_lr,
    switch_to_asgd,
)
from highrank.train.distributed import average, distribute, gather_columns, shard_columns
from highrank.train.recipe import EpochSize, Stage, StepBatch, StepResult, Verdict
from highrank.train.state import Progress
from highrank.train.steps import backward_or_skip, clip_or_skip, head_chunk_size
from highrank.train.stream import load_splits, validation_loss

# ---- one step, and validation -----------------------------------------------------------------


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
    forward: torch.nn.Module | None = None,
) -> StepOutcome:
    """One training step on a window ``(L, B)``: forward (:func:`training_loss`), backward,
    clip the gradient norm of ``params`` to ``clip`` (0: no clipping), optimizer step with
    every group's lr scaled by ``lr_scale``. A non-finite loss or gradient norm skips the step
    (no update, gradients zeroed) and says why. Under torchrun (``forward`` the DDP wrapper)
    the gradients and the NLL are averaged over the processes."""
    optimizer.zero_grad(set_to_none=True)
    loss, nll, new_state = training_loss(forward or model, tokens, target, state, chunk_size)
    reason = backward_or_skip(loss, optimizer) or clip_or_skip(optimizer, params, clip)
    if reason:
        return StepOutcome(None, state, reason)
    with scaled_lr(optimizer, lr_scale):
        optimizer.step()
    return StepOutcome(average(nll), model.backbone.detach_state(new_state), "")


def build_optimizer(
    model: LanguageModel, lr: float, weight_decay: float, phase: str = "sgd"
) -> torch.optim.Optimizer:
    """SGD over the model's parameter groups (PLIF's slopes keep their own lr), weight decay on
    all of them; ``phase="asgd"``: the same groups under averaged SGD."""
    optimizer = torch.optim.SGD(model.parameter_groups(lr), lr=lr, weight_decay=weight_decay)
    return switch_to_asgd(optimizer) if phase == "asgd" else optimizer


def bptt_generator(seed: int) -> torch.Generator:
    """The generator of the variable BPTT lengths, its own stream (checkpointed separately)."""
    return torch.Generator().manual_seed(seed + 1)


# ---- the recipe -------------------------------------------------------------------------------


class AWDLSTMRecipe:
    """The AWD-LSTM schedule of one stage (see the module docstring), for the loop."""

    eval_every = None  # validation at epoch ends only

    def __init__(
        self,
        config: Config,
        model: LanguageModel,
        corpus: Corpus,
        stage: Stage,
        device: torch.device,
    ) -> None:
        self.config, self.model, self.stage = config, model, stage
        self.finetuning = stage.name == "finetune"
        self.splits = load_splits(config, corpus, device)
        lr = config.finetune.lr if self.finetuning else config.train.lr
        phase = "asgd" if self.finetuning else "sgd"  # finetuning restarts averaged SGD
        self.optimizer = build_optimizer(model, lr, config.train.weight_decay, phase)
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.trigger = self._trigger()
        self.bptt_rng = bptt_generator(config.train.seed)
        self.hidden = model.init_state(self.splits.train.size(1))
        self.forward = distribute(model, config.train.seed)  # DDP under torchrun

    def _trigger(self) -> SwitchTrigger:
        t = self.config.train
        if self.finetuning:  # the non-monotone rule stops finetuning instead of switching
            return NonMonotoneTrigger(t.nonmono)
        return build_trigger(t.optimizer, nonmono=t.nonmono, switch_epoch=t.switch_epoch,
                             latest_switch=t.latest_switch_epoch)

    @property
    def phase(self) -> str:
        return "asgd" if isinstance(self.optimizer, torch.optim.ASGD) else "sgd"

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # ---- steps ------------------------------------------------------------------------------

    def epoch_size(self) -> EpochSize:
        """Windows start at rows 0 .. T - 3 of the (T, B) batch: one starting at T - 2 would be
        a single token, which awd-lstm-lm and MoS skip (``while i < T - 1 - 1``) and so do we
        (but for T = 2, where it is the only window); row T - 1 is only ever a target."""
        rows, batch = self.splits.train.shape
        return EpochSize(max(rows - 2, 1), batch)

    def start_epoch(self, progress: Progress) -> None:
        self.hidden = self.model.init_state(self.splits.train.size(1))  # as AWD-LSTM

    def next_batch(self, progress: Progress) -> StepBatch:
        """A window of variable length from the epoch's position, capped at bptt +
        train.max_seq_len_delta (finetuning: finetune.max_seq_len_delta)."""
        train = self.config.train
        delta = (
            self.config.finetune.max_seq_len_delta if self.finetuning else train.max_seq_len_delta
        )
        drawn = variable_bptt_length(train.bptt, self.bptt_rng, delta).seq_len
        train_rows = epoch_view(self.splits.train, progress.epoch)  # data.batching
        tokens, target = get_batch(train_rows, progress.position, drawn)  # (L, B) each
        return StepBatch((tokens, target), tokens.size(0), tokens.numel(), tokens.size(0))

    def train_step(self, batch: StepBatch) -> StepResult:
        """Forward, backward, clip, SGD step with the lr scaled by L / bptt."""
        tokens, target = batch.data
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
            forward=self.forward,
        )
        if outcome.nll is not None:
            self.hidden = outcome.state
        return StepResult(outcome.nll, outcome.skip_reason)

    def divergence_advice(self) -> str:
        """What to change: settings a resume keeps, so in a new run (or a new finetuning)."""
        lr, clip = self.lr, self.config.train.clip
        if self.finetuning:
            return (
                f"Finetune anew with a lower learning rate (now lr = {lr:g}, e.g. "
                f"--finetune.lr={lr / 2:g}) after deleting checkpoints/finetune-last*.pt "
                f"(a resume keeps the learning rate)"
            )
        return (
            f"Start a new run (another --run.out_dir: a resume keeps these settings) with a "
            f"lower learning rate (now lr = {lr:g}, e.g. --train.lr={lr / 2:g}) or a tighter "
            f"gradient clip (train.clip = {clip:g}, e.g. --train.clip={(clip or 1.0) / 2:g})"
        )

    # ---- validation -------------------------------------------------------------------------

    def validate(self) -> float:
        """Validation loss of the weights to evaluate (the averages once on ASGD)."""
        with averaged_parameters(self.optimizer):
            return validation_loss(self.model, self.config, self.splits.valid)

    def after_validation(self, val_loss: float, progress: Progress) -> Verdict:
        """The switch policy: maybe switch to averaged SGD, or (finetuning) stop."""
        fired = self.trigger.update(val_loss)
        key = "stopped" if self.finetuning else "switched"
        if not fired:
            return Verdict({key: False})
        if self.finetuning:
            done = f"{self.stage.name}: validation stopped improving (non-monotone rule); done"
            return Verdict({key: True}, "nonmono", done)
        self.optimizer = switch_to_asgd(self.optimizer)
        policy = self.config.train.optimizer
        message = f"epoch {progress.epoch}: switching to averaged SGD ({policy})"
        return Verdict({key: True}, message=message)

    # ---- checkpoints ------------------------------------------------------------------------

    def evaluation_state_dict(self) -> dict[str, torch.Tensor]:
        return evaluation_state_dict(self.model, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "phase": self.phase,
            "trigger": self.trigger.state_dict(),
            "hidden": [[gather_columns(h), gather_columns(c)] for h, c in self.hidden],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["phase"] == "asgd" and self.phase == "sgd":
            self.optimizer = switch_to_asgd(self.optimizer)
        self.optimizer.load_state_dict(state["optimizer"])
        self.trigger.load_state_dict(state["trigger"])
        device = self.splits.train.device
        self.hidden = [
            (shard_columns(h, "hidden").to(device), shard_columns(c, "hidden").to(device))
            for h, c in state["hidden"]
        ]

    def generators(self) -> dict[str, torch.Generator]:
        return {"bptt": self.bptt_rng}


__all__ = [
    "AWDLSTMRecipe",
    "StepOutcome",
    "bptt_generator",
    "build_optimizer",
    "optimization_step",
    "training_loss",
]
