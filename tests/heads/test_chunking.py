"""Memory-bounded loss paths against the plain one and against a float64 reference."""

from __future__ import annotations

import copy

import pytest
import torch

from highrank.heads import HEADS
from tests.conftest import head_inputs

HEAD_NAMES = list(HEADS)


def _grads(head, hidden, target, **loss_kwargs):
    head.zero_grad()
    hidden = hidden.clone().requires_grad_(True)
    weights = loss_kwargs.pop("token_weights", None)
    loss = head.loss(hidden, target, **loss_kwargs, **head_inputs(head, hidden))
    (loss * weights).sum().backward() if weights is not None else loss.backward()
    return loss.detach(), hidden.grad, {n: p.grad.clone() for n, p in head.named_parameters()}


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_per_token_chunked_loss_backpropagates_per_token_weights(make_head, name):
    # reduction="none" takes the checkpointed path: any per-token weighting must flow back.
    head = make_head(name).eval()
    hidden, target = torch.randn(4, 5, 12), torch.randint(0, 50, (4, 5))
    weights = torch.rand(4, 5)
    plain = _grads(head, hidden, target, reduction="none", token_weights=weights)
    chunked = _grads(head, hidden, target, reduction="none", chunk_size=3, token_weights=weights)
    torch.testing.assert_close(chunked[0], plain[0])
    torch.testing.assert_close(chunked[1], plain[1], atol=1e-6, rtol=1e-5)
    for param_name in plain[2]:
        torch.testing.assert_close(
            chunked[2][param_name], plain[2][param_name], atol=1e-6, rtol=1e-5
        )


@pytest.mark.parametrize("name", HEAD_NAMES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_float32_paths_match_a_float64_reference(make_head, name, reduction):
    head = make_head(name).eval()
    reference = copy.deepcopy(head).double()
    hidden, target = 2 * torch.randn(30, 12), torch.randint(0, 50, (30,))
    loss, hidden_grad, grads = _grads(head, hidden, target, reduction=reduction, chunk_size=7)
    ref_loss, ref_hidden_grad, ref_grads = _grads(
        reference, hidden.double(), target, reduction=reduction
    )
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(hidden_grad.double(), ref_hidden_grad, atol=1e-4, rtol=1e-4)
    for param_name, ref_grad in ref_grads.items():
        torch.testing.assert_close(grads[param_name].double(), ref_grad, atol=1e-4, rtol=1e-4)


def test_chunked_loss_accumulates_into_a_tied_embedding_used_elsewhere(make_head):
    embedding = torch.nn.Embedding(50, 12)
    head = make_head("mos", tied_weight=embedding.weight).eval()
    tokens, target = torch.randint(0, 50, (20,)), torch.randint(0, 50, (20,))
    grads = []
    for chunk_size in (None, 6):
        embedding.zero_grad()
        hidden = torch.tanh(embedding(tokens))  # the weight is used as input *and* decoder
        head.loss(hidden, target, chunk_size=chunk_size).backward()
        grads.append(embedding.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", ["softmax", "mos"])
def test_chunked_loss_without_gradients(make_head, name):
    head = make_head(name).eval()
    hidden, target = torch.randn(20, 12), torch.randint(0, 50, (20,))
    with torch.no_grad():
        chunked = head.loss(hidden, target, chunk_size=6)
        plain = head.loss(hidden, target)
    torch.testing.assert_close(chunked, plain)
    frozen_input = head.loss(hidden, target, chunk_size=6)  # hidden needs no gradient
    frozen_input.backward()
    assert head.weight.grad is not None


def test_chunked_loss_can_be_scaled_and_combined_before_backward(make_head):
    head = make_head("mixtape").eval()
    hidden, target = torch.randn(20, 12, requires_grad=True), torch.randint(0, 50, (20,))
    (3.0 * head.loss(hidden, target, chunk_size=6) + hidden.square().sum()).backward()
    chunked = hidden.grad.clone()
    hidden.grad = None
    (3.0 * head.loss(hidden, target) + hidden.square().sum()).backward()
    torch.testing.assert_close(chunked, hidden.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_auto_chunking_matches_the_whole_batch(make_head, name, monkeypatch):
    from highrank.heads.kernels import chunking
    from highrank.heads.kernels.mixtape_ce import MIXTAPE_LOSS

    monkeypatch.setattr(chunking, "AUTO_CHUNK_ELEMENTS", 50 * 7)  # fused: 7 tokens of V = 50
    monkeypatch.setattr(chunking, "GENERIC_AUTO_CHUNK_TOKENS", 5)
    monkeypatch.setattr(MIXTAPE_LOSS, "min_chunk_tokens", 4)
    head = make_head(name).eval()
    # Mixtape (S = 15 of 50): 50 logits + 12 x 15 per token, so 1 token, raised to 4.
    fused = {"softmax": 7, "moc": 7, "mos": 7 // 3, "mixtape": 4, "mlp_softmax": 7}
    expected_chunk = fused.get(name, 5)
    assert head._resolve_chunk_size("auto", "mean") == expected_chunk
    hidden, target = torch.randn(30, 12), torch.randint(0, 50, (30,))
    auto = _grads(head, hidden, target)  # chunk_size defaults to "auto"
    whole = _grads(head, hidden, target, chunk_size=None)
    torch.testing.assert_close(auto[0], whole[0])
    torch.testing.assert_close(auto[1], whole[1], atol=1e-6, rtol=1e-5)
    # Per-token losses with gradients are computed whole (no recomputation) under "auto".
    assert head._resolve_chunk_size("auto", "none") is None
    with torch.no_grad():
        assert head._resolve_chunk_size("auto", "none") == expected_chunk


def test_auto_chunks_on_a_gpu_hold_about_2_to_the_26_logits(make_head):
    """No CUDA needed: the chunk size depends only on the device's type."""
    mos = make_head("mos", vocab_size=100_000, n_components=15, d_embed=8)
    assert mos.auto_chunk_tokens() == 1  # CPU: 2**21 logits are one token of 15 x V
    assert mos.auto_chunk_tokens("cuda") == 2**26 // 1_500_000 == 44
    assert mos.auto_chunk_tokens(torch.device("cuda", 1)) == 44
    sigsoftmax = make_head("sigsoftmax", vocab_size=100_000)  # the generic path
    assert sigsoftmax.auto_chunk_tokens() == 256
    assert sigsoftmax.auto_chunk_tokens("cuda") == 2**26 // 100_000 == 671
