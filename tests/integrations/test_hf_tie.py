"""The tied/untied state in a saved config matches the saved tensors (issue 32 item 4): PEFT's
``modules_to_save=["head"]`` on a tied model trains a copy of the head, apart from the
embedding; merged and saved, the folder held both tensors under ``tie_word_embeddings=True``.
Tiny random GPT-2 (tied) and Llama (untied) models."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

hf = pytest.importorskip("highrank.integrations.hf", reason="the hf extra is not installed")
peft = pytest.importorskip("peft", reason="peft (the hf extra) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

EMBEDDING = "model.wte.weight"


def saved(folder) -> tuple[bool, dict[str, torch.Tensor]]:
    config = json.loads((folder / "config.json").read_text())
    return config["tie_word_embeddings"], load_file(folder / "model.safetensors")


def reload(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def train_lora_and_head(model, ids, labels, steps: int = 2):
    config = peft.LoraConfig(r=4, target_modules=["c_attn"], modules_to_save=["head"])
    tuned = peft.get_peft_model(model, config)
    optimizer = torch.optim.Adam([p for p in tuned.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        tuned(ids, labels=labels).loss.backward()
        optimizer.step()
    return tuned.eval()


def test_a_peft_trained_head_of_a_tied_model_saves_and_reloads_as_trained(
    attached, token_batch, tmp_path
):
    model = attached("gpt2", "mos")
    assert model.config.tie_word_embeddings
    embedding = model.get_input_embeddings().weight.detach().clone()
    ids, labels = token_batch
    tuned = train_lora_and_head(model, ids, labels)
    with torch.no_grad():
        expected = tuned(ids).logits
    tuned.save_pretrained(tmp_path / "adapter")  # the adapter: LoRA and the trained head copy
    merged = tuned.merge_and_unload()
    trained = merged.head.weight.detach().clone()
    assert not torch.equal(trained, embedding)  # the head's decoder trained, apart
    torch.testing.assert_close(merged.get_input_embeddings().weight, embedding)
    merged.save_pretrained(tmp_path / "merged")

    tied, tensors = saved(tmp_path / "merged")
    assert tied is False and merged.config.tie_word_embeddings is False
    assert torch.equal(tensors["head.weight"], trained)
    assert torch.equal(tensors[EMBEDDING], embedding)
    back = reload(tmp_path / "merged")
    assert back.head.weight is not back.get_input_embeddings().weight
    assert torch.equal(back.head.weight, trained)
    assert torch.equal(back.get_input_embeddings().weight, embedding)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, expected)
    # ... and saved again, it stays what it is.
    back.save_pretrained(tmp_path / "again")
    assert saved(tmp_path / "again")[0] is False


def test_a_tied_model_saves_tied_and_a_tie_made_later_is_saved(attached, tmp_path):
    """The other direction: a tie the config does not record is recorded (one tensor saved,
    reloaded as one Parameter); a model that never changed saves as before."""
    model = attached("gpt2", "mos")
    model.save_pretrained(tmp_path / "tied")
    tied, tensors = saved(tmp_path / "tied")
    assert tied is True and "head.weight" not in tensors
    back = reload(tmp_path / "tied")
    assert back.head.weight is back.get_input_embeddings().weight

    untied = attached("gpt2", "mos", untie=True)
    assert untied.config.tie_word_embeddings is False
    untied.head.weight = untied.get_input_embeddings().weight  # tied by hand
    untied.save_pretrained(tmp_path / "retied")
    tied, tensors = saved(tmp_path / "retied")
    assert tied is True and len([k for k in tensors if k in ("head.weight", EMBEDDING)]) == 1
    back = reload(tmp_path / "retied")
    assert back.head.weight is back.get_input_embeddings().weight
    assert torch.equal(back.head.weight, untied.head.weight)


def test_the_adapter_of_a_tied_model_reloads_onto_its_base(attached, token_batch, tmp_path):
    """PEFT's own save (adapter and trained head copy) reloads onto the saved base."""
    model = attached("gpt2", "mos")
    model.save_pretrained(tmp_path / "base")
    ids, labels = token_batch
    tuned = train_lora_and_head(model, ids, labels)
    with torch.no_grad():
        expected = tuned(ids).logits
    tuned.save_pretrained(tmp_path / "adapter")
    fresh = peft.PeftModel.from_pretrained(reload(tmp_path / "base"), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, expected)


def test_another_output_width_on_a_tied_model_names_untie():
    """A new user's walk: ``attach_head(gpt2, "mfs", d_embed=16, init="paper")`` said
    "tied_weight has shape (V, 32); expected (V, 16)", a knob the user never passed."""
    from tests.integrations.conftest import tiny_gpt2

    with pytest.raises(ValueError, match=r"^d_embed=16 asks for an output embedding of another "
                       r"width .* ties to its input embedding \(100, 32\): pass untie=True"):
        hf.attach_head(tiny_gpt2(), "mfs", d_embed=16, init="paper")
    untied = hf.attach_head(tiny_gpt2(), "mfs", d_embed=16, init="paper", untie=True)
    assert untied.head.weight.shape == (100, 16) and not untied.config.tie_word_embeddings
    with pytest.raises(ValueError, match=r"^init='base' needs the head's decoder to be "
                       r"lm_head's \(100, 32\) matrix, but d_embed makes it \(100, 16\)"):
        hf.attach_head(tiny_gpt2(), "mos", d_embed=16)  # untie=True would not help: said first
    same = hf.attach_head(tiny_gpt2(), "mos", d_embed=None, n_components=2)  # the model's width
    assert same.config.tie_word_embeddings
    assert same.head.weight is same.model.get_input_embeddings().weight
