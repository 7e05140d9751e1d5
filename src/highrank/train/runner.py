"""Starting, resuming and finetuning runs: a run directory, a model, a recipe, the loop.

The recipe is chosen by ``model.backbone`` in :data:`RECIPES`; each entry is a class built as
``Recipe(config, model, corpus, stage, device)`` (:mod:`highrank.train.recipe`). How a run of
the family starts and continues (its data, its processes) is its
:class:`~highrank.train.recipe.RunKind` in :data:`RUN_KINDS`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from highrank.config import (
    Config,
    ConfigError,
    config_from_dict,
    load_config,
    parse_override,
)
from highrank.data import Corpus
from highrank.data.streaming import corpus_checksums, open_corpus
from highrank.models import build_model
from highrank.runs.checkpoint import (
    CheckpointError,
    config_of,
    load_checkpoint,
    load_resumable,
    load_weights,
    missing_best_hint,
)
from highrank.runs.checkpoint import check_own_checkpoint as own_checkpoint
from highrank.runs.locks import run_lock
from highrank.runs.run_dir import RunDir, check_writable
from highrank.train import distributed
from highrank.train.awd_lstm import AWDLSTMRecipe
from highrank.train.loop import Trainer, restore
from highrank.train.recipe import Recipe, RunKind, Stage
from highrank.train.seq2seq import TRANSLATION, Seq2SeqRecipe
from highrank.train.sizes import check_model_fits, parameter_count
from highrank.train.startup import resolve_device, seed_everything
from highrank.train.state import Progress, TrainOptions, TrainResult
from highrank.train.transformer import TransformerRecipe
from highrank.train.warm_start import init_from_run
from highrank.util.denormals import flush_denormals

# model.backbone -> the recipe class that trains it.
RECIPES: dict[str, Callable[..., Recipe]] = {
    "awd-lstm": AWDLSTMRecipe,
    "transformer": TransformerRecipe,
    "seq2seq": Seq2SeqRecipe,  # its "corpus" is a highrank.mt.translation_data.TranslationData
}

# Keys a resumed run may change: they do not alter the computation already done (data.dir
# and data.cache_dir may point at a moved corpus: its vocabulary is checked against the run's).
RESUME_OVERRIDES = (
    "train.epochs",
    "train.log_every",
    "train.checkpoint_every",
    "train.max_nonfinite_skips",
    "train.checkpoint_minutes",
    "train.patience",  # when to stop, decided at epoch ends: may be changed for what is left
    "train.patience_min_delta",
    "run.device",
    "data.dir",
    "data.cache_dir",
)
FINETUNE_OVERRIDES = (
    "finetune.lr",
    "finetune.epochs",
    "finetune.max_seq_len_delta",
    *RESUME_OVERRIDES[1:],
    "train.nonmono",
)
FINETUNE_RESUME_OVERRIDES = ("finetune.epochs", *RESUME_OVERRIDES[1:])


def train_stage(config: Config) -> Stage:
    return Stage("train", config.train.epochs, "last", "best")


def finetune_stage(config: Config) -> Stage:
    return Stage("finetune", config.finetune.epochs, "finetune-last", "finetuned")


def build_recipe(
    config: Config, model: torch.nn.Module, corpus: Corpus, stage: Stage, device: torch.device
) -> Recipe:
    """The recipe of ``config.model.backbone`` for ``stage``, with a fresh optimizer."""
    family = config.model.backbone
    if family not in RECIPES:
        raise ConfigError(
            f"model.backbone = {family!r} has no training recipe; known: {', '.join(RECIPES)}"
        )
    return RECIPES[family](config, model, corpus, stage, device)


# ---- the pieces -------------------------------------------------------------------------------


def _absolute_paths(config: Config) -> Config:
    """The config with data.dir (and data.cache_dir) absolute, so a run resumes from anywhere."""
    data = config.data
    cache = None if data.cache_dir is None else os.path.abspath(data.cache_dir)
    data = dataclasses.replace(data, dir=os.path.abspath(data.dir), cache_dir=cache)
    return dataclasses.replace(config, data=data)


def _corpus(config: Config) -> Corpus:
    """In memory, or memory-mapped when data.memmap (:mod:`highrank.data.streaming`)."""
    return open_corpus(config.data, config.train.seed)


def _check_same_vocab(run: RunDir, corpus: Corpus, path: Path) -> None:
    saved = run.load_vocab()
    if saved != corpus.vocab:
        raise CheckpointError(
            f"the corpus at {corpus.directory} has a different vocabulary from the run's "
            f"{run.vocab_file} ({_vocab_difference(corpus.vocab.words, saved.words)}): "
            f"checkpoint {path} cannot continue on it; point --data.dir at the run's corpus"
        )


def _vocab_difference(now: Sequence[str], saved: Sequence[str]) -> str:
    """Where two vocabularies part: their sizes, or (same size: the words' counts, hence
    their frequency order, changed) the first id that names another token."""
    if len(now) != len(saved):
        return f"{len(now)} vs {len(saved)} tokens"
    first = next(i for i, (a, b) in enumerate(zip(now, saved, strict=True)) if a != b)
    return (
        f"both {len(now)} tokens, but id {first} is {now[first]!r} in the corpus and "
        f"{saved[first]!r} in the run"
    )


def _check_same_corpus(run: RunDir, corpus: Corpus, path: Path) -> None:
    """The corpus's token ids are those the run started on (same vocabulary is not enough:
    edited text with the same words would continue the run on other data)."""
    recorded = run.load_corpus_checksums()
    if recorded is None:
        return
    now = corpus_checksums(corpus)
    changed = [split for split in recorded if recorded[split] != now.get(split)]
    if changed:
        what = ", ".join(f"{s} ids crc32 {now.get(s)} vs {recorded[s]}" for s in changed)
        raise CheckpointError(
            f"the corpus at {corpus.directory} is not the one the run started on ({what}; "
            f"recorded in {run.corpus_file}), although its vocabulary is: checkpoint {path} "
            "cannot continue on it; point --data.dir at the run's corpus, or start a new run"
        )


def _check_allowed(overrides: Sequence[str], allowed: Sequence[str]) -> None:
    for text in overrides:
        section, key, _ = parse_override(text)
        if f"{section}.{key}" not in allowed:
            raise ConfigError(
                f"override {text!r}: {section}.{key} cannot change when continuing a run (it "
                f"would change what was already computed); allowed here: {', '.join(allowed)}"
            )


def _apply_config_overrides(path: Path, overrides: Sequence[str], allowed: Sequence[str]) -> Config:
    """The run's config.toml with ``overrides``, each of which must be in ``allowed``."""
    _check_allowed(overrides, allowed)
    return _absolute_paths(load_config(path, overrides))


