"""LanguageModel composition: tying, locked head dropout, parameter counts of the papers."""

from __future__ import annotations

import pytest
import torch

from highrank.config import load_config
from highrank.models import build_model, count_parameters

SMALL = ["model.d_embed=16", "model.d_hidden=24", "model.n_layers=2"]


def _model(head: str, *extra: str):
    return build_model(load_config(None, [*SMALL, f"head.name={head}", *extra]), vocab_size=50)


@pytest.mark.parametrize("head", ["softmax", "mos", "mixtape", "plif"])
def test_forward_gives_loss_state_and_normalised_log_probs(head):
    model = _model(head, "head.n_components=3" if head == "mos" else "head.name=" + head)
    tokens, target = torch.randint(0, 50, (7, 3)), torch.randint(0, 50, (7, 3))
    loss, state, extras = model(tokens, target)
    assert loss.dim() == 0 and len(state) == 2
    loss.backward()
    model.eval()
    log_p, _ = model.log_prob(tokens)
    assert log_p.shape == (7, 3, 50)
    torch.testing.assert_close(log_p.logsumexp(-1), torch.zeros(7, 3), atol=1e-5, rtol=0)
    nll, _ = model.nll(tokens, target)
    torch.testing.assert_close(nll, -log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1))


def test_tied_model_shares_the_embedding_and_counts_it_once():
    tied, untied = _model("softmax"), _model("softmax", "model.tie_weights=false")
    assert tied.head.weight is tied.backbone.embedding.weight
    assert count_parameters(untied) - count_parameters(tied) == 50 * 16
    groups = tied.parameter_groups(lr=1.0)
    ids = [id(p) for group in groups for p in group["params"]]
    assert len(ids) == len(set(ids)) == len(list(tied.parameters()))


def test_plif_slopes_keep_their_own_learning_rate_in_the_model_groups():
    groups = _model("plif", "head.n_pieces=100").parameter_groups(lr=30.0)
    assert [group["lr"] for group in groups] == [30.0, 0.02]


def test_mixture_heads_get_dropout_locked_over_time():
    model = _model("mos", "head.n_components=2")
    assert model.head.dropout_time_dim == 0


@pytest.mark.parametrize(
    "head, overrides, published",
    [
        ("softmax", [], 24.22e6),  # AWD-LSTM PTB, Merity et al. 2018
        ("plif", [], 24.32e6),  # LMS-PLIF, Ganea et al. 2019
        (
            "mos",
            ["model.d_embed=280", "model.d_hidden=960", "model.d_last=620"],
            21.50e6,  # AWD-LSTM-MoS PTB, Yang et al. 2018 (15 components)
        ),
    ],
)
def test_ptb_parameter_counts_match_the_papers(head, overrides, published):
    config = load_config(None, [f"head.name={head}", *overrides])
    with torch.device("meta"):  # nothing allocated
        model = build_model(config, vocab_size=10_000)
    assert abs(count_parameters(model) - published) / published < 0.01


# The library's own families with the heads that read their window (MFS, CPR): tiny settings.
FAMILIES = {
    "awd_lstm": [*SMALL, "head.input_layers=1"],  # AWD-LSTM gives a head its last layer only
    "transformer": ["model.backbone=transformer", "model.d_embed=16", "model.n_layers=2",
                    "model.n_heads=2", "model.d_ff=16", "model.max_len=12", "train.bptt=12",
                    "head.input_layers=3"],
}
CONTEXT_HEADS = {"mfs": [], "cpr": ["head.reranker_k1=10", "head.reranker_k2=4"]}


@pytest.mark.parametrize("head", sorted(CONTEXT_HEADS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_context_heads_never_read_a_later_token(family, head):
    """Leak guard: the families hand MFS / CPR the window's layers and input tokens
    (``LanguageModel.body``); position t's distribution and NLL must not move when any token
    after t (the target t + 1 included) changes. A ``context_ids`` or layer shifted towards
    the future (e.g. the targets in place of the inputs with C's mask one wider) shows here;
    the changed token itself does move its own position's distribution (the check can fail)."""
    model = build_model(load_config(None, [*FAMILIES[family], f"head.name={head}",
                                           *CONTEXT_HEADS[head]]), vocab_size=50).eval()
    with torch.no_grad():  # every parameter of the head live and away from 0 (C, P, Mi act)
        for param in model.head.parameters():
            param.copy_(0.3 * torch.randn_like(param))
    tokens = torch.randint(0, 8, (12, 3))  # time-major (T, B); small ids so words repeat
    target = torch.cat([tokens[1:], torch.randint(0, 8, (1, 3))])
    with torch.no_grad():
        log_p, _ = model.log_prob(tokens)
        nll, _ = model.nll(tokens, target)
        for p in (1, 5, 11):
            later, later_target = tokens.clone(), target.clone()
            later[p:] = (tokens[p:] + 1) % 8
            later_target[p - 1 :] = (target[p - 1 :] + 1) % 8  # the target of p - 1 is token p
            other, _ = model.log_prob(later)
            torch.testing.assert_close(other[:p], log_p[:p], atol=1e-6, rtol=0)
            assert not torch.allclose(other[p], log_p[p], atol=1e-4)
            other_nll, _ = model.nll(later, later_target)
            torch.testing.assert_close(other_nll[: p - 1], nll[: p - 1], atol=1e-6, rtol=0)
