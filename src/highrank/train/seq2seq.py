"""The translation recipe: an encoder-decoder Transformer trained on token-bounded batches.

Vaswani et al., "Attention Is All You Need" (NeurIPS 2017), Sec. 5, as fairseq runs it:

    batches     pairs sorted by length and cut at train.max_tokens padded tokens
                (:class:`highrank.mt.bitext.TokenBatches`), shuffled per epoch from
                (train.seed, epoch); pairs longer than model.max_len are dropped
    loss        the head's label-smoothed cross-entropy (train.label_smoothing, Szegedy et al.
                2016), mean over the real target tokens, padding ignored
                (``head.loss(..., label_smoothing=, ignore_index=<pad>)``)
    optimizer   AdamW (beta1 0.9, train.adam_beta2, epsilon 1e-9; decay train.weight_decay on
                matrices), gradient norm clipped to train.clip (0: not clipped)
    lr          train.lr x linear warm-up over train.warmup_steps, then inverse-sqrt or cosine
                (train.lr_schedule; :mod:`highrank.train.schedule`), set before every update
    validation  mean NLL per target token of the valid split *without* smoothing (so
                exp(val_loss) is the perplexity), every train.eval_every updates and at every
                epoch end; best.pt holds the weights with the lowest one

The training loss the loop logs (``train_loss``) is the label-smoothed loss, not the NLL.

Run layout: the subword vocabulary is learned on the train split when the run starts and saved
under ``RUN_DIR/subwords/`` before the first step; a resumed run reloads it (and never relearns
it). The recipe's checkpoint state is ``optimizer`` (AdamW, with its step counts) and
``updates`` (the schedule's step); the batch order needs no state (a pure function of the seed
and the epoch), and dropout draws from the global generator the loop checkpoints, so resuming
is bit-identical.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from highrank.config import Config, ConfigError
from highrank.models import build_seq2seq
from highrank.mt.bitext import TokenBatches
from highrank.mt.translation_data import (
    TranslationData,
    learn_translation_data,
    saved_translation_data,
)
from highrank.runs.checkpoint import CheckpointError, load_weights
from highrank.runs.run_dir import RunDir, RunDirError
from highrank.train import distributed
from highrank.train.loop import Trainer, restore
from highrank.train.recipe import EpochSize, RunKind, Stage, StepBatch, StepResult, Verdict
from highrank.train.schedule import build_adamw, lr_factor, set_lr
from highrank.train.sizes import check_model_fits
from highrank.train.startup import resolve_device, seed_everything
from highrank.train.state import Progress, TrainOptions, TrainResult
from highrank.train.steps import backward_or_skip, clip_or_skip, head_chunk_size

ADAM_BETA1, ADAM_EPSILON = 0.9, 1e-9  # Vaswani et al. 2017, Sec. 5.3


class Seq2SeqRecipe:
    """The translation schedule (see the module docstring), for the loop."""

    def __init__(
        self,
        config: Config,
        model: torch.nn.Module,
        data: TranslationData,
        stage: Stage,
        device: torch.device,
    ) -> None:
        if stage.name != "train":
            raise ConfigError(f"a seq2seq run has no {stage.name!r} stage; only training")
        if distributed.active():
            raise ConfigError(
                "model.backbone = 'seq2seq' trains in one process only (torchrun support is "
                "for the awd-lstm and transformer families); run it without torchrun"
            )
        self.config, self.model, self.data, self.device = config, model, data, device
        t = config.train
        self.eval_every = t.eval_every
        self.optimizer = build_adamw(
            model, t.lr, t.weight_decay, (ADAM_BETA1, t.adam_beta2), ADAM_EPSILON
        )
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.updates = 0  # updates attempted (the schedule's clock, skipped ones included)
        self.epoch = 1  # the loop's epoch (start_epoch; a resumed run's from its progress)
        self._epoch_batches: tuple[int, Any] | None = None
        self._valid = None
        total = t.epochs * len(self._batches(1)) if t.lr_schedule == "cosine" else None
        self.total_steps = total
        set_lr(self.optimizer, self._lr_at(1))

    def _lr_at(self, update: int) -> float:
        t = self.config.train
        factor = lr_factor(
            update,
            warmup_steps=t.warmup_steps,
            schedule=t.lr_schedule,
            total_steps=self.total_steps,
        )
        return t.lr * factor

    def _batches(self, epoch: int):
        """The shuffled token batches of ``epoch`` (built once per epoch)."""
        if self._epoch_batches is None or self._epoch_batches[0] != epoch:
            batches = TokenBatches(
                self.data.pairs("train"),
                max_tokens=self.config.train.max_tokens,
                special=self.data.special,
                shuffle=True,
                seed=self.config.train.seed,
                epoch=epoch,
                max_len=self.config.model.max_len,
            )
            self._epoch_batches = (epoch, batches)
            self._note_dropped(batches)
        return self._epoch_batches[1]

    def _note_dropped(self, batches) -> None:
        """Say once how many training pairs max_len leaves out (the same every epoch)."""
        if getattr(self, "_dropped_noted", False) or not len(batches.dropped):
            return
        self._dropped_noted = True
        first = ", ".join(str(int(i) + 1) for i in batches.dropped[:5])
        print(
            f"note: {len(batches.dropped):,} training pairs have more than model.max_len = "
            f"{self.config.model.max_len} tokens on a side and are left out (pairs {first}"
            f"{', ...' if len(batches.dropped) > 5 else ''})",
            file=sys.stderr,
        )

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def phase(self) -> str:
        warming = self.updates < self.config.train.warmup_steps
        return "warmup" if warming else self.config.train.lr_schedule

    # ---- steps ------------------------------------------------------------------------------

    def epoch_size(self) -> EpochSize:
        return EpochSize(len(self._batches(self.epoch)), self.config.train.max_tokens)

    def start_epoch(self, progress: Progress) -> None:
        self.epoch = progress.epoch

    def next_batch(self, progress: Progress) -> StepBatch:
        """Batch number ``progress.position`` of the epoch's shuffled batches."""
        batch = self._batches(progress.epoch)[progress.position]
        return StepBatch(batch, 1, batch.n_target_tokens, batch.tgt_out.shape[1])

    def train_step(self, batch: StepBatch) -> StepResult:
        """Set the lr of this update, forward, backward, clip, AdamW step."""
        self.updates += 1
        set_lr(self.optimizer, self._lr_at(self.updates))
        pair = batch.data
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model.loss(
            pair.src.to(self.device),
            pair.tgt_in.to(self.device),
            pair.tgt_out.to(self.device),
            label_smoothing=self.config.train.label_smoothing,
            chunk_size=head_chunk_size(self.config),
        )
        reason = backward_or_skip(loss, self.optimizer) or clip_or_skip(
            self.optimizer, self.params, self.config.train.clip
        )
        if reason:
            return StepResult(None, reason)
        self.optimizer.step()
        return StepResult(loss.detach().item())

    def divergence_advice(self) -> str:
        t = self.config.train
        clip = (  # never the clip already in use
            f"a tighter gradient clip (train.clip = {t.clip:g}, e.g. --train.clip={t.clip / 2:g})"
            if t.clip
            else "a gradient clip (train.clip = 0: none, e.g. --train.clip=1)"
        )
        return (
            f"Try a lower peak learning rate (train.lr = {t.lr:g}, e.g. --train.lr={t.lr / 2:g}), "
            f"a longer warm-up (train.warmup_steps = {t.warmup_steps}) or {clip}"
        )

    # ---- validation -------------------------------------------------------------------------

    @torch.no_grad()
    def validate(self) -> float:
        """Mean NLL per target token of the valid split (no label smoothing), eval mode."""
        self.model.eval()
        if self._valid is None:
            self._valid = _eval_batches(self.data, "valid", self.config.train.max_tokens)
        total, count = 0.0, 0
        for pair in self._valid:
            nll = self.model.loss(
                pair.src.to(self.device),
                pair.tgt_in.to(self.device),
                pair.tgt_out.to(self.device),
                reduction="sum",
                chunk_size=head_chunk_size(self.config),
            )
            total, count = total + float(nll), count + pair.n_target_tokens
        return total / count

    def after_validation(self, val_loss: float, progress: Progress) -> Verdict:
        return Verdict({})

    # ---- checkpoints ------------------------------------------------------------------------

    def evaluation_state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])
        self.epoch = int(state["progress"]["epoch"])  # the loop's, in the same dict

    def generators(self) -> dict[str, torch.Generator]:
        return {}