def _apply_overrides(
    payload: Mapping[str, Any], path: Path, overrides: Sequence[str], allowed: Sequence[str]
) -> Config:
    """The checkpoint's config with ``overrides``, each of which must be in ``allowed``."""
    _check_allowed(overrides, allowed)
    if not overrides:
        return config_of(payload, path)
    config = config_from_dict(payload["config"], overrides, source=f"{path} (stored config)")
    return _absolute_paths(config)


def _command(command: Sequence[str] | None, default: Sequence[str]) -> list[str]:
    return list(command) if command is not None else list(default)


def _continue(
    run: RunDir, stage: Stage, payload: dict, path: Path, config: Config, options: TrainOptions
) -> Trainer:
    """A trainer in exactly the state of a checkpoint with training state."""
    return RUN_KINDS[config.model.backbone].resume(run, stage, payload, path, config, options)


def _continue_words(
    run: RunDir, stage: Stage, payload: dict, path: Path, config: Config, options: TrainOptions
) -> Trainer:
    """:func:`_continue` for a language model on a word corpus."""
    device = resolve_device(config.run.device)
    corpus = _corpus(config)
    _check_same_vocab(run, corpus, path)
    _check_same_corpus(run, corpus, path)
    training = payload["training"]
    model = build_model(config, len(corpus.vocab)).to(device)
    load_weights(model, training["model"], path)
    recipe = build_recipe(config, model, corpus, stage, device)
    return restore(config, run, stage, recipe, training, options, len(corpus.vocab))


# ---- public entry points ----------------------------------------------------------------------


