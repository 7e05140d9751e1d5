"""Greedy generation computes each head's full distribution once per generated token (issue
19, item 3): the decoder matrix E (V x d) is multiplied with exactly the rows one
``head.log_prob`` of one position multiplies (K contexts for MoS, 4 for Mixtape), once per
new token and sequence; the prompt's other positions and a second scoring pass cost nothing."""

from __future__ import annotations

import pytest
import torch

from benchmarks.heads.generate_speed import decoder_products_class
from tests.conftest import SMALL_KNOBS, head_inputs

from .conftest import HIDDEN, VOCAB

pytest.importorskip("transformers", reason="the hf extra is not installed")

# the counter the generate() benchmark records with (counts values of products with E)
DecoderProducts = decoder_products_class()


def decoder_values(model, run) -> int:
    with torch.no_grad(), DecoderProducts(model.head.weight) as counter:
        run()
    return counter.values


@pytest.mark.parametrize("head", sorted(SMALL_KNOBS))
@pytest.mark.parametrize("base", ["gpt2", "llama"])
def test_greedy_generate_runs_the_decoder_once_per_new_token(attached, base, head):
    model = attached(base, head)
    row = torch.randn(1, 1, HIDDEN)  # (B, T, d); MFS, CPR: with the layers and ids they read
    one_position = decoder_values(
        model, lambda: model.head.log_prob(row, **head_inputs(model.head, row))
    )
    assert one_position >= VOCAB  # the counter sees the decoder product at all
    batch, prompt_length, new_tokens = 2, 6, 5
    ids = torch.randint(3, VOCAB, (batch, prompt_length))
    values = decoder_values(model, lambda: model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False,
    ))  # fmt: skip
    assert values == batch * new_tokens * one_position
