"""``evaluate_run``: a trained run's perplexity on a split, as the record ``highrank eval`` keeps.

    from highrank.evaluate import evaluate_run

    record = evaluate_run("runs/ptb-mos", split="test", which="best")
    record["perplexity"], record["tokens"], record["checkpoint_sha256"], ...

The record is the dict ``highrank eval`` writes to ``RUN_DIR/eval-<split>-<which>...json``
(:func:`record_file`; its facts: :mod:`highrank.evaluate.records`). The run's ``config.toml``
is read once: it checks the checkpoint, and its ``data.dir`` says whether the corpus scored is
the run's own. Nothing is written but the per-token NLL file when one is asked for; the command
line writes the record and prints its summary. A translation run's figure is BLEU
(:func:`highrank.evaluate.translation.evaluate_bleu`, ``highrank eval`` / ``translate``).

:func:`load_for_eval`, :func:`split_tokens` and :func:`eval_record` are the pieces, shared
with ``highrank dynamic-eval``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from highrank.config import FAMILIES, Config, ConfigError, load_config
from highrank.data.chars import bits_per_char
from highrank.data.streaming import split_stream
from highrank.evaluate.perplexity import (
    check_segment_length,
    default_bptt,
    evaluate_perplexity,
    write_token_nll,
)
from highrank.evaluate.records import data_facts, record_path
from highrank.evaluate.scoring import EvalResult
from highrank.models import LanguageModel, load_run_corpus
from highrank.runs.checkpoint import CONFIG_FILE, CheckpointError
from highrank.util.checks import check_positive_int
from highrank.util.denormals import flush_denormals

SPLITS = ("valid", "test")


class LoadedRun(NamedTuple):
    """A run ready to score: its model (eval mode), the checkpoint's config, the corpus, and
    the run's own ``config.toml`` (read once)."""

    model: LanguageModel
    config: Config
    corpus: Any  # a data.Corpus or a data.streaming.StreamCorpus
    own_config: Config


def run_config(run_dir: str | os.PathLike) -> Config | None:
    """The run's ``config.toml``, or None when it cannot be read (then reading the run's
    checkpoint says what is wrong, or the record's facts do)."""
    try:
        return load_config(Path(run_dir) / CONFIG_FILE)
    except ConfigError:
        return None


def is_translation_run(own_config: Config | None) -> bool:
    """Whether a run's config (:func:`run_config`) is of a translation family (seq2seq)."""
    return own_config is not None and FAMILIES[own_config.model.backbone].parallel_corpus


def load_for_eval(
    run_dir: str | os.PathLike,
    which: str = "best",
    *,
    data_dir: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    own_config: Config | None = None,
) -> LoadedRun:
    """The run's model, config and corpus, checked against the run's vocabulary
    (:func:`highrank.models.load_run_corpus`); ``own_config``: its ``config.toml`` when read
    already. An unreadable ``config.toml`` is its ConfigError, raised before any scoring."""
    if own_config is None:
        own_config = run_config(run_dir)
    model, config, corpus = load_run_corpus(
        run_dir, which, data_dir=data_dir, device=device, own_config=own_config
    )
    if own_config is None:  # the checkpoint's checks passed without it: say why it is unread
        own_config = load_config(Path(run_dir) / CONFIG_FILE)
    return LoadedRun(model, config, corpus, own_config)


def split_tokens(corpus, split: str, max_tokens: int | None = None):
    """The split's token ids, the first ``max_tokens`` of them when given: a memory map for a
    ``data.memmap`` run (:func:`highrank.data.streaming.split_stream`; read a segment at a
    time)."""
    ids = split_stream(corpus, split)
    return ids if max_tokens is None else ids[:max_tokens]


