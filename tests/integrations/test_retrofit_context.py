"""`highrank retrofit` with the heads that read their context (MFS, CPR), in every mode: lora
and full train on windows through HighrankForCausalLM; frozen mode caches the layers those
heads read with the windows' first token (a *sequence cache*) and trains the head on whole
windows of it. Either way the saved model, reloaded, scores what the run recorded."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="retrofit needs the hf extra")

from highrank.cli import main  # noqa: E402
from highrank.integrations.hf import attach_head  # noqa: E402
from highrank.integrations.retrofit import (  # noqa: E402
    TrainBudget,
    cache_hidden_states,
    load_cache,
    train_head,
    window_tokens,
)
from tests.analysis.test_hf_contexts import save_tiny_model, write_text  # noqa: E402
from tests.integrations.test_retrofit_command import command, reloaded_perplexity  # noqa: E402

CPR_KNOBS = ("--knob", "reranker_k1=10", "--knob", "reranker_k2=4")


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("context-heads")
    files = {split: write_text(root / f"{split}.txt", n_words=n, seed=i)
             for i, (split, n) in enumerate((("train", 200), ("valid", 60), ("test", 60)))}
    return save_tiny_model(root / "model", "llama"), files


@pytest.mark.parametrize(
    ("mode", "head"),
    [("full", "cpr"), ("full", "mfs"), ("lora", "cpr"), ("frozen", "cpr"), ("frozen", "mfs")],
)
def test_every_mode_retrofits_heads_that_read_their_context(texts, tmp_path, mode, head):
    if mode == "lora":
        pytest.importorskip("peft", reason="--mode lora needs peft")
    model, files = texts
    out = tmp_path / "out"
    extra = CPR_KNOBS if head == "cpr" else ()
    assert main(command(model, files, out, "--head", head, "--mode", mode, "--lr", "1e-2",
                        *extra)) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["training"]["complete"]
    if mode == "frozen":  # whole windows a step: --batch-tokens 16 // --window 8
        assert results["training"]["budget"]["batch_tokens"] == 2
        assert load_cache(out / "cache-train").layers == 3  # both read 3 layers by default
    for split in ("valid", "test"):
        assert results["trained"][split]["perplexity"] == pytest.approx(
            reloaded_perplexity(out / "model", files[split]), rel=1e-4)


@pytest.fixture(scope="module")
def tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_a_sequence_cache_gives_the_head_what_the_live_model_does(tiny_llama, tmp_path):
    ids = torch.randint(0, 50, (5 * 8 + 1,), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(1)
    model = attach_head(tiny_llama, "cpr", init="base", untie=True, input_layers=3,
                        reranker_k1=10, reranker_k2=4)
    cache = cache_hidden_states(tiny_llama, ids, tmp_path / "cache", window=8, dtype="float32",
                                layers=3)
    inputs, targets = window_tokens(ids, 8)
    with torch.no_grad():
        live = model(input_ids=inputs).logits  # (W, 8, V), normalised
        hidden, head_inputs, cached_targets = cache.windows(torch.arange(5), reads=model.head.reads)
        cached = model.head.log_prob(hidden, **head_inputs)
    torch.testing.assert_close(cached_targets, targets, rtol=0, atol=0)
    torch.testing.assert_close(head_inputs["context_ids"], inputs, rtol=0, atol=0)
    torch.testing.assert_close(cached, live, rtol=1e-5, atol=1e-5)
    assert load_cache(tmp_path / "cache").layers == 3  # and it reopens as one


def test_a_context_head_refuses_a_cache_without_its_layers(tiny_llama, tmp_path):
    ids = torch.randint(0, 50, (3 * 8 + 1,), generator=torch.Generator().manual_seed(4))
    tokens = cache_hidden_states(tiny_llama, ids, tmp_path / "tokens", window=8)
    model = attach_head(tiny_llama, "mfs", init="base", untie=True, input_layers=2)
    budget = TrainBudget(steps=2, batch_tokens=1, lr=1e-3)
    with pytest.raises(ValueError, match="reads the last 2 layers.*final hidden states only"):
        train_head(model.head, tokens, budget, tmp_path / "state.pt")
    three = cache_hidden_states(tiny_llama, ids, tmp_path / "three", window=8, layers=3)
    with pytest.raises(ValueError, match="holds the last 3 layers: cache again with layers=2"):
        train_head(model.head, three, budget, tmp_path / "state.pt")


def test_a_context_head_resumes_bit_for_bit(tiny_llama, tmp_path):
    ids = torch.randint(0, 50, (6 * 8 + 1,), generator=torch.Generator().manual_seed(5))
    cache = cache_hidden_states(tiny_llama, ids, tmp_path / "cache", window=8, layers=2)
    budget = TrainBudget(steps=6, batch_tokens=2, lr=1e-2, warmup_steps=2)

    def head():
        torch.manual_seed(7)
        return attach_head(tiny_llama, "mfs", init="base", untie=True, input_layers=2).head

    straight = head()
    train_head(straight, cache, budget, tmp_path / "straight.pt")
    resumed = head()
    first = train_head(resumed, cache, budget, tmp_path / "resumed.pt", stop_after=4,
                       checkpoint_every=2)
    assert first["steps_done"] == 4
    fresh = head()
    train_head(fresh, cache, budget, tmp_path / "resumed.pt")
    for (key, a), b in zip(straight.state_dict().items(), fresh.state_dict().values(),
                           strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=key)
    assert any(not torch.equal(a, b) for a, b in zip(
        straight.state_dict().values(), head().state_dict().values(), strict=True))


def test_seen_in_window_marks_targets_already_in_their_context(tiny_llama, tmp_path):
    ids = torch.randint(0, 12, (4 * 8 + 1,), generator=torch.Generator().manual_seed(6))
    cache = cache_hidden_states(tiny_llama, ids, tmp_path / "cache", window=8, layers=1)
    inputs, targets = window_tokens(ids, 8)
    expected = [[bool((inputs[w, : t + 1] == targets[w, t]).any()) for t in range(8)]
                for w in range(4)]
    seen = cache.seen_in_window(block=3)  # blocks that do not divide the windows
    assert seen.tolist() == [flag for window in expected for flag in window]
    assert 0 < int(seen.sum()) < seen.numel()  # both kinds present: the check can fail


def test_the_score_of_groups_of_rows_adds_up_to_the_whole(tiny_llama, tmp_path):
    from highrank.integrations.retrofit import evaluate_head, head_from_lm_head

    ids = torch.randint(0, 12, (4 * 8 + 1,), generator=torch.Generator().manual_seed(6))
    cache = cache_hidden_states(tiny_llama, ids, tmp_path / "cache", window=8, layers=2)
    seen = cache.seen_in_window()
    head = attach_head(tiny_llama, "cpr", init="base", untie=True, input_layers=2,
                       reranker_k1=10, reranker_k2=4).head
    base = head_from_lm_head(tiny_llama, "softmax")
    whole = evaluate_head(head, cache, block_tokens=16, reference=base,
                          groups={"seen": seen, "unseen": ~seen})
    parts = whole["groups"]
    assert parts["seen"]["tokens"] + parts["unseen"]["tokens"] == whole["tokens"] == 32
    total = sum(p["nll_per_token"] * p["tokens"] for p in parts.values())
    assert total == pytest.approx(whole["nll_per_token"] * whole["tokens"], rel=1e-9)
    kl = sum(p["kl_from_reference"] * p["tokens"] for p in parts.values())
    assert kl == pytest.approx(whole["kl_from_reference"] * whole["tokens"], rel=1e-6, abs=1e-9)
    with pytest.raises(ValueError, match="must be a bool mask of the 32 cached rows"):
        evaluate_head(head, cache, groups={"bad": seen[:5]})


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_sequence_cache_top_layer_is_the_token_cache(tiny_llama, tmp_path, dtype):
    """A plain head reads a sequence cache's top layer: the very values of a token cache
    (a study may compare heads trained on either)."""
    ids = torch.randint(0, 50, (5 * 8 + 1,), generator=torch.Generator().manual_seed(8))
    tokens = cache_hidden_states(tiny_llama, ids, tmp_path / "t", window=8, dtype=dtype,
                                 batch_windows=2)
    sequence = cache_hidden_states(tiny_llama, ids, tmp_path / "s", window=8, dtype=dtype,
                                   batch_windows=2, layers=3)
    assert torch.equal(tokens.rows(slice(None)), sequence.rows(slice(None)))
    assert torch.equal(tokens.targets, sequence.targets)


def randomised(head):
    """``head`` with every parameter random and away from 0 (C, P, R and Mi all act)."""
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(0.3 * torch.randn_like(param))
    return head


def test_a_sequence_cache_feeds_position_t_the_tokens_and_states_up_to_t(tiny_llama, tmp_path):
    """Leak guard for the sequence cache (cache.py): in a stream whose ids are their own
    positions, row t of window w reads the ids w L .. w L + t (the input at t last, never the
    target w L + t + 1) and scores the target w L + t + 1; its hidden state and layers are
    those of the body run on the tokens up to t alone (nothing later reached them). The same
    holds for the batches ``train_head`` hands the head's loss."""
    stream = torch.arange(5 * 8 + 1)  # id == position
    cache = cache_hidden_states(tiny_llama, stream, tmp_path / "cache", window=8,
                                dtype="float32", layers=3)
    hidden, inputs, targets = cache.windows(torch.arange(5))
    expected = torch.arange(5)[:, None] * 8 + torch.arange(8)  # (w, t) -> w L + t
    assert torch.equal(inputs["context_ids"], expected)
    assert torch.equal(targets, expected + 1)
    assert torch.equal(hidden, inputs["layers"][-1])
    with torch.no_grad():
        for w in (0, 3):
            for t in range(8):
                prefix = stream[w * 8 : w * 8 + t + 1][None]
                states = tiny_llama.model(prefix, output_hidden_states=True).hidden_states
                for layer, state in zip(inputs["layers"][:-1], states[-3:-1], strict=True):
                    torch.testing.assert_close(layer[w, t], state[0, -1], atol=1e-5, rtol=0)
                top = tiny_llama.model(prefix).last_hidden_state[0, -1]
                torch.testing.assert_close(hidden[w, t], top, atol=1e-5, rtol=0)
    head = attach_head(tiny_llama, "cpr", init="base", untie=True, input_layers=3,
                       reranker_k1=10, reranker_k2=4).head
    seen = []
    loss = head.loss

    def spy(hidden, target, **given):
        seen.append((hidden.detach().clone(), target.clone(), given["context_ids"].clone()))
        return loss(hidden, target, **given)

    head.loss = spy  # what train_head's steps hand the head
    train_head(head, cache, TrainBudget(steps=3, batch_tokens=2, lr=1e-3), tmp_path / "s.pt")
    assert len(seen) == 3
    for batch_hidden, batch_targets, batch_ids in seen:
        windows = batch_ids[:, 0] // 8
        assert torch.equal(batch_ids, expected[windows])
        assert torch.equal(batch_targets, expected[windows] + 1)
        assert torch.equal(batch_hidden, hidden[windows])


