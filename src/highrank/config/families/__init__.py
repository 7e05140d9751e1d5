"""The model families: ``model.backbone`` picks one, and with it the keys a config may set
beyond those every family reads, their ranges and the family's cross-key checks.

Each family declares these in its own module here (a :class:`~highrank.config.keys.Family`):
:mod:`.awd_lstm`, :mod:`.transformer`, :mod:`.seq2seq` (:mod:`.stream` holds the corpus keys
the two stream language models share). They live in ``highrank.config``, not beside the
backbones, because the config layer must load without torch and below the backbones
(tests/test_layering.py). Growing a family: its module here and one line in :data:`FAMILIES`
(plus the defaults of its new keys in the section dataclasses of
:mod:`highrank.config.schema`).
"""

from __future__ import annotations

from highrank.config.families.awd_lstm import AWD_LSTM
from highrank.config.families.seq2seq import SEQ2SEQ
from highrank.config.families.transformer import TRANSFORMER
from highrank.config.keys import Family

# model.backbone -> its family, in the order the messages list them.
FAMILIES: dict[str, Family] = {
    AWD_LSTM.name: AWD_LSTM,
    SEQ2SEQ.name: SEQ2SEQ,
    TRANSFORMER.name: TRANSFORMER,
}


def key_families(dotted: str) -> tuple[str, ...]:
    """The families that read ``section.key``; () when every family reads it."""
    section, key = dotted.split(".", 1)
    return tuple(name for name, f in FAMILIES.items() if key in f.keys.get(section, ()))


def applies_to(dotted: str, family: str) -> bool:
    """Whether backbone ``family`` reads the key ``section.key``."""
    families = key_families(dotted)
    return not families or family in families


__all__ = ["FAMILIES", "applies_to", "key_families"]
