"""The retrofit subpackage (issue 31): one training loop for every mode on the core's guard and
signals, the state format of the folders written before, the verb's constants spelt once, and
LoRA on the projections PEFT adapts in GPT-2, Llama and GPT-NeoX (issue 29 item 2)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="retrofit needs the hf extra")

from highrank.cli import main  # noqa: E402
from highrank.integrations.retrofit import (  # noqa: E402
    DEFAULT_LR,
    MODES,
    FeatureCache,
    TrainBudget,
    head_from_lm_head,
    train_head,
    train_windows,
    window_tokens,
)
from highrank.train.state import Interrupted  # noqa: E402
from tests.analysis.test_hf_contexts import save_tiny_model, write_text  # noqa: E402
from tests.integrations.test_retrofit_command import command, reloaded_perplexity  # noqa: E402


def tiny_llama(vocab: int = 40):
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2))


def random_cache(tmp_path, n: int = 64, vocab: int = 40) -> FeatureCache:
    generator = torch.Generator().manual_seed(3)
    return FeatureCache(tmp_path, torch.randn(n, 16, generator=generator),
                        torch.randint(0, vocab, (n,), generator=generator), {})


def test_the_command_line_spells_the_plans_modes_and_learning_rates():
    """cli/retrofit.py keeps MODES as a literal (its --help imports no torch; see
    tests/test_layering.py): it must stay the plan's, and its help the plan's defaults."""
    from highrank.cli import retrofit as cli
    from highrank.cli.common import Parser

    assert cli.MODES == MODES
    parser = Parser(prog="highrank retrofit")
    cli.add_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    assert "(default: 3e-4 frozen, 2e-4 lora, 1e-5 full)" in help_text
    assert DEFAULT_LR == {"frozen": 3e-4, "lora": 2e-4, "full": 1e-5}


def test_the_schedule_is_the_cores_warm_up_and_a_cosine_recorded_runs_resume_on():
    """TrainBudget.lr_factor (0-based) against highrank.train.schedule.lr_factor (1-based):
    the warm-up is the same number; the decay is the core's cosine shifted by one update, equal
    to the last bit or two only (its products are taken in another order), so the retrofit
    keeps its own: the recorded runs resume bit for bit on it."""
    from highrank.train.schedule import lr_factor

    differ = 0
    for total in (1, 2, 7, 60, 391):
        for warmup in sorted({0, 1, total // 3, total}):
            budget = TrainBudget(steps=total, batch_tokens=1, lr=1.0, warmup_steps=warmup)
            for step in range(total):
                ours = budget.lr_factor(step)
                if step < warmup:
                    assert ours == lr_factor(step + 1, warmup_steps=warmup, schedule="cosine",
                                             total_steps=total)
                    continue
                core = lr_factor(step + 1, warmup_steps=warmup + 1, schedule="cosine",
                                 total_steps=total + 1)
                assert ours == pytest.approx(core, rel=1e-13, abs=1e-15)
                differ += ours != core
    assert differ > 0  # why train/schedule.py keeps both curves


def test_state_files_keep_the_keys_folders_were_written_with(tmp_path):
    """Frozen: budget/head/optimizer/history/rng/python_rng; lora/full: ... trainable ...:
    the one loop writes what the two loops wrote, so older folders load and resume."""
    llama = tiny_llama()
    budget = TrainBudget(steps=2, batch_tokens=8, lr=1e-3)
    train_head(head_from_lm_head(llama, "softmax"), random_cache(tmp_path), budget,
               tmp_path / "frozen.pt")
    ids = torch.randint(0, 40, (4 * 8 + 1,), generator=torch.Generator().manual_seed(0))
    inputs, targets = window_tokens(ids, 8)
    from highrank.integrations.hf import attach_head

    model = attach_head(llama, "softmax").train()
    train_windows(model, inputs, targets, TrainBudget(steps=2, batch_tokens=2, lr=1e-3),
                  tmp_path / "full.pt")
    common = {"budget", "optimizer", "history", "rng", "python_rng"}
    assert set(torch.load(tmp_path / "frozen.pt", weights_only=True)) == common | {"head"}
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert set(full) == common | {"trainable", "data"}  # data: the windows' digest (newer)
    assert set(full["trainable"]) == {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_saves_between_two_steps_and_the_run_resumes_exactly(tmp_path, name):
    """The core's SignalCatcher in the one loop: the signal is acted on after the step it
    arrived in, the state saved there (not at the last multiple of checkpoint_every)."""
    llama, cache = tiny_llama(), random_cache(tmp_path)
    budget = TrainBudget(steps=8, batch_tokens=8, lr=1e-2, warmup_steps=2)
    torch.manual_seed(1)
    straight = head_from_lm_head(llama, "mos", n_components=2)
    train_head(straight, cache, budget, tmp_path / "straight.pt")

    torch.manual_seed(1)
    head = head_from_lm_head(llama, "mos", n_components=2)
    real_loss, calls = head.loss, []

    def loss_sending_a_signal(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), getattr(signal, name))
        return real_loss(*args, **kwargs)

    head.loss = loss_sending_a_signal
    previous = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as stopped:
        train_head(head, cache, budget, tmp_path / "resumed.pt", checkpoint_every=100,
                   catch_signals=True)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == previous
    assert stopped.value.signal_name == name and stopped.value.step == 3
    assert stopped.value.exit_status == 128 + getattr(signal, name)
    saved = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert len(saved["history"]) == 3
    torch.manual_seed(99)
    fresh = head_from_lm_head(llama, "mos", n_components=2)
    summary = train_head(fresh, cache, budget, tmp_path / "resumed.pt")
    assert summary["complete"]
    for (key, a), b in zip(straight.state_dict().items(), fresh.state_dict().values(),
                           strict=True):
        assert torch.equal(a, b), key


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    files = {split: write_text(root / f"{split}.txt", n_words=n, seed=i)
             for i, (split, n) in enumerate((("train", 200), ("valid", 60), ("test", 60)))}
    return root, files


@pytest.mark.parametrize(
    ("arch", "adapted"),
    [
        ("gpt2", "h.0.attn.c_attn"),  # transformers' Conv1D: refused before issue 29 item 2
        ("llama", "layers.0.self_attn.q_proj"),
        ("gpt_neox", "layers.0.mlp.dense_h_to_4h"),
    ],
)
def test_lora_trains_gpt2_llama_and_gpt_neox(texts, tmp_path, arch, adapted):
    pytest.importorskip("peft", reason="--mode lora needs peft")
    root, files = texts
    model = save_tiny_model(root / f"model-{arch}", arch)
    out = tmp_path / "out"
    assert main(command(model, files, out, "--head", "mos", "--knob", "n_components=2",
                        "--mode", "lora", "--lr", "1e-2")) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["training"]["complete"]
    saved = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    base = transformers.AutoModelForCausalLM.from_pretrained(model)
    head = sum(p.numel() for p in saved.head.parameters())
    assert head < results["training"]["trainable_parameters"]  # adapters beside the head
    # the adapters were trained and merged into the body's projection
    weight = dict(saved.model.named_parameters())[f"{adapted}.weight"]
    assert not torch.equal(weight, dict(base.base_model.named_parameters())[f"{adapted}.weight"])
    for split in ("valid", "test"):
        assert results["trained"][split]["perplexity"] == pytest.approx(
            reloaded_perplexity(out / "model", files[split]), rel=1e-4)


def test_a_folder_written_before_a_setting_existed_continues(tmp_path):
    """plan.json of a run started before ``fsdp`` was a setting lacks it: read at its
    default, the folder is this plan's (another value is still refused)."""
    from dataclasses import asdict

    from highrank.integrations.retrofit.plan import RetrofitError, RetrofitPlan, check_out

    plan = RetrofitPlan(model="m", head="mos", train="t", valid="v", out=str(tmp_path),
                        mode="full", device="cpu")
    old = {k: v for k, v in asdict(plan).items() if k != "fsdp"}
    (tmp_path / "plan.json").write_text(json.dumps(old))
    check_out(tmp_path, plan)
    with pytest.raises(RetrofitError, match=r"other settings \(fsdp\)"):
        check_out(tmp_path, RetrofitPlan(**{**asdict(plan), "fsdp": True}))