def eval_record(
    loaded: LoadedRun,
    run_dir: str | os.PathLike,
    which: str,
    split: str,
    result: EvalResult,
    extra: dict[str, Any],
    *,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """The record of ``result``: the split, the checkpoint, what the figure was computed from
    (:func:`highrank.evaluate.records.data_facts`), loss, perplexity, tokens, then ``extra``
    (the settings) and, for a character-level run, its bits per character."""
    corpus = loaded.corpus
    facts = data_facts(
        run_dir, which, split, corpus, max_tokens=max_tokens, own_config=loaded.own_config
    )
    if corpus.mode == "char":  # <eos> counted: it stands for a newline
        extra = {**extra, "bits_per_char": bits_per_char(result.loss, 1)}
    if max_tokens is not None:  # N tokens read; "tokens" counts those scored (a column's first
        # token has no prediction: N - 1 with one column)
        extra = {**extra, "tokens_read": min(max_tokens, len(split_stream(corpus, split)))}
    return {
        "split": split,
        "checkpoint": which,
        **facts,
        "loss": result.loss,
        "perplexity": result.perplexity,
        "tokens": result.tokens,
        **extra,
    }


def record_file(run_dir: str | os.PathLike, record: dict[str, Any], kind: str = "eval") -> Path:
    """Where ``highrank eval`` (``kind="eval"``) or ``dynamic-eval`` keeps ``record``:
    ``RUN_DIR/<kind>-<split>-<which>[-data<hash>][-first<N>].json``."""
    return record_path(run_dir, kind, record["split"], record["checkpoint"], record)


@flush_denormals()
def evaluate_run(
    run_dir: str | os.PathLike,
    split: str = "test",
    which: str = "best",
    *,
    data_dir: str | os.PathLike | None = None,
    max_tokens: int | None = None,
    batch_size: int | None = None,
    bptt: int | None = None,
    token_nll: str | os.PathLike | None = None,
    progress: bool = False,
    device: str | torch.device = "cpu",
    own_config: Config | None = None,
) -> dict[str, Any]:
    """Perplexity of checkpoint ``which`` of a language-model run on ``split``, the hidden
    state carried across segments: the record ``highrank eval`` writes (not written here).

    Args:
        run_dir: a directory written by ``highrank train``.
        split: ``"valid"`` or ``"test"``.
        which: ``"best"``, ``"last"``, ``"finetuned"``, ``"finetune-last"`` or a ``.pt`` path.
        data_dir: another corpus folder with the run's vocabulary (default: its ``data.dir``;
            the record then gets its own name).
        max_tokens: read only the first N tokens of the split (recorded under its own name,
            never as the split's figure); a column's first token has no prediction, so the
            record's ``tokens`` (scored) is N - 1 with one column, ``(N // B - 1) x B`` with
            B, and its ``tokens_read`` is N.
        batch_size: columns (default: the run's ``train.eval_batch_size`` for valid,
            ``train.test_batch_size`` for test).
        bptt: segment length (default: :func:`highrank.evaluate.perplexity.default_bptt`).
        token_nll: also write the per-token NLL to this ``.tsv`` or ``.npy`` file.
        progress: show a progress bar.
        device: where the model runs.
        own_config: the run's ``config.toml`` when the caller has read it (:func:`run_config`).

    Bad input raises what ``highrank eval`` reports: a CheckpointError for a missing run or
    checkpoint, a ConfigError for a segment longer than a Transformer's positions, ...
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
    for name, value in (("max_tokens", max_tokens), ("batch_size", batch_size), ("bptt", bptt)):
        if value is not None:
            check_positive_int(name, value)
    if own_config is None:
        own_config = run_config(run_dir)
    if is_translation_run(own_config):
        raise CheckpointError(
            f"{run_dir} is a translation run: its figure is BLEU "
            f"(highrank.evaluate.translation.evaluate_bleu, `highrank eval {run_dir}`)"
        )
    loaded = load_for_eval(
        run_dir, which, data_dir=data_dir, device=device, own_config=own_config
    )
    config, corpus = loaded.config, loaded.corpus
    default_batch = {"valid": config.train.eval_batch_size, "test": config.train.test_batch_size}
    batch_size = batch_size or default_batch[split]
    bptt = check_segment_length(config, bptt or default_bptt(config))
    result = evaluate_perplexity(
        loaded.model,
        split_tokens(corpus, split, max_tokens),
        batch_size=batch_size,
        bptt=bptt,
        progress=progress,
        return_token_nll=token_nll is not None,
        name=str(corpus.path(split)),
    )
    if token_nll is not None:
        write_token_nll(token_nll, result, corpus.vocab)
    extra = {"batch_size": batch_size, "bptt": bptt}
    return eval_record(loaded, run_dir, which, split, result, extra, max_tokens=max_tokens)


__all__ = [
    "LoadedRun",
    "SPLITS",
    "eval_record",
    "evaluate_run",
    "is_translation_run",
    "load_for_eval",
    "record_file",
    "run_config",
    "split_tokens",
]
