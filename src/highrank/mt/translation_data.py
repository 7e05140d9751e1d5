"""A translation run's data: its parallel corpus and its subword vocabulary.

A translation run (``model.backbone = "seq2seq"``) keeps, besides what every run keeps
(:mod:`highrank.runs.run_dir`), its subword vocabulary under ``RUN_DIR/subwords/``
(:mod:`highrank.mt.subwords`: learned on the train split only when the run starts, reloaded on
resume and for decoding) and, as ``vocab.json``, the target pieces in id order. The training
recipe (:mod:`highrank.train.seq2seq`) reads its data here, and so does decoding a trained run
(:mod:`highrank.evaluate.translation`).

Needs the optional extra ``mt`` (sentencepiece) when used; importing it does not.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from highrank.config import Config
from highrank.data import Vocab
from highrank.mt.bitext import Bitext, EncodedPairs, SpecialIds, encode_pairs, load_bitext
from highrank.mt.subwords import SubwordError, Subwords, SubwordSettings, learn_subwords


def subword_settings(config: Config) -> SubwordSettings:
    """The ``data.subword_*`` keys as :class:`SubwordSettings`."""
    d = config.data
    return SubwordSettings(
        model_type=d.subword_type, vocab_size=d.subword_vocab_size, joint=d.subword_joint
    )


@dataclass
class TranslationData:
    """A parallel corpus and the run's subwords; splits encoded on first use."""

    bitext: Bitext
    subwords: Subwords
    _pairs: dict[str, EncodedPairs] = field(default_factory=dict)

    @property
    def special(self) -> SpecialIds:
        return self.subwords.special_ids()

    @property
    def vocab_sizes(self) -> tuple[int, int]:
        """(source, target) vocabulary sizes."""
        return len(self.subwords.src), len(self.subwords.tgt)

    def target_vocab(self) -> Vocab:
        """The target pieces in id order (the run's ``vocab.json``)."""
        tgt = self.subwords.tgt
        return Vocab(tgt.piece(i) for i in range(len(tgt)))

    def pairs(self, split: str) -> EncodedPairs:
        if split not in self._pairs:
            sw = self.subwords
            self._pairs[split] = encode_pairs(
                self.bitext.split(split), sw.src.encode_lines, sw.tgt.encode_lines
            )
        return self._pairs[split]


def read_bitext(config: Config, splits: tuple[str, ...], data_dir: str | None = None) -> Bitext:
    d = config.data
    return load_bitext(data_dir or d.dir, d.src_lang, d.tgt_lang, splits=splits)


def learn_translation_data(config: Config) -> TranslationData:
    """Train and valid read; the subword vocabulary learned on train only (not yet saved)."""
    bitext = read_bitext(config, ("train", "valid"))
    train = bitext.split("train")
    print(
        f"learning the subword vocabulary on {len(train):,} training pairs (SentencePiece; "
        "up to a minute on a CPU) ...",
        file=sys.stderr,
        flush=True,
    )
    subwords = learn_subwords(
        train.src,
        train.tgt,
        subword_settings(config),
        src_lang=config.data.src_lang,
        tgt_lang=config.data.tgt_lang,
    )
    return TranslationData(bitext, subwords)


def load_subwords(run_dir: str | os.PathLike, config: Config) -> Subwords:
    """The run's saved vocabulary, checked against the config's languages and settings."""
    subwords = Subwords.load(run_dir)
    wanted = (subword_settings(config), config.data.src_lang, config.data.tgt_lang)
    if (subwords.settings, subwords.src_lang, subwords.tgt_lang) != wanted:
        raise SubwordError(
            f"{Path(run_dir) / 'subwords'} holds a {subwords.src_lang}->{subwords.tgt_lang} "
            f"vocabulary for {subwords.settings}, but the run's config says "
            f"{wanted[1]}->{wanted[2]} with {wanted[0]}; the files are from different runs"
        )
    return subwords


def saved_translation_data(
    run_dir: str | os.PathLike, config: Config, splits: tuple[str, ...], data_dir=None
) -> TranslationData:
    """``splits`` of the corpus with the vocabulary saved in ``run_dir``."""
    return TranslationData(read_bitext(config, splits, data_dir), load_subwords(run_dir, config))


__all__ = [
    "TranslationData",
    "learn_translation_data",
    "load_subwords",
    "read_bitext",
    "saved_translation_data",
    "subword_settings",
]
