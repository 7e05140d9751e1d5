"""highrank heads inside transformers causal LMs (highrank.integrations.hf), for every head on
a tiny tied GPT-2 and an untied Llama: loss, log-probabilities, generation, save/load, Trainer,
gradients, and the errors of bad calls."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from highrank.heads import HEADS

from .conftest import BASES, VOCAB, tiny_gpt2, tiny_llama

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
hf = pytest.importorskip("highrank.integrations.hf", reason="the hf extra is not installed")

ALL = [(base, head) for head in HEADS for base in BASES]
# Trainer runs cost a second each: every head once, on the two bases in turn.
EVERY_HEAD_ONCE = [(sorted(BASES)[i % 2], head) for i, head in enumerate(HEADS)]


def manual_nll(log_probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean NLL of the next tokens from log-probs ``(B, T, V)``, shifted by hand."""
    targets, scores = labels[:, 1:], log_probs[:, :-1]
    valid = targets != -100
    return -scores[valid].gather(1, targets[valid][:, None]).mean()


# ---- the distribution and the loss -------------------------------------------------------


@pytest.mark.parametrize(
    "make_base", [tiny_gpt2, tiny_llama, lambda: tiny_llama(lm_head_bias=True)],
    ids=["gpt2-tied", "llama-untied", "llama-with-bias"],
)  # fmt: skip
def test_softmax_from_lm_head_gives_the_base_models_log_probabilities(make_base):
    base = make_base().eval()
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        expected = F.log_softmax(base(ids).logits.double(), dim=-1)
        model = hf.attach_head(base, "softmax").eval()
        got = model(ids).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("base", "head"), ALL)
