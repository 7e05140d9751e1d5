"""Generation penalties (issue 21, item 4): logits processors such as repetition_penalty are
defined on raw logits. Heads with raw logits (softmax; the transformed logits of SigSoftmax,
GSS, PLIF) must generate exactly the base model's tokens when warm-started; mixtures hand
over log-probabilities, and the penalty then means p -> p**theta (tested by hand)."""

from __future__ import annotations

import pytest
import torch

from .conftest import BASES, VOCAB

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
hf = pytest.importorskip("highrank.integrations.hf", reason="the hf extra is not installed")

PROMPT_LENGTH, NEW_TOKENS = 4, 12
EOS = 7


def greedy(model, ids: torch.Tensor, **options) -> torch.Tensor:
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
        min_new_tokens=0, **options,
    )  # fmt: skip


def prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, PROMPT_LENGTH))


@pytest.mark.parametrize("head", ["softmax", "gss", "plif"])
@pytest.mark.parametrize("base_name", sorted(BASES))
def test_warm_started_heads_with_logits_generate_the_base_models_tokens(base_name, head):
    base = BASES[base_name]().eval()
    ids = prompt()
    expected = greedy(base, ids, repetition_penalty=1.5)
    # The penalty must matter here, or equality would prove nothing.
    assert not torch.equal(expected, greedy(base, ids))
    model = hf.attach_head(base, head).eval()  # init="base": starts at the base's distribution
    assert torch.equal(greedy(model, ids, repetition_penalty=1.5), expected)


@pytest.mark.parametrize("base_name", sorted(BASES))
def test_the_softmax_head_follows_the_exponential_decay_length_penalty_of_the_base(base_name):
    base = BASES[base_name]().eval()
    ids = prompt()
    options = {"eos_token_id": EOS, "pad_token_id": 0}
    penalty = {"exponential_decay_length_penalty": (2, 1.6), **options}
    expected = greedy(base, ids, **penalty)
    assert not torch.equal(expected, greedy(base, ids, **options))  # it ends sequences early
    model = hf.attach_head(base, "softmax").eval()
    assert torch.equal(greedy(model, ids, **penalty), expected)


def penalised_greedy_by_hand(scores_of, ids: torch.Tensor, theta: float) -> torch.Tensor:
    """Greedy decoding where ``scores_of(ids)`` gives the last position's scores (B, V) and
    every token already in a sequence gets s * theta (s < 0) or s / theta (s >= 0)."""
    for _ in range(NEW_TOKENS):
        with torch.no_grad():
            scores = scores_of(ids).clone()
        seen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ids, True)
        penalised = torch.where(scores < 0, scores * theta, scores / theta)
        scores = torch.where(seen, penalised, scores)
        ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("head", ["mos", "moc", "mixtape", "mlp_softmax"])
def test_on_log_probabilities_the_repetition_penalty_raises_p_to_the_power_theta(attached, head):
    """Mixtures have no raw logits: the penalty multiplies a seen token's log p <= 0 by theta."""
    model = attached("llama", head)
    ids = prompt()
    got = greedy(model, ids, repetition_penalty=1.5)
    assert not torch.equal(got, greedy(model, ids))
    expected = penalised_greedy_by_hand(lambda x: model(x).logits[:, -1], ids, 1.5)
    assert torch.equal(got, expected)


def test_sigsoftmax_penalises_its_transformed_logits(attached):
    """SigSoftmax (paper init: it has no warm start) hands over f(z) = z + log sigmoid(z)."""
    model = attached("gpt2", "sigsoftmax")
    ids = prompt()
    got = greedy(model, ids, repetition_penalty=1.5)
    assert not torch.equal(got, greedy(model, ids))

    def transformed(x):
        hidden = model.model(x).last_hidden_state[:, -1]
        return model.head.transformed_logits(hidden)

    assert torch.equal(got, penalised_greedy_by_hand(transformed, ids, 1.5))
    # and they are not its log-probabilities, on which the penalty would act otherwise
    assert not torch.allclose(transformed(ids), model(ids).logits[:, -1])


def test_forward_outside_generate_still_returns_log_probabilities(attached):
    model = attached("llama", "softmax")
    ids = prompt()
    with torch.no_grad():
        log_probs = model(ids).logits
    torch.testing.assert_close(log_probs.logsumexp(-1), torch.zeros(ids.shape))


def test_on_log_probabilities_the_length_penalty_raises_eos_to_a_shrinking_power(attached):
    """exponential_decay_length_penalty=(start, r) after start + i new tokens: EOS's
    log p becomes log p + |log p| (r**i - 1) = log p (2 - r**i), i.e. p -> p**(2 - r**i)."""
    model = attached("llama", "mos")
    ids = prompt()[:1]
    start, factor = 2, 1.6
    options = {"eos_token_id": EOS, "pad_token_id": 0}
    got = greedy(model, ids, exponential_decay_length_penalty=(start, factor), **options)
    assert not torch.equal(got, greedy(model, ids, **options))  # it ends the text early
    expected = ids
    for _ in range(NEW_TOKENS):
        with torch.no_grad():
            scores = model(expected).logits[:, -1].clone()
        steps = expected.shape[1] - (PROMPT_LENGTH + start)
        if steps > 0:
            scores[:, EOS] = scores[:, EOS] * (2 - factor**steps)  # log p <= 0
        expected = torch.cat([expected, scores.argmax(-1, keepdim=True)], dim=1)
        if int(expected[0, -1]) == EOS:
            break
    assert torch.equal(got, expected)
