"""AWD-LSTM's regularizers (Merity et al. 2018): locked and embedding dropout, weight drop,
AR/TAR and variable-length BPTT."""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
from torch import nn

from highrank.models.backbones.regularizers import (
    LockedDropout,
    WeightDrop,
    _pack_contiguous,
    activation_regularization,
    embedding_dropout,
    temporal_activation_regularization,
    variable_bptt_length,
)

# ---- LockedDropout ------------------------------------------------------------------------


def test_locked_dropout_shares_one_mask_over_time_and_scales_kept_units():
    p = 0.3
    out = LockedDropout(p).train()(torch.ones(7, 64, 50))  # (T, B, H)
    assert torch.equal(out, out[:1].expand_as(out)), "mask must be shared by all time steps"
    kept = out[out != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p)))
    assert abs(out.mean().item() - 1.0) < 0.05  # 3200 units: the mean is preserved
    assert not torch.equal(out[0, 0], out[0, 1]), "each sequence must draw its own mask"


def test_locked_dropout_draws_a_new_mask_each_forward():
    dropout = LockedDropout(0.5).train()
    x = torch.ones(3, 8, 16)
    assert not torch.equal(dropout(x), dropout(x))


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_locked_dropout_is_the_identity_in_eval_or_at_zero(p):
    x = torch.randn(4, 3, 5)
    assert LockedDropout(p).eval()(x) is x
    assert LockedDropout(0.0).train()(x) is x


@pytest.mark.parametrize("p", [-0.1, 1.0, "0.5"])
def test_locked_dropout_rejects_a_bad_rate_naming_it(p):
    with pytest.raises(ValueError, match="p must be a number in \\[0, 1\\)"):
        LockedDropout(p)


# ---- embedding dropout --------------------------------------------------------------------


def test_embedding_dropout_drops_whole_words_for_the_whole_batch():
    p = 0.5
    embedding = nn.Embedding(12, 10)
    words = torch.arange(12).repeat(20, 1).T  # (T=12, B=20): word t fills row t
    out = embedding_dropout(embedding, words, p, training=True)  # (6, 20, 10)
    expected = embedding(words)
    dropped_words = 0
    for row in range(12):
        occurrences = out[row]  # (20, 10): every occurrence of word `row`
        if (occurrences == 0).all():
            dropped_words += 1
        else:
            torch.testing.assert_close(occurrences, expected[row] / (1 - p))
    assert 0 < dropped_words < 12  # seeded: both cases are exercised
    assert embedding_dropout(embedding, words, p, training=True).ne(out).any(), "new mask"


def test_embedding_dropout_drops_about_p_of_the_vocabulary():
    embedding = nn.Embedding(2000, 3)
    words = torch.arange(2000).view(-1, 1)
    out = embedding_dropout(embedding, words, 0.1, training=True)
    fraction = (out == 0).all(-1).float().mean().item()
    assert 0.07 < fraction < 0.13  # 2000 draws, std 0.0067


def test_embedding_dropout_is_a_plain_lookup_in_eval_and_gradients_skip_dropped_rows():
    embedding = nn.Embedding(30, 4)
    words = torch.randint(0, 30, (5, 3))
    torch.testing.assert_close(embedding_dropout(embedding, words, 0.5, False), embedding(words))
    embedding_dropout(embedding, words, 0.5, True).sum().backward()
    grad = embedding.weight.grad
    assert set(grad.abs().sum(1).nonzero().flatten().tolist()) <= set(words.flatten().tolist())


# ---- WeightDrop ---------------------------------------------------------------------------


def _weight_dropped(d_in=5, hidden=6, p=0.5):
    lstm = nn.LSTM(d_in, hidden)
    return WeightDrop(lstm, p), lstm