def test_loss_is_the_mean_nll_of_the_returned_log_probs(attached, token_batch, base, head):
    model = attached(base, head)
    ids, labels = token_batch
    with torch.no_grad():
        out = model(ids, labels=labels)
        log_probs = model(ids).logits
        training = model.train()(ids, labels=labels)
    model.eval()
    assert training.logits is None  # training's loss path builds no (tokens x V) logits
    torch.testing.assert_close(out.logits, log_probs)  # evaluation returns them with the loss
    assert torch.allclose(log_probs.logsumexp(-1), torch.zeros(()), atol=1e-5)  # normalised
    torch.testing.assert_close(out.loss, manual_nll(log_probs, labels), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head", sorted(HEADS))
def test_chunked_loss_path_equals_the_unchunked_one(attached, token_batch, monkeypatch, head):
    """Tiny batches fit in one chunk; forcing 4-token chunks must change nothing, gradients
    included (the fused losses compute them chunk by chunk in the forward pass)."""
    ids, labels = token_batch

    def loss_and_grads(model):
        model.zero_grad()
        loss = model(ids, labels=labels).loss
        loss.backward()
        return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model = attached("llama", head)
    whole = loss_and_grads(model)
    monkeypatch.setattr(hf, "loss_chunk_tokens", lambda head, device=None: 4)
    chunked = loss_and_grads(model)
    torch.testing.assert_close(chunked[0], whole[0], atol=1e-6, rtol=1e-6)
    assert chunked[1].keys() == whole[1].keys()
    for name, grad in whole[1].items():
        torch.testing.assert_close(chunked[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_loss_chunks_hold_at_least_256_rows_of_logits():
    """At LLM vocabularies the heads' "auto" chunks are a few dozen tokens; the integration
    takes at least 256 rows of V logits per chunk (K rows per token for K components)."""
    from highrank.heads import build_head

    def chunk(name, **knobs):
        return hf.loss_chunk_tokens(build_head(name, d_in=4, vocab_size=49_152, **knobs))

    assert chunk("softmax") == 256  # auto would be 2**21 // 49,152 = 42
    assert chunk("mos", n_components=4) == 64  # 64 tokens x 4 components
    # Fused Mixtape: V + 12 S = 2.2 V values per token (S = 0.1 V), so 2 rows: 128 tokens.
    assert chunk("mixtape", gate_dim=2) == 128
    small = build_head("softmax", d_in=4, vocab_size=100)
    assert hf.loss_chunk_tokens(small) == small.auto_chunk_tokens()  # 20,971: the head's own


def test_loss_matches_transformers_own_loss_for_softmax(token_batch):
    base = tiny_llama().eval()
    ids, labels = token_batch
    with torch.no_grad():
        expected = base(ids, labels=labels).loss
        got = hf.attach_head(base, "softmax").eval()(ids, labels=labels).loss
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_num_items_in_batch_and_shift_labels_follow_transformers(attached, token_batch):
    model = attached("llama", "mos")
    ids, labels = token_batch
    n_valid = int((labels[:, 1:] != -100).sum())
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]  # what transformers passes as shift_labels
    with torch.no_grad():
        mean = model(ids, labels=labels).loss
        by_count = model(ids, labels=labels, num_items_in_batch=torch.tensor(40)).loss
        by_shifted = model(ids, shift_labels=shifted).loss
    torch.testing.assert_close(by_count, mean * n_valid / 40)
    torch.testing.assert_close(by_shifted, mean)


@pytest.mark.parametrize("head", sorted(HEADS))
def test_training_mode_with_padding_and_locked_dropout(attached, token_batch, head):
    """With -100 labels, heads whose dropout is locked over time score each sequence's valid
    rows together (flat rows would have no time axis); the loss is finite and trains."""
    model = attached("gpt2", head, stochastic=True).train()
    assert getattr(model.head, "dropout_time_dim", None) in (None, 1)
    ids, labels = token_batch
    loss = model(ids, labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0


@pytest.mark.parametrize("pad", [False, True], ids=["all-valid", "padded"])
def test_locked_dropout_masks_are_one_per_sequence(attached, token_batch, monkeypatch, pad):
    """MoS gets dropout_time_dim=1: every position of a sequence shares one latent-dropout
    mask, each sequence draws its own, with or without -100 labels."""
    import highrank.heads.mos as mos

    masks = []
    apply_mask = mos.apply_mask
    monkeypatch.setattr(mos, "apply_mask", lambda x, m: masks.append(m) or apply_mask(x, m))
    model = attached("llama", "mos", latent_dropout=0.5).train()
    ids, labels = token_batch
    model(ids, labels=labels if pad else ids)
    per_sequence = [m.view(-1, 8, m.shape[-1]) if not pad else m[None] for m in masks]
    assert len(per_sequence) == (3 if pad else 1)
    rows = torch.cat([s.unique(dim=1) for s in per_sequence])  # (sequences, 1, width)
    assert rows.shape[:2] == (3, 1)  # one mask within each sequence
    assert len(rows.unique(dim=0)) == 3  # and a different one for each


# ---- logits_to_keep ----------------------------------------------------------------------


def test_logits_to_keep(attached, token_batch):
    model = attached("llama", "mixtape")
    ids, labels = token_batch
    with torch.no_grad():
        full = model(ids).logits  # (3, 9, V)
        last2 = model(ids, logits_to_keep=2).logits
        picked = model(ids, logits_to_keep=torch.tensor([0, 4])).logits
        mask = torch.zeros(ids.shape, dtype=torch.bool)
        mask[0, 1] = mask[2, 5] = True
        masked = model(ids, logits_to_keep=mask).logits
        with_labels = model(ids, labels=labels, logits_to_keep=1)
        loss_only = model(ids, labels=labels)
    torch.testing.assert_close(last2, full[:, -2:])
    torch.testing.assert_close(picked, full[:, [0, 4]])
    torch.testing.assert_close(masked, full[mask])
    torch.testing.assert_close(with_labels.logits, full[:, -1:])
    torch.testing.assert_close(with_labels.loss, loss_only.loss)  # loss over all positions


# ---- generation ----------------------------------------------------------------------------


def greedy_by_hand(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Argmax decoding without a cache: the whole prefix is re-read at every step."""
    for _ in range(steps):
        with torch.no_grad():
            next_id = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=1)
    return ids


@pytest.mark.parametrize(("base", "head"), ALL)
def test_greedy_generate_equals_argmax_decoding_by_hand(attached, base, head):
    model = attached(base, head)
    ids = torch.randint(0, VOCAB, (2, 5))
    got = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False
    )
    torch.testing.assert_close(got, greedy_by_hand(model, ids, 6))


def test_generate_feeds_only_the_new_token_once_the_cache_holds_the_prefix(attached):
    model = attached("gpt2", "mixtape")
    lengths = []
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]),
        with_kwargs=True,
    )
    ids = torch.randint(0, VOCAB, (1, 5))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert lengths == [5, 1, 1, 1]


@contextlib.contextmanager
def transformers_warnings():
    """Every Python warning and every transformers log warning raised inside, as strings
    (transformers' ``warning_once`` cache is cleared first, so earlier tests hide nothing)."""
    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    root = hf_logging.get_logger()  # transformers' root logger, which does not propagate
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield seen
        seen.extend(str(w.message) for w in caught)
    finally:
        root.removeHandler(handler)


@pytest.mark.parametrize("base", sorted(BASES))
def test_forward_and_generate_use_the_current_cache_api_without_warnings(attached, base):
    """transformers 5.24 renamed past_key_values to cache (the old name warns on every call):
    the wrapper passes and returns the cache under the name the installed release uses."""
    model = attached(base, "mos")
    ids = torch.randint(0, VOCAB, (1, 5))
    with transformers_warnings() as seen:
        out = model(ids, use_cache=True)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert not [message for message in seen if "cache" in message], seen
    assert hf.CACHE in out.keys() and out[hf.CACHE].get_seq_length() == 5
    with torch.no_grad():  # the returned cache continues the sequence as the full prefix does
        next_id = torch.randint(0, VOCAB, (1, 1))
        step = model(next_id, **{hf.CACHE: out[hf.CACHE]}).logits
        torch.testing.assert_close(step[:, -1], model(torch.cat([ids, next_id], 1)).logits[:, -1])


@pytest.mark.parametrize(("base", "head"), ALL)
def test_beam_search_and_sampling_return_valid_sequences(attached, base, head):
    model = attached(base, head)
    ids = torch.randint(0, VOCAB, (2, 4))
    mask = torch.ones_like(ids)
    beams = model.generate(
        ids, attention_mask=mask, max_new_tokens=5, num_beams=3, num_return_sequences=2,
        do_sample=False, output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    sampled = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True, top_k=0)
    for sequences in (beams.sequences, sampled):
        assert sequences.shape[1] == 9 and sequences.min() >= 0 and sequences.max() < VOCAB
        assert torch.equal(sequences[:, :4].unique(dim=0), ids.unique(dim=0))
    assert beams.sequences.shape[0] == 4
    assert torch.isfinite(beams.sequences_scores).all() and (beams.sequences_scores <= 0).all()


# ---- save and load -----------------------------------------------------------------------


def comparable(config) -> dict:
    """A config as a dict, without what loading itself records (the folder, the dtype)."""
    out = config.to_dict()
    out.pop("_name_or_path")
    for part in (out, out["base_config"]):
        part.pop("dtype")
    return out


@pytest.mark.parametrize(("base", "head"), ALL)
def test_save_and_reload_with_automodel_gives_the_same_model(attached, tmp_path, base, head):
    model = attached(base, head)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is hf.HighrankForCausalLM
    assert type(reloaded.head) is type(model.head) and type(reloaded.model) is type(model.model)
    assert comparable(reloaded.config) == comparable(model.config)
    saved, loaded = model.state_dict(), reloaded.state_dict()
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    tied = reloaded.head.weight is reloaded.get_input_embeddings().weight
    assert tied == (base == "gpt2") == reloaded.config.tie_word_embeddings


def test_tying_survives_training_and_reload(tmp_path, token_batch):
    model = hf.attach_head(tiny_gpt2(), "sigsoftmax", init="paper")
    assert model.head.weight is model.get_input_embeddings().weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(token_batch[0], labels=token_batch[1]).loss.backward()
    optimizer.step()
    model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    embedding = reloaded.get_input_embeddings().weight
    assert reloaded.head.weight is embedding
    assert torch.equal(embedding, model.get_input_embeddings().weight)


# ---- training ------------------------------------------------------------------------------


@pytest.mark.parametrize(("base", "head"), ALL)
def test_gradients_reach_body_and_every_head_parameter(attached, token_batch, base, head):
    model = attached(base, head).train()
    ids, labels = token_batch
    model(ids, labels=labels).loss.backward()
    first_layer = next(p for n, p in model.model.named_parameters() if ".0." in n)
    assert first_layer.grad is not None and first_layer.grad.abs().sum() > 0
    for name, parameter in model.head.named_parameters():
        if parameter.requires_grad:
            assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


class _Sequences(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.mark.parametrize(("base", "head"), EVERY_HEAD_ONCE)
def test_three_trainer_steps_lower_the_loss(attached, tmp_path, base, head):
    model = attached(base, head)
    data = _Sequences(torch.randint(0, VOCAB, (4, 12)))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, learning_rate=1e-2, report_to="none",
        save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    # Trainer passes num_items_in_batch counted over labels[..., 1:] for causal-LM losses.
    assert model.loss_type == "ForCausalLM"
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    assert trainer.evaluate()["eval_loss"] < before


def test_trainer_evaluate_with_metrics_and_predict_get_the_log_probs(attached, tmp_path):
    """Issue 21: both crashed on the cache in the outputs, and predictions were empty."""
    model = attached("llama", "mos")
    data = _Sequences(torch.randint(0, VOCAB, (4, 12)))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to="none",
        use_cpu=True, disable_tqdm=True,
    )  # fmt: skip

    def metrics(prediction):
        log_probs, labels = prediction.predictions, prediction.label_ids
        right = (log_probs[:, :-1].argmax(-1) == labels[:, 1:]).mean()
        return {"next_token_accuracy": float(right)}

    trainer = transformers.Trainer(model=model, args=args, eval_dataset=data,
                                   compute_metrics=metrics)
    result = trainer.evaluate()
    assert 0.0 <= result["eval_next_token_accuracy"] <= 1.0
    predicted = trainer.predict(data)
    assert predicted.predictions.shape == (4, 12, VOCAB)
    sums = torch.from_numpy(predicted.predictions).double().logsumexp(-1)
    torch.testing.assert_close(sums, torch.zeros(4, 12, dtype=torch.float64), atol=1e-4, rtol=0)


# ---- bad calls ---------------------------------------------------------------------------


def one_line_error(error_type, call, *args, **kwargs) -> str:
    with pytest.raises(error_type) as caught:
        call(*args, **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_unknown_head_lists_the_valid_ones():
    message = one_line_error(ValueError, hf.attach_head, tiny_llama(), "nope")
    assert "'nope'" in message and all(name in message for name in HEADS)


def test_a_model_without_output_embeddings_is_refused():
    body = tiny_llama().model  # LlamaModel: no lm_head
    message = one_line_error(TypeError, hf.attach_head, body, "mos")
    assert "LlamaModel has no output embeddings" in message


def test_not_a_transformers_model_or_already_attached_is_refused():
    assert "got Linear" in one_line_error(
        TypeError, hf.attach_head, torch.nn.Linear(2, 2), "softmax"
    )
    attached = hf.attach_head(tiny_llama(), "softmax")
    assert "already has a highrank head" in one_line_error(
        TypeError, hf.attach_head, attached, "mos"
    )


def test_a_non_causal_model_is_refused():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        vocab_size=VOCAB,
    )  # fmt: skip
    message = one_line_error(TypeError, hf.attach_head, BertForMaskedLM(config), "softmax")
    assert "BertForMaskedLM is not a causal" in message


@pytest.mark.parametrize(
    ("knobs", "expected"),
    [
        ({"n_components": 2, "gate_dim": 3}, "head 'mos' has no knob(s) gate_dim; valid knobs:"),
        ({"tied_weight": None}, "tied_weight is set by attach_head"),
        ({"dropout_time_dim": 0}, "dropout_time_dim is set by attach_head"),
        ({"n_components": torch.tensor(2)}, "head knobs must be JSON values"),
    ],
)
def test_bad_knobs_give_one_clear_line(knobs, expected):
    message = one_line_error(TypeError, hf.attach_head, tiny_llama(), "mos", **knobs)
    assert expected in message


# ---- registration and optional import ----------------------------------------------------


def test_importing_the_module_registers_the_auto_classes():
    config = transformers.AutoConfig.for_model(
        "highrank", base_config=tiny_llama().config.to_dict(), head_name="mos"
    )
    assert isinstance(config, hf.HighrankConfig) and config.head_d_in == 32
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert isinstance(model, hf.HighrankForCausalLM) and model.config.vocab_size == VOCAB


def test_the_core_package_does_not_import_transformers():
    code = (
        "import sys, highrank, highrank.heads, highrank.integrations; "
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
