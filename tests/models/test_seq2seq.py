"""The encoder-decoder Transformer (Vaswani et al. 2017, pre-LN) with any head: shapes, tying
and sharing, padding masks (a padded batch equals its sentences one by one), causal decoder,
incremental decoding equals teacher forcing, bad input."""

from __future__ import annotations

import pytest
import torch

from highrank.heads import HEADS
from highrank.models.seq2seq import TransformerSeq2Seq
from tests.conftest import SMALL_KNOBS

PAD, BOS, EOS = 1, 0, 2  # the ids of highrank.mt.subwords (fairseq's order)
SIZES = {"d_model": 16, "n_heads": 2, "d_ff": 24, "n_encoder_layers": 2, "n_decoder_layers": 2}


def _model(head: str = "softmax", **knobs) -> TransformerSeq2Seq:
    knobs = {**SIZES, "head_knobs": SMALL_KNOBS[head], **knobs}
    return TransformerSeq2Seq(20, 24, pad_id=PAD, head=head, **knobs)


def _sentences(lengths: list[int], vocab: int = 20) -> list[torch.Tensor]:
    return [torch.randint(3, vocab, (n,)) for n in lengths]


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD)


def test_shapes_tying_and_head_wiring():
    model = _model("mos").train()
    src, tgt = torch.randint(3, 20, (3, 5)), torch.randint(3, 24, (3, 4))
    hidden = model(src, tgt)
    assert hidden.shape == (3, 4, 16)
    assert model.head.weight is model.tgt_embedding.weight  # tie_output
    assert model.src_embedding is not model.tgt_embedding
    assert model.head.dropout_time_dim == 1  # batch-first: one mask per sentence
    log_p = model.head.log_prob(hidden)
    assert log_p.shape == (3, 4, 24)
    log_p.sum().backward()
    assert model.src_embedding.weight.grad is not None


def test_shared_embeddings_are_one_matrix_and_need_one_vocabulary():
    shared = TransformerSeq2Seq(24, 24, pad_id=PAD, share_embeddings=True, **SIZES)
    assert shared.src_embedding is shared.tgt_embedding is not None
    assert shared.head.weight is shared.src_embedding.weight
    untied = TransformerSeq2Seq(20, 24, pad_id=PAD, tie_output=False, **SIZES)
    assert untied.head.weight is not untied.tgt_embedding.weight
    with pytest.raises(ValueError, match="share_embeddings needs one joint vocabulary"):
        TransformerSeq2Seq(20, 24, pad_id=PAD, share_embeddings=True, **SIZES)