def test_weight_drop_warns_nothing_and_keeps_its_parameters():
    model, _ = _weight_dropped()
    keys, n_params = list(model.state_dict()), len(list(model.parameters()))
    x = torch.randn(4, 3, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("error")
        for mode in (True, False, True):
            out, _ = model.train(mode)(x)
            out.sum().backward()
    assert not caught
    assert list(model.state_dict()) == keys
    assert len(list(model.parameters())) == n_params
    assert all(isinstance(p, nn.Parameter) for p in model.lstm.parameters())
    assert isinstance(model.lstm.weight_hh_l0, nn.Parameter)


def test_weight_drop_redraws_its_mask_each_training_forward():
    model, _ = _weight_dropped()
    x = torch.randn(4, 3, 5)
    assert not torch.equal(model.train()(x)[0], model(x)[0])


def test_weight_drop_is_exactly_the_lstm_in_eval():
    model, lstm = _weight_dropped()
    model.eval()
    x, state = torch.randn(4, 3, 5), (torch.randn(1, 3, 6), torch.randn(1, 3, 6))
    out, (h, c) = model(x, state)
    torch.testing.assert_close(model(x, state)[0], out, rtol=0, atol=0)
    ref_out, (ref_h, ref_c) = lstm(x, state)
    for got, want in ((out, ref_out), (h, ref_h), (c, ref_c)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_weight_drop_training_path_is_an_lstm_with_masked_recurrent_weights(monkeypatch):
    """With a known mask: outputs match an nn.LSTM whose W_hh is masked, and the gradient of
    W_hh is that LSTM's gradient times the mask (zero where a weight was dropped)."""
    model, lstm = _weight_dropped(p=0.5)
    mask = (torch.rand(24, 6) < 0.5).float() * 2.0  # (4H, H): 0 or 1 / (1 - p)
    monkeypatch.setattr(model, "draw_mask", lambda: mask)
    reference = copy.deepcopy(lstm)
    with torch.no_grad():
        reference.weight_hh_l0.mul_(mask)
    x, state = torch.randn(4, 3, 5), (torch.randn(1, 3, 6), torch.randn(1, 3, 6))
    out, (h, c) = model.train()(x, state)
    ref_out, (ref_h, ref_c) = reference.train()(x, state)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(c, ref_c)
    (out.sum() + h.sum()).backward()
    (ref_out.sum() + ref_h.sum()).backward()
    torch.testing.assert_close(lstm.weight_hh_l0.grad, reference.weight_hh_l0.grad * mask)
    torch.testing.assert_close(lstm.weight_ih_l0.grad, reference.weight_ih_l0.grad)
    assert (lstm.weight_hh_l0.grad[mask == 0] == 0).all()


def test_weight_drop_mask_has_the_right_rate_and_scale():
    model, _ = _weight_dropped(d_in=4, hidden=50, p=0.25)  # mask (200, 50)
    mask = model.draw_mask()
    assert set(mask.unique().tolist()) <= {0.0, torch.tensor(1 / 0.75).item()}  # float32
    assert abs((mask == 0).float().mean().item() - 0.25) < 0.03


def test_weight_drop_works_in_float64_and_after_deepcopy():
    model, _ = _weight_dropped()
    model = copy.deepcopy(model).to(torch.float64).train()
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, (h, c) = model(x)
        out.sum().backward()
    assert out.dtype == h.dtype == torch.float64
    assert model.lstm.weight_hh_l0.grad.dtype == torch.float64


def test_cuda_packing_gives_views_of_one_buffer_that_pass_gradients():
    weights = [torch.randn(8, 3, requires_grad=True), torch.randn(8, requires_grad=True)]
    packed = _pack_contiguous(weights)
    assert packed[1].data_ptr() == packed[0].data_ptr() + 24 * packed[0].element_size()
    for got, want in zip(packed, weights, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    sum((i + 1) * w.sum() for i, w in enumerate(packed)).backward()
    torch.testing.assert_close(weights[1].grad, torch.full((8,), 2.0))


def test_weight_drop_rejects_a_multi_layer_lstm_naming_the_setting():
    with pytest.raises(ValueError, match="num_layers=2, expected 1"):
        WeightDrop(nn.LSTM(3, 4, num_layers=2))
    with pytest.raises(TypeError, match="nn.LSTM; got GRU"):
        WeightDrop(nn.GRU(3, 4))


def test_weight_drop_rejects_a_state_of_the_wrong_shape():
    model, _ = _weight_dropped()
    bad = (torch.zeros(1, 2, 6), torch.zeros(1, 2, 6))  # batch 2, input batch 3
    with pytest.raises(RuntimeError, match="Expected hidden"):
        model.train()(torch.randn(4, 3, 5), bad)


# ---- AR / TAR -----------------------------------------------------------------------------


def test_ar_and_tar_against_hand_computation():
    h = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]], [[4.0, 4.0]]])  # (T=3, B=1, H=2)
    # AR: alpha * mean of squares = 2 * (1 + 4 + 9 + 16 + 16 + 16) / 6
    torch.testing.assert_close(activation_regularization(h, 2.0), torch.tensor(2 * 62 / 6))
    # TAR: differences (2, 2), (1, 0): beta * (4 + 4 + 1 + 0) / 4
    torch.testing.assert_close(
        temporal_activation_regularization(h, 0.5), torch.tensor(0.5 * 9 / 4)
    )


def test_tar_is_zero_for_a_single_time_step():
    assert temporal_activation_regularization(torch.randn(1, 3, 4), 1.0).item() == 0.0


# ---- variable BPTT ------------------------------------------------------------------------


@pytest.mark.parametrize("make_rng", [lambda s: torch.Generator().manual_seed(s), random.Random])
def test_variable_bptt_is_deterministic_given_the_rng_and_leaves_global_state(make_rng):
    torch_state, py_state = torch.get_rng_state(), random.getstate()
    first = [variable_bptt_length(70, rng, 40) for rng in [make_rng(3)] for _ in range(50)]
    second = [variable_bptt_length(70, rng, 40) for rng in [make_rng(3)] for _ in range(50)]
    assert first == second
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state
    seq_len, lr_scale = first[0]
    assert lr_scale == seq_len / 70


@pytest.mark.parametrize("make_rng", [lambda s: torch.Generator().manual_seed(s), random.Random])
def test_variable_bptt_bounds_and_the_95_5_split(make_rng):
    rng = make_rng(0)
    lengths = [variable_bptt_length(70, rng, 10).seq_len for _ in range(4000)]
    assert min(lengths) >= 5 and max(lengths) <= 80
    assert max(lengths) == 80, "N(70, 5) exceeds 80 in about 2% of draws: the cap must bind"
    # Base 35 draws N(35, 5), base 70 draws N(70, 5): the two never meet near 52.
    half = sum(n < 52 for n in lengths) / len(lengths)
    assert abs(half - 0.05) < 0.015  # binomial std 0.0034
    assert all(isinstance(n, int) for n in lengths)


def test_variable_bptt_floor_of_five():
    rng = torch.Generator().manual_seed(0)
    assert min(variable_bptt_length(6, rng, 0).seq_len for _ in range(200)) == 5


def test_variable_bptt_rejects_bad_arguments():
    with pytest.raises(ValueError, match="bptt must be an integer >= 1; got 0"):
        variable_bptt_length(0, random.Random(0))
    with pytest.raises(ValueError, match="max_delta must be an integer >= 0; got -1"):
        variable_bptt_length(70, random.Random(0), -1)
    with pytest.raises(TypeError, match="torch.Generator or random.Random; got int"):
        variable_bptt_length(70, 3)
