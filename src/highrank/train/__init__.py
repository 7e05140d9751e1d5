"""Training language models: one generic loop, and a recipe per model family.

Layout::

    loop.py       Trainer: steps, validation, checkpoints, non-finite guard, exact resume
    recipe.py     the Recipe protocol (what the loop asks of a schedule) and its small types
    awd_lstm.py   the AWD-LSTM recipe: variable BPTT, lr scaled by window length, NT-/ET-ASGD
                  and averaged weights, finetuning (Merity et al., 2018; Yang et al., 2018)
    runner.py     train / resume / finetune: run directory, model, recipe (RECIPES, chosen by
                  model.backbone), loop
    state.py      Progress, Meter, TrainOptions, TrainResult, StepInfo, TrainingError,
                  Interrupted
    saving.py     the stage's checkpoints: payload, last (by steps and by time), best
    interrupts.py SIGINT / SIGTERM caught, acted on between two steps
    reporting.py  metrics.jsonl, TensorBoard, the progress bar, the validation line
    steps.py      the non-finite guard pieces every recipe uses; the head's chunk size
    startup.py    seeding; the device
    stream.py     what the stream-LM recipes (AWD-LSTM, Transformer) share: batches, validation
    asgd.py       SGD -> averaged SGD switch policies (NT-ASGD, ET-ASGD) and the averages
    transformer.py, seq2seq.py   the recipes of the other two families
    schedule.py   AdamW groups and learning-rate schedules shared by those two
    distributed.py  torchrun / DDP

Adding a model family's schedule (e.g. the Transformer's: AdamW, warm-up then cosine or
inverse-sqrt decay, gradient accumulation, bf16 autocast, fixed-length windows, evaluation
every N steps) is one module beside ``awd_lstm.py`` with a class that keeps the
:class:`~highrank.train.recipe.Recipe` protocol, and one entry in
:data:`highrank.train.runner.RECIPES`; the loop does not change. Read
:mod:`highrank.train.recipe` for the calling order and the checkpoint contract.

Public API::

    train(config, *, options=TrainOptions(), command=None) -> TrainResult
    resume(run_dir, *, overrides=(), options=TrainOptions(), command=None) -> TrainResult
    finetune(run_dir, *, resume=False, overrides=(), options=TrainOptions(), command=None)
    optimization_step(model, optimizer, params, tokens, target, state, *, chunk_size, clip,
                      lr_scale) -> StepOutcome          # one AWD-LSTM training step
    evaluate_loss(model, source, bptt, *, chunk_size="auto") -> float  # mean NLL per token
    parameter_count(config, vocab_size) -> int                        # on the meta device
    corpus_vocab_size(config) -> int

``last.pt`` is saved every ``train.checkpoint_every`` steps, at every epoch end and when
``TrainOptions.max_steps`` stops a run after that many steps in total: resuming it continues
bit-identically (same losses, same weights) on the same machine. The run directory and
checkpoint layouts are described in :mod:`highrank.runs.run_dir` and
:mod:`highrank.runs.checkpoint`.
"""

from highrank.train.awd_lstm import (
    AWDLSTMRecipe,
    StepOutcome,
    build_optimizer,
    optimization_step,
    training_loss,
)
from highrank.train.loop import Trainer
from highrank.train.recipe import EpochSize, Recipe, Stage, StepBatch, StepResult, Verdict
from highrank.train.runner import (
    FINETUNE_OVERRIDES,
    FINETUNE_RESUME_OVERRIDES,
    RECIPES,
    RESUME_OVERRIDES,
    corpus_vocab_size,
    finetune,
    parameter_count,
    resume,
    train,
)
from highrank.train.startup import resolve_device, seed_everything
from highrank.train.state import (
    Interrupted,
    Meter,
    Progress,
    StepInfo,
    TrainingError,
    TrainOptions,
    TrainResult,
)
from highrank.train.steps import head_chunk_size
from highrank.train.stream import evaluate_loss

__all__ = [
    "FINETUNE_OVERRIDES",
    "FINETUNE_RESUME_OVERRIDES",
    "RECIPES",
    "RESUME_OVERRIDES",
    "AWDLSTMRecipe",
    "EpochSize",
    "Interrupted",
    "Meter",
    "Progress",
    "Recipe",
    "Stage",
    "StepBatch",
    "StepInfo",
    "StepOutcome",
    "StepResult",
    "TrainOptions",
    "TrainResult",
    "Trainer",
    "TrainingError",
    "Verdict",
    "build_optimizer",
    "corpus_vocab_size",
    "evaluate_loss",
    "finetune",
    "head_chunk_size",
    "optimization_step",
    "parameter_count",
    "resolve_device",
    "resume",
    "seed_everything",
    "train",
    "training_loss",
]
