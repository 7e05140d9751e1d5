"""TRL (issue 21, item 1): SFTTrainer trains a highrank model's own loss, with TRL's
token-accuracy and entropy metrics computed from the head's distribution, no subclass needed.
Tiny random GPT-2 / Llama models and a word-level tokenizer built here."""

from __future__ import annotations

import math

import pytest
import torch

from .conftest import VOCAB, word_tokenizer

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
hf = pytest.importorskip("highrank.integrations.hf", reason="the hf extra is not installed")
trl = pytest.importorskip(
    "trl", reason="trl is not installed (the clients extra: pip install -e '.[clients]')"
)
datasets = pytest.importorskip("datasets", reason="datasets (a trl dependency) is not installed")

PAD = 0


def fused_fields_by_hand(model, ids, labels):
    """The head's next-token log p(label), entropy and top-1 hits, from its full log-probs."""
    with torch.no_grad():
        log_p = model(ids).logits[:, :-1]
    targets = labels[:, 1:]
    valid = targets != -100
    picked = log_p.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    top1 = log_p.argmax(-1) == targets
    return [torch.where(valid, x, 0) for x in (picked, entropy, top1)] + [valid]


@pytest.mark.parametrize("head", ["softmax", "mos", "mixtape", "gss", "mfs", "cpr"])
def test_trls_fused_lm_head_gets_the_heads_own_fields(attached, token_batch, head):
    from trl.trainer.utils import add_fused_lm_head

    model = attached("gpt2", head)
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    ids, labels = token_batch
    with torch.no_grad():
        out = model(ids, labels=labels, fused_lm_head=True)
        own_loss = model(ids, labels=labels).loss
    log_p, entropy, top1, valid = fused_fields_by_hand(model, ids, labels)
    torch.testing.assert_close(out.log_probs, log_p, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.entropy, entropy, atol=1e-5, rtol=1e-5)
    assert torch.equal(out.is_top1, top1) and torch.equal(out.label_mask, valid)
    torch.testing.assert_close(out.loss, own_loss, atol=1e-5, rtol=1e-5)
    assert out.log_sum_sq_probs is None and out.mean_logits is None  # not asked for, as in TRL


def test_the_fields_dpo_asks_for_on_a_softmax_head_are_the_base_models(token_batch):
    """DPO's mean_logits and WPO's log_sum_sq_probs: for a softmax head, those of the base
    model's own logits (TRL's kernel on the base would compute the same)."""
    from trl.trainer.utils import add_fused_lm_head

    from .conftest import tiny_llama

    base = tiny_llama().eval()
    ids, labels = token_batch
    with torch.no_grad():
        logits = base(ids).logits[:, :-1].float()
    model = hf.attach_head(base, "softmax").eval()
    add_fused_lm_head(model, outputs=("log_probs", "mean_logits", "log_sum_sq_probs"))
    with torch.no_grad():
        out = model(ids, labels=labels, fused_lm_head=True)
    valid = labels[:, 1:] != -100
    mean_logits = torch.where(valid, logits.mean(-1), 0)
    log_sum_sq = torch.where(valid, torch.logsumexp(2 * logits.log_softmax(-1), -1), 0)
    torch.testing.assert_close(out.mean_logits, mean_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.log_sum_sq_probs, log_sum_sq, atol=1e-5, rtol=1e-5)
    assert out.entropy is None and out.is_top1 is None


@pytest.mark.parametrize("head", ["mos", "cpr"])
def test_shift_labels_give_the_fields_of_labels_and_one_more_position(attached, token_batch, head):
    """transformers' labels (shifted inside: T - 1 positions) and already-shifted
    shift_labels (T positions, the last ignored) score the same tokens; the context heads take
    their own path (hf_fused._fused_context_output)."""
    from trl.trainer.utils import add_fused_lm_head

    from highrank.integrations.hf_context import shifted_targets

    model = attached("llama", head)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    ids, labels = token_batch
    with torch.no_grad():
        by_labels = model(ids, labels=labels, fused_lm_head=True)
        shifted = model(ids, shift_labels=shifted_targets(labels, -100), fused_lm_head=True)
    assert by_labels.log_probs.shape == (ids.shape[0], ids.shape[1] - 1)
    assert shifted.log_probs.shape == ids.shape and not shifted.label_mask[:, -1].any()
    torch.testing.assert_close(shifted.log_probs[:, :-1], by_labels.log_probs)
    torch.testing.assert_close(shifted.entropy[:, :-1], by_labels.entropy)
    torch.testing.assert_close(shifted.loss, by_labels.loss)


