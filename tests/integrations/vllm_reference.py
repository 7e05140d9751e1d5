"""Tiny highrank models for the vLLM test, and what highrank itself generates with them.

Run by tests/integrations/test_vllm.py with a Python that has the hf extra (transformers 5.23
or later, which vLLM's environment cannot have): ``python vllm_reference.py OUT_DIR``. For
each model in MODELS it saves ``OUT_DIR/NAME`` (``save_pretrained``) and writes
``OUT_DIR/reference.json``: per model and prompt, the greedy tokens of
``HighrankForCausalLM.generate`` and the full log-probability row the model gives before each
generated token (``forward`` without labels: the head's normalised log-probabilities).

The bodies are random Llama, Qwen2 and GPT-2 models with a head dimension of 64 (vLLM's CPU
attention refuses 16),
drawn with a wide initialisation so that the distributions are far from uniform; heads keep
their papers' random initialisation (``init="paper"``) and get a random bias, so that no head
is the base model's ``lm_head``: ``differs_from_base`` records the largest gap between the
head's and the base's log-probabilities.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

PROMPTS = [[5, 17, 42, 9], [1, 2, 3, 4, 5, 6, 7], [250, 11, 99, 180, 3, 64, 64, 12, 7, 201, 33]]
NEW_TOKENS = 8
VOCAB = 300  # not a multiple of 64: vLLM pads its embedding rows, the head must not see them
# name: (base, head, knobs, tied)
MODELS = {
    "llama-mos-tied": ("llama", "mos", {"n_components": 3}, True),
    "llama-softmax-untied": ("llama", "softmax", {}, False),
    "qwen2-mixtape-tied": ("qwen2", "mixtape", {"gate_dim": 4, "frequent_fraction": 0.3}, True),
    "gpt2-moc-untied": ("gpt2", "moc", {"n_components": 3}, False),
    "llama-sigsoftmax-untied": ("llama", "sigsoftmax", {}, False),
    "llama-gss-tied": ("llama", "gss", {}, True),
    "llama-plif-tied": ("llama", "plif", {"n_pieces": 1000}, True),
    "llama-mlp_softmax-untied": ("llama", "mlp_softmax", {"mlp_width": 64}, False),
}
# Folders the plugin must refuse in one line, and what the line must name: a base architecture
# vLLM has no model of its own for (GPT-Neo, in vLLM 0.32), which vLLM's Transformers backend
# would read with a plain softmax; a head that reads more than the last hidden state (MFS).
REFUSED = {"gpt-neo-mos": "gpt_neo", "llama-mfs": "layers"}


def tiny_base(kind: str, tied: bool):
    """A random causal LM: 2 layers, hidden 128, 2 attention heads of 64, V = VOCAB."""
    import transformers

    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=2, n_positions=64,
            initializer_range=0.2, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config).eval()
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    config = config_class(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        initializer_range=0.2, tie_word_embeddings=tied,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return model_class(config).eval()


@torch.no_grad()
def reference(model) -> list[dict]:
    """Greedy tokens and the log-probability rows before each, prompt by prompt."""
    results = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0)
        assert out.shape[1] == len(prompt) + NEW_TOKENS, "generation stopped early"
        log_probs = model(out[:, :-1]).logits[0, len(prompt) - 1 :]  # (NEW_TOKENS, V)
        tokens = out[0, len(prompt) :].tolist()
        results.append({"prompt": prompt, "tokens": tokens, "log_probs": log_probs.tolist()})
    return results


@torch.no_grad()
def main(out_dir: Path) -> None:
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    from highrank.integrations.hf import attach_head

    torch.manual_seed(0)
    record = {"new_tokens": NEW_TOKENS, "models": {}}
    for name, (kind, head, knobs, tied) in MODELS.items():
        base = tiny_base(kind, tied)
        base_log_probs = torch.log_softmax(base(torch.tensor([PROMPTS[2]])).logits.float(), -1)
        model = attach_head(base, head, init="paper", untie=not tied, **knobs).eval()
        model.head.bias.normal_(0.0, 0.1)
        assert model.config.tie_word_embeddings == tied
        gap = (model(torch.tensor([PROMPTS[2]])).logits - base_log_probs).abs().max().item()
        model.save_pretrained(out_dir / name)
        record["models"][name] = {
            "base": kind, "head": head, "tied": tied, "differs_from_base": gap,
            "prompts": reference(model),
        }  # fmt: skip
    tiny_gpt_neo = GPTNeoForCausalLM(
        GPTNeoConfig(
            vocab_size=VOCAB, hidden_size=128, num_layers=2, num_heads=2,
            max_position_embeddings=64, attention_types=[[["global"], 2]],
            bos_token_id=None, eos_token_id=None,
        )
    )  # fmt: skip
    attach_head(tiny_gpt_neo, "mos", n_components=3).save_pretrained(out_dir / "gpt-neo-mos")
    mfs = {"n_components": 2, "n_partitions": 3, "input_layers": 2}
    attach_head(tiny_base("llama", True), "mfs", **mfs).save_pretrained(out_dir / "llama-mfs")
    record["refused"] = REFUSED
    (out_dir / "reference.json").write_text(json.dumps(record))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(Path(sys.argv[1]))
