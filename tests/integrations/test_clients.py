"""The other tools of the "works with" table (docs/works-with.md), on a highrank model:
the text-generation pipeline, PEFT LoRA adapters saved and reloaded, bfloat16, and
torch.compile. Tiny random Llama models and a word-level tokenizer built here."""

from __future__ import annotations

import pytest
import torch

from .conftest import VOCAB, word_tokenizer

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
hf = pytest.importorskip("highrank.integrations.hf", reason="the hf extra is not installed")


def test_the_text_generation_pipeline_continues_as_generate_does(attached):
    model = attached("llama", "mixtape")
    tokenizer = word_tokenizer()
    prompt = "w5 w17 w42 w8"
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                            do_sample=False)  # fmt: skip
    generator = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    (out,) = generator(prompt, max_new_tokens=5, do_sample=False, return_tensors=True)
    assert out["generated_token_ids"] == tokens[0].tolist()
    # As text: the prompt, then the new tokens decoded (joined without a space, as the pipeline
    # joins them for a tokenizer without a decoder).
    (text,) = generator(prompt, max_new_tokens=5, do_sample=False)
    assert text["generated_text"] == prompt + tokenizer.decode(tokens[0, ids.shape[1] :])


def test_peft_lora_adapters_train_save_and_reload(attached, token_batch, tmp_path):
    peft = pytest.importorskip("peft", reason="peft (the hf extra) is not installed")
    model = attached("llama", "mos")
    model.save_pretrained(tmp_path / "base")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["head"])
    tuned = peft.get_peft_model(model, config)
    ids, labels = token_batch
    optimizer = torch.optim.Adam([p for p in tuned.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        tuned(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    tuned.eval()
    tuned.save_pretrained(tmp_path / "adapter")
    fresh = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    with torch.no_grad():
        untuned = fresh(ids).logits
        reloaded = peft.PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
        expected = tuned(input_ids=ids).logits
        assert not torch.allclose(expected, untuned)  # the adapters and the head's copy moved
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected)


@pytest.mark.parametrize("head", ["softmax", "mos", "mixtape"])
def test_a_bfloat16_model_gives_float32_log_probs_and_generates(attached, token_batch, head):
    model = attached("llama", head)
    ids, labels = token_batch
    with torch.no_grad():
        reference = model(ids).logits
        model.to(torch.bfloat16)
        log_probs = model(ids).logits
        loss = model(ids, labels=labels).loss
    assert log_probs.dtype == torch.float32
    torch.testing.assert_close(log_probs.logsumexp(-1), torch.zeros(ids.shape), atol=1e-5, rtol=0)
    assert (log_probs - reference).abs().max() < 0.1  # bf16 weights: about 3 digits
    assert torch.isfinite(loss)
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3)
    assert tokens.shape == (3, 12) and int(tokens.max()) < VOCAB


@pytest.mark.slow  # compiling a model takes half a minute or more on a CPU
def test_torch_compile_of_the_model_matches_eager(attached, token_batch):
    model = attached("llama", "mos")
    ids, labels = token_batch
    compiled = torch.compile(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits)
        torch.testing.assert_close(
            compiled(ids, labels=labels).loss, model(ids, labels=labels).loss
        )