@flush_denormals()
def train(
    config: Config,
    *,
    options: TrainOptions | None = None,
    command: Sequence[str] | None = None,
    init_from: str | os.PathLike | None = None,
) -> TrainResult:
    """Train the model ``config`` describes in a new run directory ``config.run.out_dir``.

    ``command`` is written to command.txt (default: ``highrank train``). ``init_from``: a
    trained softmax run whose model this one starts from, its head switched to
    ``config.head`` at that softmax's distribution (:mod:`highrank.train.warm_start`).
    """
    options = options or TrainOptions()
    kind = RUN_KINDS[config.model.backbone]
    if kind.torchrun:  # the others run in one process (cli.train)
        distributed.init_from_env()  # under torchrun: join the other processes
    config = _absolute_paths(config)
    command = _command(command, ["highrank", "train"])
    check_writable(config.run.out_dir)
    device = resolve_device(config.run.device)
    # held until the run ends: one writer per directory (process 0 under torchrun)
    with _lock(config.run.out_dir):
        _on_writer(RunDir(Path(config.run.out_dir)).remove_temporaries)
        return kind.start(config, train_stage(config), device, options, command, init_from)


def _train_words(
    config: Config,
    stage: Stage,
    device: torch.device,
    options: TrainOptions,
    command: list[str],
    init_from: str | os.PathLike | None = None,
) -> TrainResult:
    corpus = _corpus(config)
    check_model_fits(config, len(corpus.vocab), device)
    seed_everything(config.train.seed)
    model = build_model(config, len(corpus.vocab))
    if init_from is not None:
        init_from_run(model, init_from, corpus.vocab)
    model = model.to(device)
    recipe = build_recipe(config, model, corpus, stage, device)
    _on_writer(lambda: _note_restart(RunDir(Path(config.run.out_dir))))
    run = distributed.on_writer(  # inputs all good
        lambda: RunDir.create(
            config.run.out_dir, config, corpus.vocab, command, corpus_checksums(corpus)
        ),
        lambda: RunDir(Path(config.run.out_dir)),
    )
    return Trainer(config, run, stage, recipe, Progress(), options, len(corpus.vocab)).run()


def _lock(run_dir: str | os.PathLike):
    """The run's lock (process 0's under torchrun: the others write nothing)."""
    return distributed.writer_lock(lambda: run_lock(run_dir))


def _on_writer(write: Callable[[], Any]) -> None:
    """``write()`` on process 0 only, the others waiting until it is done."""
    distributed.on_writer(write, lambda: None)


def _note_restart(run: RunDir) -> None:
    if run.config_file.exists() and not run.has_checkpoint():
        print(
            f"note: {run.path} holds a run that stopped before its first checkpoint; "
            "starting it again in place",
            file=sys.stderr,
        )


@flush_denormals()
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
    ``train.epochs``). A run that stopped before its first checkpoint starts again in place
    from its config.toml (as if trained anew: same seed, same result).
    """
    run = _open_locked_run(run_dir)
    if RUN_KINDS[run.load_config().model.backbone].torchrun:  # else one process (cli.train)
        distributed.init_from_env()
    with _lock(run.path):
        _on_writer(run.remove_temporaries)
        if not run.has_checkpoint():  # stopped before its first save: nothing to continue from
            config = _apply_config_overrides(run.config_file, overrides, RESUME_OVERRIDES)
            command = _command(command, ["highrank", "train", "--resume", str(run_dir)])
            return train(config, options=options, command=command)
        payload, path = load_resumable(run.checkpoints)
        check_own_checkpoint(run, payload, path)
        if payload["stage"] != "train":
            raise CheckpointError(f"{path} is a {payload['stage']} checkpoint, not a training one")
        config = _apply_overrides(payload, path, overrides, RESUME_OVERRIDES)
        trainer = _continue(
            run, train_stage(config), payload, path, config, options or TrainOptions()
        )
        line = _command(command, ["highrank", "train", "--resume", str(run_dir)])
        _on_writer(lambda: run.append_command(line))
        return trainer.run()


def _open_locked_run(run_dir: str | os.PathLike) -> RunDir:
    """An existing run directory that can be written (:func:`check_writable`)."""
    run = RunDir.open(run_dir)
    check_writable(run.path)
    return run


def check_own_checkpoint(run: RunDir, payload: Mapping[str, Any], path: Path) -> None:
    """Refuse another run's checkpoint (``highrank.runs.checkpoint.check_own_checkpoint``)."""
    own_checkpoint(run.path, payload, path)


