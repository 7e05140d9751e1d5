"""New tokens (issue 21, item 5): resize_token_embeddings on a model with a highrank head
resizes every V-shaped tensor of the head as transformers resizes an lm_head, keeps the tie,
and updates both configs; forward, generate and save/reload then work, for every head."""

from __future__ import annotations

import pytest
import torch

from highrank.heads import HEADS

from .conftest import BASES, VOCAB

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
hf = pytest.importorskip("highrank.integrations.hf", reason="the hf extra is not installed")

ALL = [(base, head) for head in HEADS for base in BASES]
NEW = 117  # 17 tokens added; not a round number, so Mixtape's fraction must be exact


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(("base", "head"), ALL)
def test_new_tokens_resize_the_head_and_survive_save_and_reload(attached, tmp_path, base, head):
    model = attached(base, head)
    before = snapshot(model)
    ids = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        old_log_probs = model(ids).logits
    model.resize_token_embeddings(NEW)

    assert model.config.vocab_size == model.config.base_config.vocab_size == NEW
    assert model.head.vocab_size == NEW and model.get_input_embeddings().weight.shape[0] == NEW
    tied = model.config.tie_word_embeddings
    assert (model.head.weight is model.get_input_embeddings().weight) == tied == (base == "gpt2")
    for name, parameter in model.named_parameters():  # old rows kept, nothing else changed
        old = before[name]
        if parameter.shape != old.shape:
            assert parameter.shape[0] == NEW and old.shape[0] == VOCAB, name
            torch.testing.assert_close(parameter[:VOCAB], old, rtol=0, atol=0, msg=name)
            assert torch.isfinite(parameter).all(), name
        else:
            assert torch.equal(parameter, old), name

    new_ids = torch.cat([ids, torch.tensor([[NEW - 1], [VOCAB]])], dim=1)  # two new tokens
    with torch.no_grad():
        log_probs = model(new_ids).logits
    assert log_probs.shape == (2, 7, NEW)
    torch.testing.assert_close(log_probs.logsumexp(-1), torch.zeros(2, 7))
    if head == "softmax":  # new tokens' logits join the softmax; old ratios are unchanged
        shift = old_log_probs - log_probs[:, :6, :VOCAB]
        torch.testing.assert_close(shift, shift[..., :1].expand_as(shift))
    generated = model.generate(
        new_ids, attention_mask=torch.ones_like(new_ids), max_new_tokens=3, do_sample=False
    )
    assert generated.shape == (2, 10) and int(generated.max()) < NEW
    labels = new_ids.clone()
    assert torch.isfinite(model(new_ids, labels=labels).loss)

    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.vocab_size == NEW and reloaded.head.vocab_size == NEW
    assert (reloaded.head.weight is reloaded.get_input_embeddings().weight) == tied
    with torch.no_grad():
        assert torch.equal(reloaded(new_ids).logits, log_probs)


def test_new_rows_are_drawn_as_transformers_draws_a_new_lm_heads(attached):
    """Mean resizing: new decoder rows and bias entries sit at the old rows' mean."""
    base = BASES["llama"]()
    base.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    model = hf.attach_head(base, "mos", n_components=2).eval()
    old_weight, old_bias = model.head.weight.detach().clone(), model.head.bias.detach().clone()
    model.resize_token_embeddings(NEW)
    added = model.head.weight[VOCAB:].detach()
    torch.testing.assert_close(added, old_weight.mean(0).expand_as(added), atol=1e-3, rtol=0)
    torch.testing.assert_close(
        model.head.bias[VOCAB:].detach(), old_bias.mean().expand(NEW - VOCAB)
    )
    # mean_resizing=False: the body's own init (normal, std initializer_range), zero bias
    model.resize_token_embeddings(NEW + 40, mean_resizing=False)
    fresh = model.head.weight[NEW:].detach()
    assert 0.5 * 0.02 < float(fresh.std()) < 1.5 * 0.02
    assert torch.equal(model.head.bias[NEW:].detach(), torch.zeros(40))


def test_mixtape_keeps_its_trained_gates_for_the_same_tokens(attached, tmp_path):
    model = attached("llama", "mixtape")  # frequent_fraction 0.3: S = 30 ids with own gates
    gates = model.head.token_gate.detach().clone()
    model.resize_token_embeddings(NEW)
    assert model.head.n_frequent == 30 and torch.equal(model.head.token_gate, gates)
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.head.n_frequent == 30
    model.resize_token_embeddings(20)  # below S: the gates of the ids that remain
    assert model.head.n_frequent == 20 and torch.equal(model.head.token_gate, gates[:20])
    assert model.config.head_knobs["frequent_fraction"] == 1.0


def test_pad_to_multiple_of_and_shrinking(attached):
    model = attached("gpt2", "mixtape")
    model.resize_token_embeddings(NEW, pad_to_multiple_of=16)
    assert model.config.vocab_size == model.head.vocab_size == 128
    model.resize_token_embeddings(64)
    assert model.head.weight.shape == (64, 32) and model.head.bias.shape == (64,)
    with torch.no_grad():
        assert model(torch.randint(0, 64, (1, 5))).logits.shape == (1, 5, 64)
