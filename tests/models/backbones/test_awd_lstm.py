"""The AWD-LSTM backbone (Merity et al. 2018): shapes, state carrying, dropout switching and
the published parameter counts."""

from __future__ import annotations

import warnings

import pytest
import torch

from highrank.models.backbones import AWDLSTM

SMALL = {"d_embed": 8, "d_hidden": 12, "n_layers": 3}


def _small(**knobs) -> AWDLSTM:
    return AWDLSTM(20, **{**SMALL, **knobs})


def test_forward_shapes_state_and_extras():
    model = _small().train()
    tokens = torch.randint(0, 20, (7, 4))  # (T, B)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        output, state, extras = model(tokens)
        output.sum().backward()
    assert output.shape == (7, 4, 8)  # d_last defaults to d_embed
    assert [tuple(h.shape) for h, _ in state] == [(1, 4, 12), (1, 4, 12), (1, 4, 8)]
    assert [tuple(c.shape) for _, c in state] == [(1, 4, 12), (1, 4, 12), (1, 4, 8)]
    assert extras.dropped_output is output
    assert extras.raw_output.shape == output.shape
    assert model.layer_sizes == (12, 12, 8)


def test_d_last_is_free_and_single_layer_works():
    model = AWDLSTM(20, d_embed=6, d_hidden=10, d_last=5)
    assert model(torch.randint(0, 20, (3, 2)))[0].shape == (3, 2, 5)
    single = AWDLSTM(20, d_embed=6, n_layers=1, d_last=4)
    assert single.layer_sizes == (4,)
    assert single(torch.randint(0, 20, (3, 2)))[0].shape == (3, 2, 4)


def test_state_carrying_equals_running_the_whole_sequence_in_eval():
    model = _small().eval()
    tokens = torch.randint(0, 20, (10, 3))
    whole, whole_state, _ = model(tokens)
    first, state, _ = model(tokens[:6])
    second, state, _ = model(tokens[6:], model.detach_state(state))
    torch.testing.assert_close(torch.cat([first, second]), whole)
    for (h, c), (h_ref, c_ref) in zip(state, whole_state, strict=True):
        torch.testing.assert_close(h, h_ref)
        torch.testing.assert_close(c, c_ref)


def test_eval_is_deterministic_and_training_is_not():
    model = _small()
    tokens = torch.randint(0, 20, (5, 3))
    model.eval()
    torch.testing.assert_close(model(tokens)[0], model(tokens)[0], rtol=0, atol=0)
    model.train()
    assert not torch.equal(model(tokens)[0], model(tokens)[0])


def test_eval_turns_every_dropout_off():
    """In eval, the output equals a hand-run of the plain embedding and LSTMs."""
    model = _small(dropout_embedding=0.5, dropout_input=0.5, weight_drop=0.9).eval()
    tokens = torch.randint(0, 20, (5, 3))
    x = model.embedding(tokens)
    for layer in model.layers:
        x, _ = layer.lstm(x)
    output, _, extras = model(tokens)
    torch.testing.assert_close(output, x, rtol=0, atol=0)
    torch.testing.assert_close(extras.raw_output, output, rtol=0, atol=0)


def test_each_dropout_acts_only_in_training():
    knobs = {
        "dropout_embedding": 0.0,
        "dropout_input": 0.0,
        "dropout_hidden": 0.0,
        "dropout_output": 0.0,
        "weight_drop": 0.0,
    }
    tokens = torch.randint(0, 20, (5, 3))
    quiet = _small(**knobs).train()
    torch.testing.assert_close(quiet(tokens)[0], quiet(tokens)[0], rtol=0, atol=0)
    for name in knobs:
        model = _small(**{**knobs, name: 0.5}).train()
        assert not torch.equal(model(tokens)[0], model(tokens)[0]), name


def test_detach_state_cuts_the_graph():
    model = _small().train()
    _, state, _ = model(torch.randint(0, 20, (4, 2)))
    assert all(h.requires_grad for h, _ in state)
    assert not any(h.requires_grad or c.requires_grad for h, c in model.detach_state(state))


def test_regularization_loss_is_alpha_ar_plus_beta_tar():
    model = _small(ar_alpha=2.0, tar_beta=1.0).train()
    _, _, extras = model(torch.randint(0, 20, (6, 3)))
    raw, dropped = extras.raw_output, extras.dropped_output
    expected = 2.0 * dropped.pow(2).mean() + (raw[1:] - raw[:-1]).pow(2).mean()
    torch.testing.assert_close(model.regularization_loss(extras), expected)


def test_embedding_is_uniform_and_tieable():
    model = AWDLSTM(500, d_embed=16, d_hidden=8, n_layers=2)
    weight = model.embedding.weight
    assert weight.shape == (500, 16) and weight.abs().max() <= 0.1
    assert weight.min() < -0.09 and weight.max() > 0.09


def test_parameter_count_of_the_published_awd_lstm_ptb_model():
    """AWD-LSTM PTB (d_embed 400, d_hidden 1150, 3 layers, V = 10,000, tied softmax): 24M.

    embedding                      10,000 * 400                         =  4,000,000
    LSTM 400 -> 1150    4*1150 * (400 + 1150) + 2 * 4*1150 (b_ih, b_hh) =  7,139,200
    LSTM 1150 -> 1150   4*1150 * (1150 + 1150) + 2 * 4*1150             = 10,589,200
    LSTM 1150 -> 400    4*400 * (1150 + 400) + 2 * 4*400                 =  2,483,200
    backbone                                                            = 24,211,600
    + decoder bias (the decoder matrix is the tied embedding)  10,000   = 24,221,600
    """
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = AWDLSTM(10_000)
    backbone = sum(p.numel() for p in model.parameters())
    assert backbone == 24_211_600
    assert backbone + 10_000 == 24_221_600
    assert abs(backbone + 10_000 - 24.22e6) / 24.22e6 < 0.01