@flush_denormals()
def finetune(
    run_dir: str | os.PathLike,
    *,
    resume: bool = False,
    which: str = "best",
    overrides: Sequence[str] = (),
    options: TrainOptions | None = None,
    command: Sequence[str] | None = None,
) -> TrainResult:
    """Finetune a trained run (MoS ``finetune.py``): averaged SGD restarted from ``best.pt``
    with ``finetune.lr``; ``finetuned.pt`` holds the averaged weights whenever validation
    improves on the best so far; stops by the non-monotone rule (n = train.nonmono) or after
    ``finetune.epochs``. ``resume=True`` continues an interrupted finetuning exactly.
    ``which="last"`` starts from ``last.pt``'s evaluation weights instead (a run stopped
    before its first epoch end has no best.pt).
    """
    run = _open_locked_run(run_dir)
    if RUN_KINDS[run.load_config().model.backbone].torchrun:  # else one process (cli.train)
        distributed.init_from_env()
    default = ["highrank", "finetune", str(run_dir), *(["--resume"] if resume else [])]
    options = options or TrainOptions()
    with _lock(run.path):
        _on_writer(run.remove_temporaries)
        if resume:
            names = ("finetune-last.pt", "finetune-last.prev.pt")
            payload, path = load_resumable(run.checkpoints, names)
            check_own_checkpoint(run, payload, path)
            config = _apply_overrides(payload, path, overrides, FINETUNE_RESUME_OVERRIDES)
            trainer = _continue(run, finetune_stage(config), payload, path, config, options)
        else:
            trainer = _start_finetune(run, overrides, options, which)
        _on_writer(lambda: run.append_command(_command(command, default)))
        return trainer.run()


def _start_finetune(
    run: RunDir, overrides: Sequence[str], options: TrainOptions, which: str = "best"
) -> Trainer:
    """A finetuning trainer on ``which``'s (best.pt's) evaluation weights, a fresh recipe."""
    started = run.checkpoint("finetune-last")
    if started.exists():
        raise CheckpointError(
            f"{run.path} was already finetuned ({started} exists); continue it with "
            f"`highrank finetune {run.path} --resume`"
        )
    if which not in ("best", "last"):
        raise CheckpointError(f"finetune --which {which!r}: expected best or last")
    best = run.checkpoint(which)
    if which == "best" and not best.is_file():
        raise CheckpointError(missing_best_hint(run.path))
    payload = load_checkpoint(best)
    check_own_checkpoint(run, payload, best)
    config = _apply_overrides(payload, best, overrides, FINETUNE_OVERRIDES)
    no_finetune = RUN_KINDS[config.model.backbone].no_finetune
    if no_finetune is not None:
        raise ConfigError(no_finetune.format(run=run.path))
    stage = finetune_stage(config)
    if stage.epochs == 0:
        raise ConfigError("finetune.epochs = 0: nothing to finetune; set --finetune.epochs=N")
    device = resolve_device(config.run.device)
    corpus = _corpus(config)
    _check_same_vocab(run, corpus, best)
    _check_same_corpus(run, corpus, best)
    seed_everything(config.train.seed)
    model = build_model(config, len(corpus.vocab)).to(device)
    load_weights(model, payload["model"], best)
    recipe = build_recipe(config, model, corpus, stage, device)
    best_loss = payload["training"]["progress"]["best_val_loss"]
    progress = Progress(stage="finetune", best_val_loss=best_loss, step=0)
    return Trainer(config, run, stage, recipe, progress, options, len(corpus.vocab))


# ---- facts about a config ---------------------------------------------------------------------


def corpus_vocab_size(config: Config) -> int:
    """Vocabulary size of the corpus at ``config.data.dir`` (read once, then cached); for
    ``seq2seq``, data.subword_vocab_size (SentencePiece learns exactly that many pieces)."""
    return RUN_KINDS[config.model.backbone].vocab_size(config)


def _words_vocab_size(config: Config) -> int:
    return len(_corpus(config).vocab)


# How the word-corpus language models' runs start and continue.
LANGUAGE_MODEL = RunKind(
    name="language-model training",
    start=_train_words,
    resume=_continue_words,
    vocab_size=_words_vocab_size,
)
# model.backbone -> how its runs start and continue.
RUN_KINDS: dict[str, RunKind] = {
    "awd-lstm": LANGUAGE_MODEL,
    "transformer": LANGUAGE_MODEL,
    "seq2seq": TRANSLATION,
}


__all__ = [
    "FINETUNE_OVERRIDES",
    "FINETUNE_RESUME_OVERRIDES",
    "LANGUAGE_MODEL",
    "RECIPES",
    "RESUME_OVERRIDES",
    "RUN_KINDS",
    "build_recipe",
    "check_model_fits",
    "check_own_checkpoint",
    "corpus_vocab_size",
    "finetune",
    "finetune_stage",
    "parameter_count",
    "resume",
    "train",
    "train_stage",
]
