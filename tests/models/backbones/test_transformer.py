"""The causal Transformer backbone (pre-LN, Vaswani et al. 2017): the backbone contract, causal
masking, incremental decoding with a KV cache, positions (learned, sinusoidal, rotary) against
their closed forms, attention against a float64 reference, dropout switching, windows."""

from __future__ import annotations

import math

import pytest
import torch

from highrank.heads import HEADS
from highrank.models import LanguageModel
from highrank.models.backbones.transformer import (
    POSITIONS,
    CausalTransformer,
    KVCache,
    attend,
    rotate,
    sinusoidal_positions,
)

SMALL = {"d_model": 16, "n_layers": 2, "n_heads": 4, "d_ff": 24, "max_len": 64}


def _small(positions: str = "learned", **knobs) -> CausalTransformer:
    return CausalTransformer(30, **{**SMALL, "positions": positions, **knobs})


# ---- the backbone contract ----------------------------------------------------------------


def test_forward_shapes_and_the_backbone_contract():
    model = _small().train()
    tokens = torch.randint(0, 30, (7, 3))  # time-major (T, B)
    hidden, state, extras = model(tokens)
    assert hidden.shape == (7, 3, 16)
    assert state is None and extras is None
    assert model.init_state(3) is None and model.detach_state(None) is None
    assert model.d_last == model.d_embed == 16
    assert model.embedding.weight.shape == (30, 16)
    reg = model.regularization_loss(extras)
    assert reg.shape == () and float(reg) == 0.0
    hidden.sum().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert missing == []


@pytest.mark.parametrize("name", sorted(HEADS))
def test_language_model_with_every_head_and_a_tied_embedding(name, make_head):
    backbone = _small()
    knobs = {"tied_weight": backbone.embedding.weight, "d_embed": 16}
    if name in ("mos", "moc", "mixtape"):
        knobs["dropout_time_dim"] = 0  # time-major, as LanguageModel's heads
    if name in ("mfs", "cpr"):
        knobs["time_dim"] = 0  # they read the window's layers and tokens, time-major
    model = LanguageModel(backbone, make_head(name, d_in=16, vocab_size=30, **knobs)).train()
    tokens, target = torch.randint(0, 30, (2, 6, 3))
    loss, state, _ = model(tokens, target)
    loss.backward()
    assert torch.isfinite(loss) and state is None
    assert model.head.weight is backbone.embedding.weight
    assert backbone.embedding.weight.grad is not None
    log_p, _ = model.log_prob(tokens)
    torch.testing.assert_close(log_p.exp().sum(-1), torch.ones(6, 3))


def test_the_last_layers_for_heads_that_read_them():
    """layers=n: the last n-1 blocks' outputs (the embedding counting as layer 0) and the
    hidden states on top, time-major; more than the blocks and the embedding is refused."""
    model = _small().eval()  # 2 blocks
    tokens = torch.randint(0, 30, (7, 3))
    hidden, _, extras = model(tokens, layers=3)
    assert [tuple(x.shape) for x in extras.layers] == [(7, 3, 16)] * 3
    assert torch.equal(extras.layers[-1], hidden)
    states = []
    x = model.inputs(model.embedding(tokens.t()), torch.arange(7))
    model.stack(x, positions=torch.arange(7), states=states)
    torch.testing.assert_close(extras.layers[0], states[0].transpose(0, 1))  # the embedding
    torch.testing.assert_close(extras.layers[1], states[1].transpose(0, 1))  # block 1
    with pytest.raises(ValueError, match="reads the last 4 layers but this Transformer has 2"):
        model(tokens, layers=4)


def test_parameter_count_closed_form():
    """Per block 4 d^2 + 4 d (attention) + 2 d d_ff + d_ff + d (feed-forward) + 4 d (two LNs);
    plus V d (embedding), max_len d (learned positions), 2 d (final LN)."""
    v, d, ff, layers, max_len = 30, 16, 24, 2, 64
    block = 4 * d * d + 4 * d + 2 * d * ff + ff + d + 4 * d
    expected = v * d + max_len * d + layers * block + 2 * d
    assert sum(p.numel() for p in _small().parameters()) == expected
    rotary = sum(p.numel() for p in _small("rotary").parameters())
    assert rotary == expected - max_len * d  # no position table


