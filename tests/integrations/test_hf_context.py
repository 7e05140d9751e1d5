"""Heads that read their context inside transformers models (integrations/hf_context.py):
Multi-Facet Softmax and Softmax-CPR get the body's last layers and the token ids of the
context so far; with the key-value cache, generation sees what a recomputation of the whole
sequence sees (greedy and beam search, padded batches), and a cache the head has not seen is
refused in one line."""

from __future__ import annotations

import pytest
import torch

from .conftest import VOCAB

pytest.importorskip("transformers", reason="the hf extra is not installed")
hf = pytest.importorskip("highrank.integrations.hf", reason="the hf extra is not installed")

HEADS = ["mfs", "cpr"]
GENERATE = {"max_new_tokens": 6, "do_sample": False, "output_scores": True}


def padded_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 7 tokens, the second left-padded by 3, words repeating (C and P act)."""
    ids = torch.randint(3, 20, (2, 7))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


def generate(model, ids, mask, **options):
    out = model.generate(
        ids, attention_mask=mask, return_dict_in_generate=True, **GENERATE, **options
    )
    return out.sequences, torch.stack(out.scores, dim=1)


@pytest.mark.parametrize("base", ["gpt2", "llama"])
@pytest.mark.parametrize("head", HEADS)
def test_greedy_generation_with_the_cache_equals_the_recomputation(attached, base, head):
    model = attached(base, head)
    ids, mask = padded_prompts()
    cached = generate(model, ids, mask, use_cache=True)
    recomputed = generate(model, ids, mask, use_cache=False)
    assert torch.equal(cached[0], recomputed[0])
    torch.testing.assert_close(cached[1], recomputed[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head", HEADS)
def test_a_left_padded_prompt_gets_the_distribution_of_the_prompt_alone(attached, head):
    """Padding reads as positions before the start (hf_context.py): Mi's window and CPR's
    pointer keys see zeros there, not the body's states at the pad tokens. Llama's rotary
    positions make the body's own states the same for both (the softmax's check)."""
    model = attached("llama", head)
    ids, mask = padded_prompts()
    alone = ids[1:, 3:]
    with torch.no_grad():
        padded_out = model(ids[1:], attention_mask=mask[1:]).logits[:, 3:]
        torch.testing.assert_close(padded_out, model(alone).logits, atol=1e-5, rtol=1e-5)
    alone_gen = generate(model, alone, torch.ones_like(alone))
    for cache in ("dynamic", "static"):  # a static cache gives the body a 4-D mask
        padded_gen = generate(model, ids[1:], mask[1:], cache_implementation=cache)
        assert torch.equal(padded_gen[0][:, 3:], alone_gen[0]), cache
        torch.testing.assert_close(padded_gen[1], alone_gen[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head", HEADS)
def test_a_static_cache_without_a_mask_generates_as_the_dynamic_one(attached, head):
    """A new user's walk: ``generate(ids, cache_implementation="static")`` with no mask was
    refused for the 4-D mask that transformers itself made for the body."""
    model = attached("llama", head)
    ids = padded_prompts()[0][:1]
    runs = [model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True,
                           return_dict_in_generate=True, cache_implementation=cache)
            for cache in ("dynamic", "static")]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    torch.testing.assert_close(torch.stack(runs[0].scores), torch.stack(runs[1].scores),
                               atol=1e-5, rtol=1e-5)


def test_masks_that_do_not_say_which_positions_are_padding_are_refused(attached):
    """A 4-D mask, and packed rows (no mask, position ids restarting: TRL's padding-free
    batches), would let MFS/CPR read across what the caller meant to keep apart."""
    model = attached("llama", "cpr")
    ids = torch.randint(3, 20, (1, 6))
    with pytest.raises(ValueError, match=r"^SoftmaxCPR reads which positions are padding from a "
                       r"2-D attention mask .* shape \(1, 1, 6, 6\): pass the 2-D mask$"):
        model(ids, attention_mask=torch.ones(1, 1, 6, 6, dtype=torch.bool))
    packed = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with pytest.raises(ValueError, match=r"these rows pack several sequences .* "
                       r"SFTConfig\(packing=False\)"):
        model(ids, position_ids=packed)
    model(ids, position_ids=torch.arange(6)[None])  # one sequence a row: fine


@pytest.mark.parametrize("head", HEADS)
def test_beam_search_with_the_cache_equals_the_recomputation(attached, head):
    """Beams reorder the cache, and the head's context with it (HighrankForCausalLM's
    _reorder_cache)."""
    model = attached("llama", head)
    ids, mask = padded_prompts()
    options = {"num_beams": 3, "num_return_sequences": 2, "output_scores": False}
    runs = [
        model.generate(
            ids, attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=use_cache,
            return_dict_in_generate=True, **options,
        )
        for use_cache in (True, False)
    ]  # fmt: skip
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    torch.testing.assert_close(runs[0].sequences_scores, runs[1].sequences_scores)


@pytest.mark.parametrize("head", HEADS)
def test_a_step_on_the_returned_cache_continues_the_sequence(attached, head):
    model = attached("gpt2", head)
    ids = torch.randint(3, 20, (2, 6))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        for _ in range(2):  # two steps: the kept context grows with the cache
            step = torch.randint(3, 20, (2, 1))
            got = model(step, **{hf.CACHE: out[hf.CACHE]}, use_cache=True)
            ids = torch.cat([ids, step], dim=1)
            torch.testing.assert_close(got.logits[:, -1], model(ids).logits[:, -1])
            out = got


def test_the_context_reaches_the_partitions(attached):
    """CPR's C and P read the earlier tokens: changing an earlier token changes the last
    position's distribution only through them when the body cannot see it (here: the same
    hidden states are fed to the head, with other context ids)."""
    model = attached("llama", "cpr")
    ids = torch.randint(3, 20, (1, 8))
    with torch.no_grad():
        out = model.model(ids, output_hidden_states=True)
        hidden = out.last_hidden_state
        layers = out.hidden_states[-2:-1] + (hidden,)
        other = ids.clone()
        other[0, 2] = (ids[0, 2] + 1) % VOCAB
        first = model.head.log_prob(hidden, layers=layers, context_ids=ids)
        second = model.head.log_prob(hidden, layers=layers, context_ids=other)
    assert not torch.allclose(first[0, -1], second[0, -1])
    torch.testing.assert_close(first[0, :3], second[0, :3])  # positions up to 2 see no change


def test_a_cache_the_head_has_not_seen_is_refused_in_one_line(attached):
    base = attached("llama", "softmax")
    model = attached("llama", "cpr")
    model.model = base.model  # the same body: the base's cache fits it
    ids = torch.randint(3, 20, (1, 5))
    with torch.no_grad():
        cache = base(ids, use_cache=True)[hf.CACHE]
        with pytest.raises(
            ValueError,
            match=r"^the key-value cache holds 5 positions but "
            r"SoftmaxCPR saw 0 of them",
        ):
            model(torch.randint(3, 20, (1, 1)), **{hf.CACHE: cache})


def test_inputs_embeds_without_ids_are_refused_for_cpr(attached):
    model = attached("gpt2", "cpr")
    embeds = model.get_input_embeddings()(torch.randint(3, 20, (1, 4)))
    with pytest.raises(
        ValueError, match="SoftmaxCPR reads the context's token ids, which inputs_embeds do not "
        "carry: call it \\(or generate\\) with input_ids alone"
    ):
        model(inputs_embeds=embeds)
    attached("gpt2", "mfs")(inputs_embeds=embeds)  # MFS reads layers only


@pytest.mark.parametrize("head", ["softmax", "mos", "mfs"])
def test_generation_from_inputs_embeds_continues_as_from_the_ids(attached, head):
    """A new user's walk: generate(inputs_embeds=...) was refused for every head (the
    wrapper's prepare_inputs_for_generation did not name the argument)."""
    model = attached("llama", head)
    ids = torch.randint(3, 20, (2, 5))
    embeds = model.get_input_embeddings()(ids)
    options = {"max_new_tokens": 4, "do_sample": False}
    from_embeds = model.generate(inputs_embeds=embeds, **options)
    assert torch.equal(from_embeds, model.generate(ids, **options)[:, 5:])


