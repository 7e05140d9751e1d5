"""Fixtures of the Hugging Face integration tests: tiny random GPT-2 (tied embeddings) and
Llama (untied) causal LMs built from configs here, never downloaded, and the highrank heads
attached to them with the small knobs of tests/conftest.py. Skipped without the hf extra."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed: pip install -e '.[hf]'")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network

from tests.conftest import SMALL_KNOBS, STOCHASTIC_KNOBS  # noqa: E402  (after the skip)

VOCAB = 100
HIDDEN = 32


def tiny_gpt2():
    """GPT-2, 2 layers, hidden 32, V = 100; lm_head is the input embedding (tied), no bias."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_embd=HIDDEN, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=64,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def tiny_llama(*, lm_head_bias: bool = False):
    """Llama, 2 layers, hidden 32, V = 100, untied lm_head; ``lm_head_bias`` swaps in an
    lm_head with a (random) bias, as some architectures have."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    if lm_head_bias:
        model.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=True)
    return model


BASES = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def word_tokenizer():
    """A word-level tokenizer over VOCAB ids: <pad> 0, <unk> 1, <eos> 2 (ends a text) and the
    words "w3".."w99" (special tokens must not be words: they are matched inside words),
    built here: the client libraries (TRL, lm-eval, pipeline) need a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>"
    )


@pytest.fixture
def attached():
    """``attached(base, head, stochastic=False, init="paper", **knobs)``: a tiny ``base``
    ("gpt2"/"llama") with the head attached (small knobs; ``stochastic`` switches on its
    dropouts), eval mode. The paper's random init by default: every parameter of the head is
    live from the start, which tests the wrapper hardest (test_warm_start.py tests "base")."""
    from highrank.integrations.hf import attach_head

    def make(base: str, head: str, *, stochastic: bool = False, init: str = "paper", **knobs):
        merged = {**SMALL_KNOBS[head], **(STOCHASTIC_KNOBS.get(head, {}) if stochastic else {})}
        return attach_head(BASES[base](), head, init=init, **{**merged, **knobs}).eval()

    return make


@pytest.fixture
def token_batch():
    """Input ids ``(3, 9)`` and labels with -100 at a padded tail and one inner position."""
    ids = torch.randint(0, VOCAB, (3, 9))
    labels = ids.clone()
    labels[0, 6:] = -100  # a shorter sequence, padded
    labels[2, 3] = -100  # a masked-out prompt token
    return ids, labels