# ---- causality and incremental decoding ---------------------------------------------------


@pytest.mark.parametrize("positions", POSITIONS)
def test_a_position_never_sees_a_later_token(positions):
    model = _small(positions).eval()
    tokens = torch.randint(0, 30, (9, 2))
    hidden, _, _ = model(tokens)
    for t in (0, 4, 8):
        changed = tokens.clone()
        changed[t] = (changed[t] + 1) % 30
        other, _, _ = model(changed)
        torch.testing.assert_close(other[:t], hidden[:t], rtol=0, atol=0)
        assert not torch.allclose(other[t], hidden[t])  # the changed position itself moves


@pytest.mark.parametrize("positions", POSITIONS)
def test_incremental_decoding_equals_one_full_pass(positions):
    model = _small(positions).eval()
    tokens = torch.randint(0, 30, (10, 3))
    full, _, _ = model(tokens)
    one_by_one, cache = [], KVCache()
    for t in range(10):
        out, cache, _ = model(tokens[t : t + 1], cache)
        one_by_one.append(out)
    torch.testing.assert_close(torch.cat(one_by_one), full, rtol=0, atol=1e-5)
    assert cache.length == 10 and len(cache.layers) == 2
    assert cache.layers[0][0].shape == (3, 4, 10, 4)  # (B, H, S, d_head)
    first, cache, _ = model(tokens[:6], KVCache())  # chunks of several tokens
    second, _, _ = model(tokens[6:], cache)
    torch.testing.assert_close(torch.cat([first, second]), full, rtol=0, atol=1e-5)


def test_cache_select_picks_batch_rows():
    model = _small().eval()
    tokens = torch.randint(0, 30, (5, 3))
    _, cache, _ = model(tokens[:4], KVCache())
    index = torch.tensor([2, 0, 0])
    out, _, _ = model(tokens[4:, index], cache.select(index))
    full, _, _ = model(tokens[:, index])
    torch.testing.assert_close(out, full[4:], rtol=0, atol=1e-5)
    assert not cache.detach().layers[0][0].requires_grad


# ---- attention and positions against closed forms -----------------------------------------


def _reference_attention(q, k, v, allowed):
    """softmax(q k^T / sqrt(d) + log(allowed)) v in float64; allowed (B|1, 1, T, S) bool."""
    q, k, v = q.double(), k.double(), v.double()
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("n_queries", [1, 3, 5])
def test_attend_with_cached_keys_and_padding_matches_float64(n_queries):
    b, h, s, d = 2, 3, 5, 4
    q = torch.randn(b, h, n_queries, d)
    k, v = torch.randn(2, b, h, s, d)
    padding = torch.tensor([[False] * 5, [False, False, False, True, True]])  # right-padded
    # query i sits at position s - n_queries + i and sees keys up to it, padding excluded
    causal = torch.ones(n_queries, s, dtype=torch.bool).tril(s - n_queries)
    for use_padding in (False, True):
        allowed = causal[None, None].expand(b, 1, n_queries, s)
        if use_padding:
            allowed = allowed & ~padding[:, None, None, :]
        out = attend(q, k, v, causal=True, key_padding=padding if use_padding else None)
        torch.testing.assert_close(
            out.double(), _reference_attention(q, k, v, allowed), rtol=0, atol=1e-6
        )
    both = attend(q, k, v, causal=False, key_padding=padding)
    allowed = (~padding[:, None, None, :]).expand(b, 1, n_queries, s)
    torch.testing.assert_close(
        both.double(), _reference_attention(q, k, v, allowed), atol=1e-6, rtol=0
    )


