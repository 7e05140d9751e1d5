"""Every model family has one line in each registry, and translation's run kind keeps its rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from highrank.config import BACKBONES, FAMILIES, ConfigError, load_config
from highrank.models import MODEL_BUILDERS
from highrank.train.runner import RECIPES, RUN_KINDS, corpus_vocab_size
from highrank.train.seq2seq import TRANSLATION


def test_every_family_is_in_every_registry():
    assert set(BACKBONES) == set(FAMILIES) == set(MODEL_BUILDERS) == set(RECIPES) == set(RUN_KINDS)


def test_translation_trains_in_one_process_and_refuses_finetune_and_init_from():
    assert RUN_KINDS["seq2seq"] is TRANSLATION and not TRANSLATION.torchrun
    assert all(
        RUN_KINDS[f].torchrun and RUN_KINDS[f].no_finetune is None
        for f in ("awd-lstm", "transformer")
    )
    assert TRANSLATION.no_finetune.format(run=Path("/r")).startswith(
        "/r is a translation run: finetune (averaged SGD on a word corpus"
    )
    config = load_config(None, ["model.backbone=seq2seq", "data.subword_vocab_size=123"])
    assert corpus_vocab_size(config) == 123
    with pytest.raises(ConfigError, match="--init-from applies to language models"):
        TRANSLATION.start(config, None, None, None, [], "some-run")


def test_only_the_translation_family_has_a_parallel_corpus():
    assert [f for f, family in FAMILIES.items() if family.parallel_corpus] == ["seq2seq"]