@pytest.mark.parametrize("positions", ["learned", "sinusoidal", "rotary"])
def test_a_padded_batch_equals_its_sentences_one_by_one(positions):
    model = _model(positions=positions).eval()
    sources, targets = _sentences([5, 2, 4]), _sentences([3, 6, 1], vocab=24)
    memory = model.encode(_pad(sources))
    hidden = model.decode(_pad(targets), memory)  # (3, 6, d)
    for i, (src, tgt) in enumerate(zip(sources, targets, strict=True)):
        alone_memory = model.encode(src[None])
        torch.testing.assert_close(
            memory.states[i, : len(src)], alone_memory.states[0], rtol=0, atol=1e-5
        )
        alone = model.decode(tgt[None], alone_memory)[0]
        torch.testing.assert_close(hidden[i, : len(tgt)], alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("positions", ["learned", "sinusoidal", "rotary"])
def test_incremental_decoding_equals_teacher_forcing(positions):
    model = _model("mixtape", positions=positions).eval()
    src = _pad(_sentences([4, 6]))
    tgt = torch.randint(3, 24, (2, 7))
    memory = model.encode(src)
    full = model.decode(tgt, memory)
    state, steps = model.start_decoding(memory), []
    for t in range(7):
        out, state = model.decode_step(tgt[:, t : t + 1], state)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    assert state.length == 7
    reordered = state.select(torch.tensor([1, 1]))  # beam search's reorder
    assert reordered.cache.layers[0][0].shape[0] == 2
    torch.testing.assert_close(reordered.memory_kv[0][0][0], state.memory_kv[0][0][1])


def test_the_decoder_is_causal_and_the_encoder_is_not():
    model = _model().eval()
    src, tgt = torch.randint(3, 20, (1, 6)), torch.randint(3, 24, (1, 6))
    memory = model.encode(src)
    hidden = model.decode(tgt, memory)
    later = tgt.clone()
    later[0, 4] = (later[0, 4] + 1) % 24
    torch.testing.assert_close(model.decode(later, memory)[0, :4], hidden[0, :4], rtol=0, atol=0)
    changed = src.clone()
    changed[0, 5] = (changed[0, 5] + 1) % 20
    assert not torch.allclose(model.encode(changed).states[0, 0], memory.states[0, 0])


# The heads that read hidden states alone: MFS and CPR also read the sequence's layers and
# tokens, which the decoder does not give them (test_heads_that_read_more_are_refused).
DECODER_HEADS = sorted(name for name in HEADS if HEADS[name].reads == ("hidden",))


def test_heads_that_read_more_are_refused():
    for name in ("mfs", "cpr"):
        with pytest.raises(ValueError, match=rf"head '{name}' reads hidden, layers"):
            _model(name)


@pytest.mark.parametrize("name", DECODER_HEADS)
def test_every_head_ends_the_decoder(name):
    model = _model(name).train()
    src, tgt = _pad(_sentences([4, 2])), torch.randint(3, 24, (2, 3))
    hidden = model(src, tgt)
    log_p = model.head.log_prob(hidden)
    torch.testing.assert_close(log_p.exp().sum(-1), torch.ones(2, 3))
    model.head.loss(hidden, tgt).backward()
    assert model.tgt_embedding.weight.grad is not None


def test_bad_inputs_are_named():
    model = _model()
    with pytest.raises(ValueError, match=r"src rows \[1\] are all padding"):
        model.encode(torch.tensor([[5, 6], [PAD, PAD]]))
    with pytest.raises(ValueError, match=r"expected batch-first \(B, T\)"):
        model.encode(torch.tensor([5, 6]))
    with pytest.raises(TypeError, match="integer ids"):
        model.encode(torch.rand(2, 3))
    with pytest.raises(ValueError, match=r"pad_id must be an id in both vocabularies, \[0, 20\)"):
        TransformerSeq2Seq(20, 24, pad_id=20, **SIZES)
    with pytest.raises(ValueError, match="set by the model"):
        _model("mos", head_knobs={"dropout_time_dim": 0})
    with pytest.raises(TypeError, match="has no knob"):
        _model(head_knobs={"n_components": 3})


# ---- the loss, and a smoke test -----------------------------------------------------------


@pytest.mark.parametrize("name", DECODER_HEADS)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_is_the_smoothed_nll_of_real_target_tokens_in_float64(name, smoothing):
    model = _model(name).eval()
    src = _pad(_sentences([4, 2, 5]))
    targets = _sentences([3, 1, 4], vocab=24)
    tgt_in = _pad([torch.cat([torch.tensor([BOS]), y]) for y in targets])
    tgt_out = _pad([torch.cat([y, torch.tensor([EOS])]) for y in targets])
    loss = model.loss(src, tgt_in, tgt_out, label_smoothing=smoothing)
    with torch.no_grad():
        log_p = model.head.log_prob(model(src, tgt_in)).double()  # (B, T, V)
    real = tgt_out != PAD
    nll = -log_p.gather(-1, tgt_out.clamp(min=0)[..., None])[..., 0]
    smoothed = (1 - smoothing) * nll - smoothing * log_p.mean(-1)  # Szegedy et al. 2016
    expected = smoothed[real].sum() / real.sum()
    assert real.sum() == 3 + 1 + 4 + 3  # every word and each EOS, no padding
    torch.testing.assert_close(loss.double(), expected, rtol=0, atol=1e-5)


def test_shape_mismatch_of_decoder_input_and_target_is_named():
    model = _model()
    with pytest.raises(ValueError, match=r"tgt_out has shape \(2, 3\); expected tgt_in's \(2, 4\)"):
        model.loss(torch.randint(3, 20, (2, 5)), torch.zeros(2, 4).long(), torch.zeros(2, 3).long())


def test_smoke_a_tiny_model_learns_to_reverse_generated_sentences():
    """32 generated pairs (x_1 .. x_n <eos> -> x_n .. x_1 <eos>), 150 Adam steps: the loss
    falls and greedy decoding reproduces the reversals (the training data)."""
    from highrank.models.decoding import greedy_search

    generator = torch.Generator().manual_seed(0)
    pairs = []
    for _ in range(32):
        words = torch.randint(3, 11, (int(torch.randint(2, 6, (1,), generator=generator)),))
        pairs.append((torch.cat([words, torch.tensor([EOS])]), words.flip(0)))
    src = _pad([s for s, _ in pairs])
    tgt_in = _pad([torch.cat([torch.tensor([BOS]), y]) for _, y in pairs])
    tgt_out = _pad([torch.cat([y, torch.tensor([EOS])]) for _, y in pairs])
    model = TransformerSeq2Seq(
        11, 11, pad_id=PAD, d_model=32, n_heads=4, d_ff=64, n_encoder_layers=1,
        n_decoder_layers=1, dropout_input=0.0, dropout_residual=0.0, share_embeddings=True,
    )  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(150):
        loss = model.loss(src, tgt_in, tgt_out, label_smoothing=0.1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]
    hyps = greedy_search(model, src, bos_id=BOS, eos_id=EOS, pad_id=PAD, max_len=8)
    correct = sum(h.tokens == y.tolist() for h, (_, y) in zip(hyps, pairs, strict=True))
    assert correct >= 29, f"{correct} of 32 reversals decoded"
