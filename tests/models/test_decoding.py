"""Greedy and beam search (highrank.models.decoding) on tiny encoder-decoder Transformers: beam
1 is greedy for every head, an exhaustive beam finds what brute-force enumeration finds under the
GNMT length penalty, scores are the teacher-forced log-probabilities, a padded batch decodes as
its sentences one by one, and the EOS/pad/BOS and max_len rules hold."""

from __future__ import annotations

import itertools

import pytest
import torch

from highrank.heads import HEADS
from highrank.models.decoding import beam_search, greedy_search, length_penalty
from highrank.models.seq2seq import TransformerSeq2Seq
from tests.conftest import SMALL_KNOBS

BOS, PAD, EOS = 0, 1, 2  # highrank.mt.subwords' ids (fairseq's order)
IDS = {"bos_id": BOS, "eos_id": EOS, "pad_id": PAD}
SIZES = {"d_model": 16, "n_heads": 2, "d_ff": 24, "n_encoder_layers": 1, "n_decoder_layers": 2}


def _model(head: str = "softmax", tgt_vocab: int = 12, **knobs) -> TransformerSeq2Seq:
    model = TransformerSeq2Seq(
        10, tgt_vocab, pad_id=PAD, head=head, head_knobs=SMALL_KNOBS[head], **SIZES, **knobs
    )
    return model.eval()


def _sources(lengths: list[int]) -> torch.Tensor:
    rows = [torch.randint(3, 10, (n,)) for n in lengths]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD)


def _teacher_forced_log_prob(model, src_row: torch.Tensor, tokens: list[int]) -> float:
    """log P(tokens + EOS | src) from one full (non-incremental) decoder pass, in float64."""
    target = torch.tensor([*tokens, EOS])
    tgt_in = torch.tensor([[BOS, *tokens]])
    with torch.no_grad():
        hidden = model.decode(tgt_in, model.encode(src_row[None]))
        log_p = model.head.log_prob(hidden)[0].double()  # (T, V)
    return float(log_p.gather(1, target[:, None]).sum())


# ---- beam 1 is greedy ---------------------------------------------------------------------


# the heads the translation decoder takes (MFS and CPR read more: tests/models/test_seq2seq)
@pytest.mark.parametrize("name", sorted(n for n in HEADS if HEADS[n].reads == ("hidden",)))
def test_beam_of_one_equals_greedy_for_every_head(name):
    model = _model(name)
    src = _sources([5, 3, 7, 1])
    greedy = greedy_search(model, src, max_len=9, **IDS)
    for alpha in (0.0, 0.6, 2.0):
        beams = beam_search(model, src, beam_size=1, length_penalty_alpha=alpha, max_len=9, **IDS)
        for g, b in zip(greedy, beams, strict=True):
            assert len(b) == 1
            assert b[0].tokens == g.tokens
            assert b[0].log_prob == pytest.approx(g.log_prob, abs=1e-5)


def test_scores_are_teacher_forced_log_probs_with_the_gnmt_penalty():
    model = _model("mixtape")
    src = _sources([4, 6, 2])
    for hyp, row in zip(greedy_search(model, src, max_len=8, **IDS), src, strict=True):
        assert hyp.log_prob == pytest.approx(
            _teacher_forced_log_prob(model, row, hyp.tokens), abs=1e-5
        )
        assert hyp.score == hyp.log_prob
    for hyps, row in zip(beam_search(model, src, beam_size=3, max_len=8, **IDS), src, strict=True):
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        for h in hyps:
            expected = _teacher_forced_log_prob(model, row, h.tokens)
            assert h.log_prob == pytest.approx(expected, abs=1e-5)
            lp = ((5 + len(h.tokens) + 1) / 6) ** 0.6  # GNMT eq. 14, |y| with EOS
            assert h.score == pytest.approx(h.log_prob / lp, rel=1e-12)


def test_length_penalty_closed_form():
    assert length_penalty(1, 0.6) == 1.0  # (5 + 1) / 6
    assert length_penalty(7, 0.0) == 1.0
    assert length_penalty(7, 0.6) == pytest.approx(2.0**0.6)
    assert length_penalty(19, 1.0) == pytest.approx(4.0)


# ---- exhaustive beam = brute force --------------------------------------------------------

WORDS = (3, 4, 5)  # the tiny target vocabulary: BOS, PAD, EOS and three words
MAX_LEN = 4  # hypotheses of 1..4 tokens, EOS included: 1 + 3 + 9 + 27 = 40


def _all_hypotheses() -> list[list[int]]:
    return [list(w) for n in range(MAX_LEN) for w in itertools.product(WORDS, repeat=n)]