@pytest.mark.parametrize("name", ["mfs", "cpr"])
def test_a_later_token_changes_no_earlier_row_of_the_cached_scores(tiny_llama, tmp_path, name):
    """Leak guard for the study's path (cache_hidden_states(..., layers=3), load_cache,
    evaluate_head): changing the stream from token p on (the target of row p - 1 included)
    leaves every row before p of the scored matrix as it was; row p moves (the check can
    fail). Several windows to a block of evaluate_head, p inside a window."""
    from highrank.integrations.retrofit import evaluate_head

    knobs = {"reranker_k1": 10, "reranker_k2": 4} if name == "cpr" else {}
    torch.manual_seed(2)
    head = randomised(attach_head(tiny_llama, name, untie=True, input_layers=3, **knobs).head)
    ids = torch.randint(0, 12, (5 * 8 + 1,), generator=torch.Generator().manual_seed(9))
    matrices = {}
    for p in (None, 13, 21):  # window 1 position 5; window 2 position 5
        stream = ids.clone()
        if p is not None:
            stream[p:] = (ids[p:] + 1) % 12
        folder = tmp_path / f"cache-{p}"
        cache_hidden_states(tiny_llama, stream, folder, window=8, dtype="float32", layers=3)
        evaluate_head(head, load_cache(folder), block_tokens=16, matrix_path=folder / "m.npy")
        matrices[p] = torch.from_numpy(np.load(folder / "m.npy"))
    for p in (13, 21):
        torch.testing.assert_close(matrices[p][:p], matrices[None][:p], atol=1e-6, rtol=0)
        assert not torch.allclose(matrices[p][p], matrices[None][p], atol=1e-4)


def test_seen_in_window_counts_only_the_inputs_up_to_the_position(tiny_llama, tmp_path):
    """Leak guard for the seen / unseen split of the study (``seen_in_window``), on a
    hand-made stream: a target is seen when it occurred among its window's input tokens up to
    and including the input at its own position; not when it occurs only later in the window
    (as the next input, which it is), nor only in an earlier window."""
    stream = torch.tensor([4, 7, 4, 9, 9, 2, 7, 5, 5])
    # window 0: inputs 4 7 4 9, targets 7 4 9 9; window 1: inputs 9 2 7 5, targets 2 7 5 5
    cache = cache_hidden_states(tiny_llama, stream, tmp_path / "cache", window=4, layers=1)
    expected = [False, True, False, True,  # 9 at t = 2 is the next input only; at t = 3 it
                False, False, False, True]  # is the current one; 7 in window 1 is not seen
    assert cache.seen_in_window().tolist() == expected
    assert cache.seen_in_window(block=1).tolist() == expected