def test_parameter_count_of_the_mos_ptb_backbone():
    """MoS PTB (d_embed 280, hidden 960, 960, 620; V = 10,000).

    embedding 10,000 * 280 = 2,800,000; LSTMs 4*960*(280+960) + 2*3840 = 4,769,280,
    4*960*(960+960) + 2*3840 = 7,380,480, 4*620*(960+620) + 2*2480 = 3,923,360:
    backbone 18,873,120. The MoS head (K = 15: prior 620*15, latent 620*15*280 + 15*280,
    decoder bias 10,000) adds 2,627,500: 21.5M, the paper's "22M".
    """
    with torch.device("meta"):
        model = AWDLSTM(10_000, d_embed=280, d_hidden=960, d_last=620)
    assert sum(p.numel() for p in model.parameters()) == 18_873_120


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"n_layers": 0}, "n_layers must be a positive integer; got 0"),
        ({"d_last": 2.5}, "d_last must be a positive integer; got 2.5"),
        ({"dropout_hidden": 1.0}, r"dropout_hidden must be a number in \[0, 1\); got 1.0"),
        ({"weight_drop": -0.5}, r"weight_drop must be a number in \[0, 1\); got -0.5"),
        ({"ar_alpha": -1}, "ar_alpha must be a number >= 0; got -1"),
    ],
)
def test_bad_knobs_are_named_in_the_error(knobs, message):
    with pytest.raises(ValueError, match=message):
        _small(**knobs)


def test_bad_tokens_and_state_are_named_in_the_error():
    model = _small()
    with pytest.raises(ValueError, match=r"tokens has shape \(5,\); expected time-major"):
        model(torch.randint(0, 20, (5,)))
    with pytest.raises(TypeError, match="integer ids; got dtype torch.float32"):
        model(torch.zeros(5, 2))
    with pytest.raises(ValueError, match=r"state\[0\] has shapes .* expected \(1, 2, 12\)"):
        model(torch.randint(0, 20, (5, 2)), model.init_state(3))
    with pytest.raises(ValueError, match="state has 2 layers; expected 3"):
        model(torch.randint(0, 20, (5, 2)), model.init_state(2)[:2])


def test_a_projection_sets_the_output_width_and_keeps_the_recurrence():
    """model.d_project: the last layer keeps its size, the output (what the head reads) is a
    linear map of it to d_project; without it there is no projection."""
    from highrank.models.backbones.awd_lstm import AWDLSTM

    torch.manual_seed(0)
    plain = AWDLSTM(30, d_embed=8, d_hidden=12, n_layers=1, d_last=12)
    projected = AWDLSTM(30, d_embed=8, d_hidden=12, n_layers=1, d_last=12, d_project=3)
    assert plain.projection is None and plain.d_last == 12
    assert projected.layer_sizes == (12,) and projected.d_last == 3
    projected.eval()
    tokens = torch.randint(0, 30, (5, 2))
    output, state, extras = projected(tokens)
    assert output.shape == (5, 2, 3) and state[0][0].shape == (1, 2, 12)
    # the output is the projection of the LSTM's own output
    hidden, _ = projected.layers[0](projected.embedding(tokens), projected.init_state(2)[0])
    torch.testing.assert_close(output, projected.projection(hidden))


def test_the_output_dropout_and_ar_tar_act_on_the_body_not_on_the_projected_width():
    """Training: the output is the projection of the dropped LSTM output (its locked mask
    over the 12 hidden units, not over the 3 projected ones); AR and TAR read the LSTM's own
    12-wide outputs, dropped and raw, as without a projection."""
    from highrank.models.backbones.awd_lstm import AWDLSTM

    torch.manual_seed(0)
    model = AWDLSTM(30, d_embed=8, d_hidden=12, n_layers=1, d_last=12, d_project=3,
                    dropout_output=0.5, dropout_input=0, dropout_embedding=0, weight_drop=0)
    model.train()
    tokens = torch.randint(0, 30, (5, 2))
    torch.manual_seed(1)
    output, _, extras = model(tokens)
    hidden, _ = model.layers[0](model.embedding(tokens), model.init_state(2)[0])
    torch.testing.assert_close(extras.raw_output, hidden)
    torch.manual_seed(1)
    dropped = model.output_dropout(hidden)  # the same locked mask: the same draw
    assert (dropped == 0).any()  # the mask deleted hidden units: the check can fail
    torch.testing.assert_close(output, model.projection(dropped))
    torch.testing.assert_close(extras.dropped_output, dropped)
    assert extras.raw_output.shape[-1] == 12 and output.shape[-1] == 3


def test_an_untied_head_on_a_projection_has_the_output_width_as_its_decoder_width(tmp_path):
    """The map's cells differ by their output layer alone: with model.d_project and untied
    weights, the head's decoder has width d_project (the input embedding keeps d_embed)."""
    from highrank.config import load_config
    from highrank.models import build_model

    config = load_config(None, ["data.dir=x", "model.d_embed=8", "model.n_layers=1",
                                "model.d_last=12", "model.d_project=3",
                                "model.tie_weights=false"])
    model = build_model(config, 30)
    assert model.backbone.embedding.weight.shape == (30, 8)
    assert model.head.d_in == 3 and model.head.weight.shape == (30, 3)
