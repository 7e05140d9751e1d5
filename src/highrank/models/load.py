"""The model of a trained run directory: :func:`load_run` builds the model its config describes
(:func:`highrank.models.language_model.build_model`) and loads its checkpoint's weights
(:mod:`highrank.runs` reads the checkpoint and knows no model); :func:`load_run_corpus` opens
its corpus too.
"""

from __future__ import annotations

import os

import torch

from highrank.config import FAMILIES, Config
from highrank.data import Corpus, Vocab
from highrank.data.streaming import open_corpus
from highrank.models.language_model import LanguageModel, build_model
from highrank.runs.checkpoint import CheckpointError, load_weights, read_run


def load_run(
    run_dir: str | os.PathLike,
    which: str = "best",
    *,
    device: str | torch.device = "cpu",
    own_config: Config | None = None,
) -> tuple[LanguageModel, Config, Vocab]:
    """``(model, config, vocab)`` of a run directory, for evaluation.

    Args:
        run_dir: a directory written by ``highrank train``.
        which: ``"best"`` (lowest validation loss; averaged weights after the ASGD switch),
            ``"last"``, ``"finetuned"`` (best of ``highrank finetune``), ``"finetune-last"``,
            or a path to a ``.pt`` file (:func:`highrank.runs.checkpoint.read_run`).
        device: where the model goes.
        own_config: the run's ``config.toml`` when the caller has read it already (it is then
            not read again to check the checkpoint against it).

    Returns the model in eval mode with the checkpoint's evaluation weights; building it does
    not disturb the global torch RNG.
    """
    payload, config, vocab, path = read_run(run_dir, which, own_config=own_config)
    with torch.random.fork_rng(devices=[]):  # initialisation draws; keep the caller's stream
        model = build_model(config, len(vocab))
    load_weights(model, payload["model"], path)
    return model.to(device).eval(), config, vocab


def load_run_corpus(
    run_dir: str | os.PathLike,
    which: str = "best",
    *,
    data_dir: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    own_config: Config | None = None,
) -> tuple[LanguageModel, Config, Corpus]:
    """:func:`load_run` and the run's corpus: its ``data.dir``, or ``data_dir`` when given,
    which must give the vocabulary the run was trained with (a clear error says otherwise)."""
    model, config, vocab = load_run(run_dir, which, device=device, own_config=own_config)
    if FAMILIES[config.model.backbone].parallel_corpus:
        raise CheckpointError(
            f'{run_dir} is a translation run (model.backbone = "{config.model.backbone}"): it '
            "has no word corpus to score, so this verb does not apply; score it with `highrank "
            f"eval {run_dir}` or `highrank translate {run_dir}`"
        )
    corpus = open_corpus(config.data, config.train.seed, directory=data_dir)
    if corpus.vocab.words != vocab.words:
        raise CheckpointError(
            f"the corpus at {corpus.directory} has a different vocabulary than run {run_dir} "
            f"({len(corpus.vocab)} vs {len(vocab)} tokens); pass the run's corpus with --data-dir"
        )
    return model, config, corpus
