"""The retrofit protocol on a tiny random Llama built from a config (never downloaded)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the retrofit tests need the hf extra: pip install -e '.[hf]'"
)

from highrank.integrations.retrofit import (  # noqa: E402
    TrainBudget,
    batch_indices,
    cache_hidden_states,
    evaluate_head,
    head_from_lm_head,
    load_cache,
    train_head,
    window_tokens,
)

VOCAB = 97
WINDOW = 8


@pytest.fixture(scope="module")
def llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    return model


@pytest.fixture
def ids():
    return torch.randint(0, VOCAB, (8 * WINDOW + 3,), generator=torch.Generator().manual_seed(1))


def model_hidden_and_log_probs(model, ids):
    inputs, _ = window_tokens(ids, WINDOW)
    with torch.no_grad():
        out = model(input_ids=inputs, output_hidden_states=True)
    hidden = out.hidden_states[-1].reshape(-1, model.config.hidden_size)
    return hidden, torch.log_softmax(out.logits.float(), -1).reshape(-1, VOCAB)


def test_windows_are_non_overlapping_and_shifted(ids):
    inputs, targets = window_tokens(ids, WINDOW)
    assert inputs.shape == targets.shape == ((ids.numel() - 1) // WINDOW, WINDOW)
    assert torch.equal(inputs.reshape(-1), ids[: inputs.numel()])
    assert torch.equal(targets.reshape(-1), ids[1 : inputs.numel() + 1])


def test_bf16_cache_equals_the_models_hidden_states(llama, ids, tmp_path):
    cache = cache_hidden_states(llama, ids, tmp_path / "c", window=WINDOW, batch_windows=3)
    hidden, _ = model_hidden_and_log_probs(llama, ids)
    assert cache.features.dtype == torch.bfloat16
    assert torch.equal(cache.features, hidden.to(torch.bfloat16))
    assert torch.equal(cache.targets, window_tokens(ids, WINDOW)[1].reshape(-1))


def test_zero_step_softmax_reproduces_the_models_log_probs(llama, ids, tmp_path):
    cache = cache_hidden_states(llama, ids, tmp_path / "c", window=WINDOW, dtype="float32")
    hidden, log_probs = model_hidden_and_log_probs(llama, ids)
    assert torch.equal(cache.features, hidden)
    head = head_from_lm_head(llama, "softmax")
    with torch.no_grad():
        ours = head.log_prob(cache.rows(slice(None)))
    torch.testing.assert_close(ours, log_probs, atol=1e-5, rtol=0)
    # evaluate_head's perplexity and matrix come from the same log-probabilities
    result = evaluate_head(head, cache, block_tokens=5, matrix_path=tmp_path / "m.npy",
                           matrix_rows=20)
    nll = -log_probs.gather(1, cache.targets.unsqueeze(1)).double().mean()
    assert result["perplexity"] == pytest.approx(float(nll.exp()), rel=1e-6)
    np.testing.assert_allclose(np.load(tmp_path / "m.npy"), log_probs[:20].numpy(), atol=1e-5)


def test_the_head_is_an_untied_copy(llama):
    head = head_from_lm_head(llama, "mos", n_components=2)
    assert head.weight.data_ptr() != llama.get_output_embeddings().weight.data_ptr()
    assert torch.equal(head.weight, llama.get_output_embeddings().weight)
    assert torch.equal(head.bias, torch.zeros(VOCAB))


class Interrupted(RuntimeError):
    pass


def test_caching_resumes_where_it_stopped(llama, ids, tmp_path, monkeypatch):
    body = llama.base_model
    real_forward, calls = body.forward, []

    def failing_forward(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        if len(calls) == 2:
            raise Interrupted
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(body, "forward", failing_forward)
    with pytest.raises(Interrupted):
        cache_hidden_states(llama, ids, tmp_path / "c", window=WINDOW, batch_windows=3)
    progress = json.loads((tmp_path / "c" / "progress.json").read_text())
    assert progress == {"windows_done": 3, "complete": False}
    with pytest.raises(ValueError, match="unfinished cache"):
        load_cache(tmp_path / "c")
    calls.clear()
    def counting_forward(*args, **kwargs):
        calls.append(1)
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(body, "forward", counting_forward)
    cache = cache_hidden_states(llama, ids, tmp_path / "c", window=WINDOW, batch_windows=3)
    assert len(calls) == 2  # windows 3..5 and 6..7 only
    hidden, _ = model_hidden_and_log_probs(llama, ids)
    assert torch.equal(cache.features, hidden.to(torch.bfloat16))
    calls.clear()
    cache_hidden_states(llama, ids, tmp_path / "c", window=WINDOW, batch_windows=3)
    assert calls == []  # finished: loaded, nothing recomputed


def test_other_settings_are_refused_on_resume(llama, ids, tmp_path):
    cache_hidden_states(llama, ids, tmp_path / "c", window=WINDOW)
    message = r"meta.json was written with other settings \(n_windows, window differ"
    with pytest.raises(ValueError, match=message):
        cache_hidden_states(llama, ids, tmp_path / "c", window=WINDOW // 2)


@pytest.fixture
def cache(llama, ids, tmp_path):
    return cache_hidden_states(llama, ids, tmp_path / "cache", window=WINDOW)


@pytest.mark.parametrize(
    "name, knobs",
    [
        ("softmax", {}),
        ("mos", {"n_components": 2, "latent_dropout": 0.0}),
        ("mixtape", {"gate_dim": 4, "frequent_fraction": 0.3}),
        ("gss", {"center": -1.5, "slope": 3.0}),
    ],
)
def test_training_lowers_the_loss(llama, cache, tmp_path, name, knobs):
    head = head_from_lm_head(llama, name, **knobs)
    before = evaluate_head(head, cache)["nll_per_token"]
    budget = TrainBudget(steps=30, batch_tokens=32, lr=1e-2, warmup_steps=3)
    summary = train_head(head, cache, budget, tmp_path / "state.pt")
    after = evaluate_head(head, cache)["nll_per_token"]
    assert summary["complete"] and summary["steps_done"] == 30
    assert after < before - 0.1


def test_training_resumes_where_it_stopped(llama, cache, tmp_path):
    budget = TrainBudget(steps=6, batch_tokens=16, lr=1e-2, warmup_steps=2)
    torch.manual_seed(5)
    straight = head_from_lm_head(llama, "mixtape", gate_dim=4, gate_noise=0.1)
    train_head(straight, cache, budget, tmp_path / "straight.pt")

    torch.manual_seed(5)
    resumed = head_from_lm_head(llama, "mixtape", gate_dim=4, gate_noise=0.1)
    first = train_head(resumed, cache, budget, tmp_path / "resumed.pt", stop_after=4,
                       checkpoint_every=2)
    assert first["steps_done"] == 4 and not first["complete"]
    torch.manual_seed(123)  # the saved RNG state, not this one, drives the remaining steps
    fresh = head_from_lm_head(llama, "mixtape", gate_dim=4, gate_noise=0.1)
    second = train_head(fresh, cache, budget, tmp_path / "resumed.pt")
    assert second["steps_done"] == 6 and [h["step"] for h in second["history"]] == list(
        range(1, 7)
    )
    for (key, a), b in zip(straight.state_dict().items(), fresh.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=key)
    # a finished state is loaded; nothing more is trained
    again = train_head(head_from_lm_head(llama, "mixtape", gate_dim=4, gate_noise=0.1),
                       cache, budget, tmp_path / "resumed.pt")
    assert again["history"] == second["history"]


def test_batches_cover_the_cache_once_per_pass():
    budget = TrainBudget(steps=10, batch_tokens=4, lr=1e-3)
    rows = torch.cat([batch_indices(budget, 12, step) for step in range(3)])
    assert sorted(rows.tolist()) == list(range(12))
    assert torch.equal(batch_indices(budget, 12, 4), batch_indices(budget, 12, 4))


def test_bad_input_is_refused(llama, cache, tmp_path):
    with pytest.raises(ValueError, match="no window of 8 tokens"):
        window_tokens([1, 2, 3], WINDOW)
    with pytest.raises(ValueError, match="1-D sequence of integer ids"):
        window_tokens(torch.zeros(3, 3, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="dtype must be one of bfloat16, float32"):
        cache_hidden_states(llama, list(range(20)), tmp_path / "x", window=4, dtype="float16")
    with pytest.raises(TypeError, match="no linear output layer"):
        head_from_lm_head(torch.nn.Linear(3, 3), "softmax")
    with pytest.raises(FileNotFoundError, match="is not a feature cache"):
        load_cache(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="the head takes d_in=8 but .* size 16"):
        evaluate_head(head_from_lm_head_sized(8, VOCAB), cache)
    with pytest.raises(ValueError, match="target id .* outside the head's vocabulary of 10"):
        evaluate_head(head_from_lm_head_sized(16, 10), cache)
    with pytest.raises(ValueError, match="batch_tokens=1000 exceeds the 64 tokens"):
        train_head(head_from_lm_head(llama, "softmax"), cache,
                   TrainBudget(steps=1, batch_tokens=1000, lr=1e-3), tmp_path / "s.pt")
    with pytest.raises(ValueError, match="warmup_steps must be an int in"):
        TrainBudget(steps=3, batch_tokens=4, lr=1e-3, warmup_steps=5)
    with pytest.raises(ValueError, match="lr must be a positive finite number"):
        TrainBudget(steps=3, batch_tokens=4, lr=float("nan"))
    train_head(head_from_lm_head(llama, "softmax"), cache,
               TrainBudget(steps=1, batch_tokens=4, lr=1e-3), tmp_path / "s.pt")
    with pytest.raises(ValueError, match="s.pt was trained with budget"):
        train_head(head_from_lm_head(llama, "softmax"), cache,
                   TrainBudget(steps=2, batch_tokens=4, lr=1e-3), tmp_path / "s.pt")


def head_from_lm_head_sized(d_in, vocab_size):
    from highrank.heads import build_head

    return build_head("softmax", d_in=d_in, vocab_size=vocab_size)


def test_kl_from_a_reference_is_zero_for_itself_and_matches_a_direct_sum(llama, cache):
    head = head_from_lm_head(llama, "softmax")
    other = head_from_lm_head(llama, "softmax")
    with torch.no_grad():
        other.bias.normal_()
    assert evaluate_head(head, cache, reference=head)["kl_from_reference"] == pytest.approx(
        0.0, abs=1e-7)
    got = evaluate_head(other, cache, block_tokens=5, reference=head)
    with torch.no_grad():
        p, q = head.log_prob(cache.rows(slice(None))), other.log_prob(cache.rows(slice(None)))
    expected = float((p.exp() * (p - q)).sum(-1).mean())
    assert got["kl_from_reference"] == pytest.approx(expected, rel=1e-5)
    plain = evaluate_head(other, cache, block_tokens=5)
    assert plain["kl_from_reference"] is None and plain["perplexity"] == got["perplexity"]


@pytest.mark.parametrize(("name", "knobs", "apart"), [
    ("plif", {"n_pieces": 100}, [("head.slope_logits", 0.02)]),  # PLIF's slopes: their own lr
    ("mos", {"n_components": 2}, []),
])
def test_end_to_end_training_keeps_a_heads_own_learning_rates(llama, name, knobs, apart):
    """lora/full mode trains the head's parameters as frozen mode does: a group a head gives
    its own lr (:meth:`parameter_groups`) stays apart; the rest, body too, at --lr. PLIF's
    slopes trained at --lr in lora/full but at 0.02 in frozen mode."""
    import copy

    from highrank.integrations.hf import attach_head
    from highrank.integrations.retrofit.train import Trainee

    model = attach_head(copy.deepcopy(llama), name, **knobs).train().requires_grad_(True)
    trainee = Trainee.model(model, 1e-4)
    names = {id(p): n for n, p in model.named_parameters()}
    own = [([names[id(p)] for p in g["params"]], g["lr"]) for g in trainee.groups[1:]]
    assert own == [([param], lr) for param, lr in apart]
    assert trainee.groups[0]["lr"] == 1e-4
    grouped = [id(p) for g in trainee.groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())  # each once
    assert [id(p) for p in trainee.params] == [id(p) for p in model.parameters()]