def _eval_batches(data: TranslationData, split: str, max_tokens: int):
    """A split's batches in length order (no shuffling, nothing dropped)."""
    return TokenBatches(
        data.pairs(split), max_tokens=max_tokens, special=data.special, shuffle=False
    )


# ---- starting and continuing a run ------------------------------------------------------------


def start_translation(
    config: Config, stage: Stage, options: TrainOptions, command: Sequence[str]
) -> TrainResult:
    """A new translation run in ``config.run.out_dir``: learn the subwords on train, build the
    model, create the run directory (vocab.json = the target pieces), save the subwords, train.
    ``config`` has absolute paths (``highrank.train.runner.train``)."""
    existing = RunDir(Path(config.run.out_dir))
    # RunDir.create's rule, said before the subwords are learned: a run with a checkpoint is
    # continued with --resume; one stopped before its first checkpoint starts again in place.
    if existing.config_file.exists() and existing.has_checkpoint():
        raise RunDirError(
            f"{existing.path} already holds a run ({existing.config_file.name} exists); continue "
            f"it with `highrank train --resume {existing.path}`, or choose another run.out_dir"
        )
    if existing.config_file.exists():
        print(
            f"note: {existing.path} holds a run that stopped before its first checkpoint; "
            "starting it again in place",
            file=sys.stderr,
        )
    device = resolve_device(config.run.device)
    data = learn_translation_data(config)
    seed_everything(config.train.seed)
    model = build_seq2seq(config, data.vocab_sizes).to(device)
    recipe = Seq2SeqRecipe(config, model, data, stage, device)
    run = RunDir.create(config.run.out_dir, config, data.target_vocab(), command)
    data.subwords.save(run.path)
    size = data.vocab_sizes[1]
    return Trainer(config, run, stage, recipe, Progress(), options, size).run()


