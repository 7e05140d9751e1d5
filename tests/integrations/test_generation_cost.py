"""Greedy generation computes each head's full distribution once per generated token (issue
19, item 3): the decoder matrix E (V x d) is multiplied with exactly the rows one
``head.log_prob`` of one position multiplies (K contexts for MoS, 4 for Mixtape), once per
new token and sequence; the prompt's other positions and a second scoring pass cost nothing."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.conftest import SMALL_KNOBS

from .conftest import HIDDEN, VOCAB

pytest.importorskip("transformers", reason="the hf extra is not installed")

MATMULS = ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul")


class DecoderProducts(TorchDispatchMode):
    """Counts the output values of every matrix product one of whose operands is (a view of)
    ``weight``: V per row multiplied with E, whatever the layout (x E^T or E x^T)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.storage = weight.untyped_storage().data_ptr()
        self.values = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in MATMULS and any(
            isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.storage
            for a in args
        ):
            self.values += out.numel()
        return out


def decoder_values(model, run) -> int:
    with torch.no_grad(), DecoderProducts(model.head.weight) as counter:
        run()
    return counter.values


@pytest.mark.parametrize("head", sorted(SMALL_KNOBS))
@pytest.mark.parametrize("base", ["gpt2", "llama"])
def test_greedy_generate_runs_the_decoder_once_per_new_token(attached, base, head):
    model = attached(base, head)
    one_position = decoder_values(model, lambda: model.head.log_prob(torch.randn(1, HIDDEN)))
    assert one_position >= VOCAB  # the counter sees the decoder product at all
    batch, prompt_length, new_tokens = 2, 6, 5
    ids = torch.randint(3, VOCAB, (batch, prompt_length))
    values = decoder_values(model, lambda: model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False,
    ))  # fmt: skip
    assert values == batch * new_tokens * one_position