def test_sinusoidal_positions_closed_form():
    d = 6
    table = sinusoidal_positions(torch.arange(50), d)
    for pos in (0, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_rotary_rotates_pairs_and_scores_depend_on_offsets_only():
    x = torch.randn(1, 1, 1, 4)
    pos = torch.tensor([3])
    out = rotate(x, pos)
    for i, theta in enumerate((1.0, 10000 ** (-2 / 4))):  # theta_i = 10000^(-2i/d)
        c, s = math.cos(3 * theta), math.sin(3 * theta)
        a, b = x[0, 0, 0, 2 * i].item(), x[0, 0, 0, 2 * i + 1].item()
        assert out[0, 0, 0, 2 * i].item() == pytest.approx(a * c - b * s, abs=1e-6)
        assert out[0, 0, 0, 2 * i + 1].item() == pytest.approx(a * s + b * c, abs=1e-6)
    q, k = torch.randn(2, 1, 1, 1, 8)
    m, n = torch.tensor([5]), torch.tensor([2])

    def score(shift):
        return (rotate(q, m + shift) * rotate(k, n + shift)).sum()

    torch.testing.assert_close(score(0), score(17), rtol=0, atol=1e-5)
    torch.testing.assert_close(rotate(q, m).norm(), q.norm())


# ---- dropout, positions limit and bad input -----------------------------------------------


def test_eval_is_deterministic_and_each_dropout_acts_only_in_training():
    knobs = {"dropout_input": 0.0, "dropout_attention": 0.0, "dropout_residual": 0.0}
    tokens = torch.randint(0, 30, (6, 2))
    quiet = _small(**knobs).train()
    torch.testing.assert_close(quiet(tokens)[0], quiet(tokens)[0], rtol=0, atol=0)
    for name in knobs:
        model = _small(**{**knobs, name: 0.5})
        model.train()
        assert not torch.equal(model(tokens)[0], model(tokens)[0]), name
        model.eval()
        torch.testing.assert_close(model(tokens)[0], model(tokens)[0], rtol=0, atol=0)


def test_learned_positions_stop_at_max_len_with_a_clear_error():
    model = _small(max_len=8).eval()
    model(torch.randint(0, 30, (8, 1)))
    with pytest.raises(ValueError, match="position 8 is beyond max_len=8"):
        model(torch.randint(0, 30, (9, 1)))
    _, cache, _ = model(torch.randint(0, 30, (8, 1)), KVCache())
    with pytest.raises(ValueError, match="max_len=8"):
        model(torch.randint(0, 30, (1, 1)), cache)
    _small("rotary", max_len=8).eval()(torch.randint(0, 30, (20, 1)))  # no table, no limit


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"n_heads": 3}, "d_model=16 is not divisible by n_heads=3"),
        ({"positions": "absolute"}, "positions='absolute'; expected one of"),
        ({"dropout_residual": 1.0}, "dropout_residual must be a number in"),
        ({"d_model": 0}, "d_model must be a positive integer"),
        ({"d_model": 12, "n_heads": 4, "positions": "rotary"}, "even d_head"),
    ],
)
def test_bad_knobs_are_named(knobs, message):
    with pytest.raises(ValueError, match=message):
        _small(**knobs)


def test_bad_tokens_and_state_are_named():
    model = _small()
    with pytest.raises(ValueError, match=r"expected time-major \(T, B\)"):
        model(torch.randint(0, 30, (5,)))
    with pytest.raises(TypeError, match="integer ids"):
        model(torch.rand(5, 2))
    with pytest.raises(TypeError, match="state must be None or a KVCache"):
        model(torch.randint(0, 30, (5, 2)), [(torch.zeros(1), torch.zeros(1))])


# ---- windows ------------------------------------------------------------------------------


def test_evaluation_scores_independent_windows_of_bptt_tokens():
    """evaluate_perplexity carries the (None) state: each window of a column is scored with
    only its own tokens as context, as the class docstring says."""
    from highrank.evaluate import evaluate_perplexity

    model = LanguageModel(_small(), HEADS["softmax"](16, 30)).eval()
    ids = torch.randint(0, 30, (2 * 13 + 1,))
    result = evaluate_perplexity(model, ids, batch_size=2, bptt=5)
    columns = ids[:26].view(2, 13).t()  # (13, 2): two contiguous columns
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, 12, 5):
            tokens = columns[start : min(start + 5, 12)]
            target = columns[start + 1 : start + 1 + tokens.shape[0]]
            total += model.nll(tokens, target)[0].double().sum().item()  # a window alone
            count += target.numel()
    assert result.tokens == count
    assert result.loss == pytest.approx(total / count, rel=1e-6)