@pytest.fixture(scope="module")
def tiny_search():
    """A tiny model, one source sentence, and the log-probability of every hypothesis."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before conftest's one-thread fixture
    torch.manual_seed(3)
    model = _model(tgt_vocab=6)
    src = _sources([5])
    log_probs = {tuple(y): _teacher_forced_log_prob(model, src[0], y) for y in _all_hypotheses()}
    torch.set_num_threads(threads)
    return model, src, log_probs


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_an_exhaustive_beam_finds_the_brute_force_ranking(tiny_search, alpha):
    model, src, log_probs = tiny_search
    assert len(log_probs) == 40
    # 64 beams hold every prefix (at most 27 live), so nothing is pruned.
    (found,) = beam_search(
        model, src, beam_size=64, length_penalty_alpha=alpha, max_len=MAX_LEN, **IDS
    )
    expected = sorted(
        ((lp / length_penalty(len(y) + 1, alpha), list(y)) for y, lp in log_probs.items()),
        reverse=True,
    )
    assert len(found) == 40
    assert found[0].tokens == expected[0][1]
    assert sorted(tuple(h.tokens) for h in found) == sorted(log_probs)  # every hypothesis
    for hyp, (score, _) in zip(found, expected, strict=True):
        assert hyp.score == pytest.approx(score, abs=1e-5)
        assert hyp.log_prob == pytest.approx(log_probs[tuple(hyp.tokens)], abs=1e-5)


def test_a_larger_length_penalty_never_prefers_a_shorter_best(tiny_search):
    """With exhaustive search, y beats a shorter y' iff log P(y) / log P(y') < lp(y) / lp(y')
    = ((5 + |y|) / (5 + |y'|))^alpha, which grows with alpha: so the length of the best
    hypothesis never decreases as alpha grows."""
    model, src, _ = tiny_search
    lengths = []
    for alpha in (0.0, 0.5, 1.0, 2.0, 5.0, 20.0):
        (found,) = beam_search(
            model, src, beam_size=64, length_penalty_alpha=alpha, max_len=MAX_LEN, **IDS
        )
        lengths.append(len(found[0].tokens))
    assert lengths == sorted(lengths)
    assert lengths[0] < lengths[-1] == MAX_LEN - 1  # the penalty does change the winner here


def test_a_small_beam_keeps_k_hypotheses_best_first(tiny_search):
    model, src, log_probs = tiny_search
    (found,) = beam_search(
        model, src, beam_size=3, length_penalty_alpha=0.0, max_len=MAX_LEN, **IDS
    )
    assert len(found) == 3
    assert [h.score for h in found] == sorted((h.score for h in found), reverse=True)
    assert found[0].log_prob <= max(log_probs.values()) + 1e-6


# ---- batching, EOS, banned tokens, max_len ------------------------------------------------


def test_a_padded_batch_decodes_as_its_sentences_one_by_one():
    model = _model("mos")
    src = _sources([6, 2, 4])
    greedy = greedy_search(model, src, max_len=7, **IDS)
    beams = beam_search(model, src, beam_size=3, max_len=7, **IDS)
    for i, length in enumerate([6, 2, 4]):
        alone = src[i : i + 1, :length]
        assert greedy_search(model, alone, max_len=7, **IDS)[0].tokens == greedy[i].tokens
        (single,) = beam_search(model, alone, beam_size=3, max_len=7, **IDS)
        assert [h.tokens for h in single] == [h.tokens for h in beams[i]]
        for a, b in zip(single, beams[i], strict=True):
            assert a.score == pytest.approx(b.score, abs=1e-5)


def test_pad_and_bos_are_never_generated_and_eos_is_forced_at_max_len():
    model = _model()
    with torch.no_grad():  # the model would rather say PAD, then BOS, and never stop
        model.head.bias[PAD] = 100.0
        model.head.bias[BOS] = 50.0
        model.head.bias[EOS] = -100.0
    src = _sources([3, 5])
    for hyp in greedy_search(model, src, max_len=5, **IDS):
        assert len(hyp.tokens) == 4 and not {PAD, BOS, EOS} & set(hyp.tokens)
        assert hyp.log_prob < -100  # the forced EOS is scored as the model rates it
    for hyps in beam_search(model, src, beam_size=2, max_len=5, **IDS):
        assert all(len(h.tokens) == 4 and not {PAD, BOS, EOS} & set(h.tokens) for h in hyps)
    for hyp in greedy_search(model, src, max_len=1, **IDS):
        assert hyp.tokens == []


def test_training_flags_are_restored_and_bad_arguments_named():
    model = _model("mixtape").train()
    model.encoder.eval()
    beam_search(model, _sources([3]), beam_size=2, max_len=4, **IDS)
    assert model.training and model.decoder.training and not model.encoder.training
    with pytest.raises(ValueError, match="beam_size must be a positive integer"):
        beam_search(model, _sources([3]), beam_size=0, max_len=4, **IDS)
    with pytest.raises(ValueError, match="max_len must be a positive integer"):
        greedy_search(model, _sources([3]), max_len=0, **IDS)
    with pytest.raises(ValueError, match="length_penalty_alpha must be a finite number"):
        beam_search(model, _sources([3]), length_penalty_alpha=float("nan"), max_len=4, **IDS)
