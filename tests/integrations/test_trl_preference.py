"""TRL's preference and RL trainers train what they say (issue 32 item 4): DPO's first step is
exact for every head (its dropouts follow TRL's ``disable_dropout``), and DPO, KTO and GRPO
(its sampling path included) run a few steps on tiny models with MoS and Mixtape heads."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from .conftest import word_tokenizer

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
hf = pytest.importorskip("highrank.integrations.hf", reason="the hf extra is not installed")
trl = pytest.importorskip(
    "trl", reason="trl is not installed (the clients extra: pip install -e '.[clients]')"
)
datasets = pytest.importorskip("datasets", reason="datasets (a trl dependency) is not installed")

HEADS = ["softmax", "moc", "mos", "mixtape", "sigsoftmax", "gss", "plif", "mlp_softmax"]
PROMPTS = ["w3 w4 w5", "w6 w7", "w8", "w9 w10"]


def options(tmp_path, steps: int) -> dict:
    return dict(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4,
        learning_rate=1e-2, report_to="none", save_strategy="no", logging_steps=1,
        use_cpu=True, disable_tqdm=True, bf16=False,
    )  # fmt: skip


def dpo_trainer(model, tmp_path, steps: int):
    data = datasets.Dataset.from_dict(
        {"prompt": PROMPTS, "chosen": [" w11 w12", " w13", " w14 w15", " w16"],
         "rejected": [" w17", " w18 w19", " w20", " w21 w22"]}
    )  # fmt: skip
    args = trl.DPOConfig(max_length=16, **options(tmp_path, steps))
    return trl.DPOTrainer(
        model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=data,
        processing_class=word_tokenizer(),
    )  # fmt: skip


def kto_trainer(model, tmp_path, steps: int):
    data = datasets.Dataset.from_dict(
        {"prompt": PROMPTS, "completion": [" w11 w12", " w13", " w14 w15", " w16"],
         "label": [True, False, True, False]}
    )  # fmt: skip
    args = trl.KTOConfig(max_length=16, **options(tmp_path, steps))
    return trl.KTOTrainer(
        model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=data,
        processing_class=word_tokenizer(),
    )  # fmt: skip


def word_sum(completions, **_) -> list[float]:
    """A reward that tells sampled completions apart: the sum of their word numbers."""
    return [float(sum(int(w[1:]) for w in c.split() if w[1:].isdigit())) for c in completions]


def grpo_trainer(model, tmp_path, steps: int):
    """GRPO from a saved folder, as users run it: TRL loads the policy and, for its KL term
    (beta > 0), the reference from it; each step samples completions with ``generate``."""
    folder = tmp_path / "policy"
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    args = trl.GRPOConfig(
        num_generations=2, max_completion_length=4, beta=0.04, disable_dropout=True,
        **options(tmp_path, steps),
    )  # fmt: skip
    return trl.GRPOTrainer(
        model=str(folder), reward_funcs=word_sum, args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=word_tokenizer(),
    )  # fmt: skip


def step_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("head", HEADS)
def test_dpos_first_step_is_exact_for_every_head(attached, tmp_path, head):
    """Before any update the policy is its reference, so DPO's loss is log 2 and every reward
    0, with every dropout of body and head switched on (TRL's disable_dropout, the default,
    must reach them all): a MoS head's latent dropout once escaped it (loss 0.6945)."""
    trainer = dpo_trainer(attached("gpt2", head, stochastic=True), tmp_path, steps=1)
    trainer.train()
    (first,) = step_logs(trainer)
    assert math.isclose(first["loss"], math.log(2), rel_tol=0, abs_tol=1e-6), first
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(first[key]) < 1e-6, (key, first)


RUNS = [("gpt2", "mos"), ("llama", "mixtape")]
TRAINERS = {"dpo": dpo_trainer, "kto": kto_trainer, "grpo": grpo_trainer}


@pytest.mark.parametrize("kind", sorted(TRAINERS))
@pytest.mark.parametrize(("base", "head"), RUNS)
def test_preference_and_rl_trainers_train_the_head(attached, tmp_path, kind, base, head):
    model = attached(base, head, stochastic=True)
    trainer = TRAINERS[kind](model, tmp_path, steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = step_logs(trainer)
    assert len(logs) == 2 and all(math.isfinite(e["loss"]) for e in logs), logs
    trained = trainer.model
    assert isinstance(trained, hf.HighrankForCausalLM) and trained.config.head_name == head
    moved = [n for n, p in trained.named_parameters() if not torch.equal(p, before[n])]
    assert any(n.startswith("head.") for n in moved), moved
    first = logs[0]
    # The policy is its reference at step 1 (every dropout off): nothing between them yet.
    if kind == "dpo":
        assert math.isclose(first["loss"], math.log(2), rel_tol=0, abs_tol=1e-6), first
    if kind in ("dpo", "kto"):
        assert abs(first["rewards/chosen"]) < 1e-6 and abs(first["rewards/rejected"]) < 1e-6
    if kind in ("kto", "grpo"):
        assert first["kl"] == 0.0, first
    if kind == "grpo":  # it sampled completions of max_completion_length tokens or fewer
        assert all(0 < e["completions/mean_length"] <= 4 for e in logs), logs
        assert first["reward_std"] > 0, first  # distinct samples: advantages were non-zero