@pytest.mark.parametrize("head", HEADS)
def test_logits_to_keep_and_hidden_states_as_asked(attached, token_batch, head):
    model = attached("gpt2", head)
    ids, _ = token_batch
    with torch.no_grad():
        every = model(ids).logits
        assert model(ids).hidden_states is None  # asked of the body for the head only
        assert len(model(ids, output_hidden_states=True).hidden_states) == 3
        torch.testing.assert_close(model(ids, logits_to_keep=2).logits, every[:, -2:])
        positions = torch.tensor([0, 4])
        torch.testing.assert_close(model(ids, logits_to_keep=positions).logits, every[:, positions])


@pytest.mark.parametrize("head", HEADS)
def test_more_layers_than_the_body_gives_is_refused_when_attached(head):
    """A new user's walk: the default input_layers = 3 on a 1-block model was accepted, and
    the first forward failed without saying what to change."""
    from .conftest import tiny_llama

    base = tiny_llama()  # 2 blocks: 3 hidden states
    with pytest.raises(ValueError, match=r"reads the last 4 layers but this model gives 3 \(its "
                       r"embeddings' output and each of its 2 blocks'\): pass input_layers=3 "
                       r"or fewer$"):
        hf.attach_head(base, head, input_layers=4)
    assert hf.attach_head(base, head, input_layers=3).head.input_layers == 3


@pytest.mark.parametrize("head", HEADS)
def test_no_position_reads_a_later_token_in_the_forward_or_in_generate(attached, head):
    """Leak guard for ``attach_head`` (hf.py, hf_context.py): the full forward's row t must
    not move when any token after t (its target t + 1 included) changes; the changed token
    moves its own row (the check can fail). And ``generate`` with the key-value cache, which
    cannot see the future, scores each step as the full forward of the final sequence does:
    the kept context (layers, ids) is aligned with the positions it stands for."""
    model = attached("llama", head)  # the paper's random init: C, P and Mi all act
    ids = torch.randint(3, 20, (2, 10))  # words repeat
    with torch.no_grad():
        full = model(ids).logits
        for p in (1, 4, 9):
            later = ids.clone()
            later[:, p:] = ids[:, p:] % 17 + 3  # other words from p on
            other = model(later).logits
            torch.testing.assert_close(other[:, :p], full[:, :p], atol=1e-6, rtol=0)
            assert not torch.allclose(other[:, p], full[:, p], atol=1e-4)
    out = model.generate(ids[:, :5], max_new_tokens=5, do_sample=False, use_cache=True,
                         output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        rows = model(out.sequences).logits[:, 4:-1]  # the rows that chose tokens 5..9
    torch.testing.assert_close(torch.stack(out.logits, dim=1), rows, atol=1e-5, rtol=1e-5)