def continue_translation(
    run: RunDir,
    stage: Stage,
    payload: dict,
    path: Path,
    config: Config,
    options: TrainOptions,
) -> Trainer:
    """A trainer in exactly the state of a translation checkpoint (subwords reloaded)."""
    device = resolve_device(config.run.device)
    data = saved_translation_data(run.path, config, ("train", "valid"))
    if run.load_vocab() != data.target_vocab():
        raise CheckpointError(f"{run.vocab_file} does not match {run.path / 'subwords'}")
    training = payload["training"]
    model = build_seq2seq(config, data.vocab_sizes).to(device)
    load_weights(model, training["model"], path)
    recipe = Seq2SeqRecipe(config, model, data, stage, device)
    return restore(config, run, stage, recipe, training, options, data.vocab_sizes[1])


def _start(
    config: Config,
    stage: Stage,
    device: torch.device,
    options: TrainOptions,
    command: Sequence[str],
    init_from: Any = None,
) -> TrainResult:
    """:func:`start_translation` (which picks its device itself), refusing ``--init-from``."""
    if init_from is not None:
        raise ConfigError("--init-from applies to language models, not translation")
    # before the subwords are learned: a model no memory holds is one line, not an allocator's
    # traceback
    check_model_fits(config, _vocab_size(config), device)
    return start_translation(config, stage, options, command)


def _vocab_size(config: Config) -> int:
    """data.subword_vocab_size: SentencePiece learns exactly that many pieces."""
    return config.data.subword_vocab_size


# How translation runs start and continue (highrank.train.runner.RUN_KINDS): parallel text and
# subwords, not a word corpus; one process.
TRANSLATION = RunKind(
    name="translation training",
    start=_start,
    resume=continue_translation,
    vocab_size=_vocab_size,
    torchrun=False,
    no_finetune=(
        "{run} is a translation run: finetune (averaged SGD on a word corpus, the "
        "AWD-LSTM recipe) does not apply; train it longer with `highrank train --resume "
        "{run} --train.epochs=N`"
    ),
)


__all__ = ["TRANSLATION", "Seq2SeqRecipe", "continue_translation", "start_translation"]
