"""``highrank retrofit`` end to end on a tiny random Llama saved with a word-level tokenizer:
the three modes, the saved model reloaded by AutoModelForCausalLM, resuming, bad input."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="retrofit needs the hf extra")

from highrank.cli import main  # noqa: E402
from tests.analysis.test_hf_contexts import save_tiny_model, write_text  # noqa: E402


def model_and_texts(root):
    """The retrofit tests' tiny Llama saved under ``root`` and its train (200 words), valid
    and test (60 each) texts: ``(model folder, {split: text file})``."""
    model = save_tiny_model(root / "model")
    files = {split: write_text(root / f"{split}.txt", n_words=n, seed=i)
             for i, (split, n) in enumerate((("train", 200), ("valid", 60), ("test", 60)))}
    return model, files


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    return model_and_texts(tmp_path_factory.mktemp("retrofit"))


def command(model, files, out, *extra):
    return ["retrofit", "--hf", str(model), "--train", str(files["train"]), "--valid",
            str(files["valid"]), "--test", str(files["test"]), "--out", str(out), "--window", "8",
            "--batch-tokens", "16", "--steps", "6", "--warmup-steps", "2", *extra]


def reloaded_perplexity(folder, text) -> float:
    import highrank.integrations.hf  # noqa: F401  (registers the model type)
    from highrank.analysis.hf_contexts import text_token_ids
    from highrank.integrations.retrofit import window_tokens

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    inputs, targets = window_tokens(text_token_ids(tokenizer, text), 8)
    with torch.no_grad():
        log_probs = model(input_ids=inputs).logits
    nll = -log_probs.gather(-1, targets.unsqueeze(-1)).double().mean()
    return float(nll.exp())


@pytest.mark.parametrize("mode", ["frozen", "lora", "full"])
def test_each_mode_trains_saves_and_reloads(texts, tmp_path, mode, capsys):
    if mode == "lora":
        pytest.importorskip("peft", reason="--mode lora needs peft")
    model, files = texts
    out = tmp_path / "out"
    assert main(command(model, files, out, "--head", "mos", "--knob", "n_components=2",
                        "--mode", mode, "--lr", "1e-2")) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["training"]["steps_done"] == 6 and results["training"]["complete"]
    trainable = results["training"]["trainable_parameters"]
    saved = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    head, body = (sum(p.numel() for p in part.parameters()) for part in (saved.head, saved.model))
    # frozen: the head alone; lora: the head and rank-8 adapters; full: everything (the tied
    # decoder counted once)
    expected = {"frozen": trainable == head, "lora": head < trainable < head + body,
                "full": trainable == sum(p.numel() for p in saved.parameters())}
    assert expected[mode], (trainable, head, body)
    # the trained head was saved (its residual matrices start at zero, and moved)
    assert saved.head.residual_branch.residual.abs().sum() > 0
    for split in ("valid", "test"):
        trained = results["trained"][split]["perplexity"]
        assert trained == pytest.approx(reloaded_perplexity(out / "model", files[split]),
                                        rel=1e-4)
    assert "valid perplexity: base" in capsys.readouterr().out
    again = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    assert again.config.head_name == "mos"
    prompt = torch.tensor([[2, 3, 4]])
    tokens = again.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                            min_new_tokens=4, do_sample=False)  # the tiny config: eos is id 2
    assert tokens.shape == (1, 7)


def test_frozen_mode_starts_at_the_base_and_a_rerun_resumes(texts, tmp_path):
    model, files = texts
    out = tmp_path / "out"
    assert main(command(model, files, out, "--head", "gss", "--lr", "1e-9")) == 0
    results = json.loads((out / "results.json").read_text())
    # a learning rate of 1e-9 leaves the warm head at the base model's distribution
    assert results["trained"]["valid"]["perplexity"] == pytest.approx(
        results["base"]["valid"]["perplexity"], rel=1e-5)
    assert results["trained"]["test"]["kl_from_reference"] == pytest.approx(0.0, abs=1e-6)
    state = (out / "state.pt").stat().st_mtime_ns
    assert main(command(model, files, out, "--head", "gss", "--lr", "1e-9")) == 0
    assert (out / "state.pt").stat().st_mtime_ns == state  # finished: nothing trained again


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--hf", "/no/such/model"], r"model /no/such/model does not exist"),
        (["--head", "nope"], r"unknown head 'nope'"),
        (["--knob", "n_components=0"], r"--head mos: n_components must be a positive integer"),
        (["--head", "sigsoftmax"], r"cannot start at the base model"),
        (["--window", "64"], r"holds \d+ tokens, fewer than one window of 64"),
        (["--window", "500"], r"--window 500 exceeds the model.s 64 positions: give --window 64"),
        (["--train", "/no/such.txt"], r"--train: text file /no/such.txt does not exist"),
        (["--device", "cuda:7"], r"--device = 'cuda:7', but this torch .* sees \d+ CUDA device"),
        (["--device", "toaster"], r"--device = 'toaster' is not a device: .*cpu"),
        # campaign: a traceback after the caches were built, and the folder then refused the
        # corrected command as "a retrofit with other settings (lr)"
        (["--lr", "-1"], r"--lr must be a positive finite number; got -1.0"),
        (["--lr", "nan"], r"--lr must be a positive finite number; got nan"),
    ],
)
def test_bad_input_is_one_line_before_any_work(texts, tmp_path, capsys, change, message):
    model, files = texts
    argv = command(model, files, tmp_path / "out", "--head", "mos")
    for option, value in zip(change[::2], change[1::2], strict=True):
        if option in argv:
            argv[argv.index(option) + 1] = value
        else:
            argv += [option, value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("highrank retrofit: error: ") and len(err.strip().splitlines()) == 1
    import re

    assert re.search(message, err), err
    assert not (tmp_path / "out" / "cache-train").exists()


def test_another_plan_in_the_same_folder_is_refused(texts, tmp_path, capsys):
    model, files = texts
    out = tmp_path / "out"
    assert main(command(model, files, out, "--head", "softmax")) == 0
    assert main(command(model, files, out, "--head", "softmax", "--seed", "3")) == 2
    assert "holds a retrofit with other settings (seed)" in capsys.readouterr().err


def test_a_run_may_resume_on_another_device(texts, tmp_path, capsys):
    model, files = texts
    out = tmp_path / "out"
    assert main(command(model, files, out, "--head", "softmax", "--device", "cpu")) == 0
    assert json.loads((out / "plan.json").read_text())["device"] == "cpu"
    assert main(command(model, files, out, "--head", "softmax", "--device", "auto")) == 0
    assert "other settings" not in capsys.readouterr().err


def test_a_second_retrofit_into_a_folder_in_use_is_refused(texts, tmp_path, capsys):
    """Campaign: two retrofits into one --out ran at once, both writing its caches, state and
    results; the second is refused in one line naming the holder, and writes nothing."""
    import fcntl

    from highrank.runs.locks import LOCK_FILE

    model, files = texts
    out = tmp_path / "out"
    out.mkdir()
    with open(out / LOCK_FILE, "w") as held:  # another process's lock (another description)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(command(model, files, out, "--head", "mos")) == 2
    err = capsys.readouterr().err
    assert "is in use by" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]


@pytest.mark.parametrize(
    ("damaged", "message"),
    [
        ("state.pt", r"state.pt cannot be read as a head's training state .*delete it"),
        ("cache-train/targets.npy", r"cache-train holds a feature cache that cannot be read"),
        ("cache-train/features.npy", r"cache-train holds a feature cache that cannot be read"),
    ],
)
def test_a_crafted_saved_file_is_one_line_and_runs_nothing(
    texts, tmp_path, capsys, damaged, message
):
    """Campaign: a pickled state.pt or cache .npy was refused (weights-only / no pickle) but
    as a ValueError traceback; now one line naming the file and how to start again."""
    import re

    import numpy as np

    from tests.test_untrusted_files import _Payload, write_malicious

    model, files = texts
    out = tmp_path / "out"
    argv = command(model, files, out, "--head", "mos")
    assert main(argv) == 0
    (out / "results.json").unlink()  # so that running again reads the saved files
    marker = tmp_path / "ran"
    if damaged.endswith(".npy"):
        np.save(out / damaged, np.array([_Payload(marker)], dtype=object))
    else:
        write_malicious(out / damaged, marker)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("highrank retrofit: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
    assert not marker.exists()


def test_sigterm_says_what_was_kept_and_the_same_command_continues(texts, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    model, files = texts
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "highrank", *command(model, files, out, "--head", "softmax",
                                                        "--mode", "full")]
    argv[argv.index("--steps") + 1] = "100000"  # far longer than the test waits
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "state.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.2)  # the first checkpoint: training is under way
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err
    assert err.strip().splitlines()[-1] == (
        "highrank retrofit: stopped by SIGTERM; run the same command again: the caches and the "
        "training continue from their last checkpoint")