@pytest.mark.parametrize("head", ["mos", "cpr"])
def test_fused_fields_train_with_chunks_and_gradients(attached, token_batch, monkeypatch, head):
    """Chunked (4 tokens) with gradients: the loss's gradients equal those of the own loss
    (CPR: its context's layers and ids, chunked as the head's own loss chunks them)."""
    from trl.trainer.utils import add_fused_lm_head

    model = attached("llama", head)
    add_fused_lm_head(model)
    ids, labels = token_batch

    def grads(**options):
        model.zero_grad()
        model(ids, labels=labels, **options).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    own = grads()
    monkeypatch.setattr(hf, "loss_chunk_tokens", lambda head, device=None: 4)
    fused = grads(fused_lm_head=True)
    assert fused.keys() == own.keys()
    for name, grad in own.items():
        torch.testing.assert_close(fused[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_a_temperature_trl_asks_for_is_refused_in_one_line(attached):
    from trl.trainer.utils import add_fused_lm_head

    model = attached("gpt2", "mos")
    with pytest.raises(ValueError, match="temperature 0.7; a highrank head scores"):
        add_fused_lm_head(model, temperature=0.7)


def sft_data(n: int, length: int):
    ids = torch.randint(3, VOCAB, (n, length)).tolist()
    return datasets.Dataset.from_dict({"text": [" ".join(f"w{i}" for i in row) for row in ids]})


@pytest.mark.parametrize(
    ("base", "head"), [("gpt2", "mos"), ("llama", "mixtape"), ("llama", "cpr")]
)
def test_sft_trainer_trains_the_heads_loss_with_right_metrics(attached, tmp_path, base, head):
    model = attached(base, head)
    args = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, learning_rate=1e-2, report_to="none", save_strategy="no",
        logging_steps=1, use_cpu=True, disable_tqdm=True, max_length=16, bf16=False,
    )  # fmt: skip
    data = sft_data(4, 10)
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=data, eval_dataset=data,
        processing_class=word_tokenizer(),
    )  # fmt: skip
    before = trainer.evaluate()
    # The metrics TRL logs are those of the head's distribution, computed here by hand.
    batch = trainer.data_collator([trainer.eval_dataset[i] for i in range(4)])
    model.eval()
    log_p, entropy, top1, valid = fused_fields_by_hand(model, batch["input_ids"], batch["labels"])
    n = valid.sum()
    assert math.isclose(before["eval_loss"], float(-log_p.sum() / n), rel_tol=1e-5)
    assert math.isclose(before["eval_entropy"], float(entropy.sum() / n), rel_tol=1e-5)
    assert math.isclose(before["eval_mean_token_accuracy"], float(top1.sum() / n), rel_tol=1e-6)
    trainer.train()
    assert trainer.evaluate()["eval_loss"] < before["eval_loss"]
    logged = [e for e in trainer.state.log_history if "entropy" in e and "loss" in e]
    assert len(logged) == 4 and all(0 <= e["mean_token_accuracy"] <= 1 for e in logged)


def test_sft_trainer_with_a_peft_config_trains_lora_adapters_and_the_head(attached, tmp_path):
    peft = pytest.importorskip("peft", reason="peft (the hf extra) is not installed")
    model = attached("llama", "mos")
    head_before = model.head.weight.detach().clone()
    args = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
        learning_rate=1e-2, report_to="none", save_strategy="no", logging_steps=1,
        use_cpu=True, disable_tqdm=True, max_length=16,
    )  # fmt: skip
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["head"])
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=sft_data(4, 10),
        processing_class=word_tokenizer(), peft_config=lora,
    )  # fmt: skip
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3 and losses[-1] < losses[0]
    wrapper = model.head  # PEFT's ModulesToSaveWrapper: the original and a trained copy
    assert torch.equal(wrapper.original_module.weight, head_before)
    assert not torch.equal(wrapper.modules_to_save["default"].weight, head_before)
