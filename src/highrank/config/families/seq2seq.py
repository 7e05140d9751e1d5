"""The ``seq2seq`` family's config (the translation model
:class:`highrank.models.seq2seq.TransformerSeq2Seq`, trained by :mod:`highrank.train.seq2seq`,
decoded by :mod:`highrank.models.decoding`): the keys only it reads, their ranges and
cross-checks."""

from __future__ import annotations

from typing import Any

from highrank.config.families.transformer import ADAMW_TRAIN_KEYS, BLOCK_MODEL_KEYS, check_heads
from highrank.config.keys import (
    ANY,
    LANGUAGE,
    NON_NEGATIVE_FINITE,
    POSITIVE,
    PROBABILITY,
    ConfigError,
    Family,
    Show,
    Where,
    one_of,
)


def check_seq2seq(config: Any, where: Where, show: Show) -> None:
    """Cross-key rules of a translation config."""
    data, model = config.data, config.model
    if data.src_lang == data.tgt_lang:
        raise ConfigError(
            f"{where('data.tgt_lang')}: data.tgt_lang = {show(data.tgt_lang)} is also "
            f"data.src_lang; expected two languages"
        )
    check_heads(config, where, show)
    if model.share_embeddings and not data.subword_joint:
        raise ConfigError(
            f"{where('model.share_embeddings')}: model.share_embeddings = true needs "
            f"one joint vocabulary, but data.subword_joint = false; set one of them"
        )


SEQ2SEQ = Family(
    name="seq2seq",
    keys={
        "data": {
            "src_lang": LANGUAGE,
            "tgt_lang": LANGUAGE,
            "subword_type": one_of(("bpe", "unigram")),
            "subword_vocab_size": (lambda v: v > 4, "> 4 (the four special pieces and more)"),
            "subword_joint": ANY,
        },
        "model": {
            "n_encoder_layers": POSITIVE,
            "n_decoder_layers": POSITIVE,
            **BLOCK_MODEL_KEYS,
            "share_embeddings": ANY,
        },
        # the recipe's (highrank.train.seq2seq)
        "train": {"max_tokens": POSITIVE, "label_smoothing": PROBABILITY, **ADAMW_TRAIN_KEYS},
        "decode": {
            "beam_size": POSITIVE,
            "length_penalty": NON_NEGATIVE_FINITE,
            "max_len_a": NON_NEGATIVE_FINITE,
            "max_len_b": POSITIVE,
        },
    },
    check=check_seq2seq,
    parallel_corpus=True,
)

__all__ = ["SEQ2SEQ", "check_seq2seq"]
