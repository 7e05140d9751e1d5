"""No retrofit ends with exit 0 and a non-finite model or result (campaign, issue 29 item 1):
the non-finite guard of both training loops, the checks of what a rerun loads, and the ways
on after a stop (a corrected ``--lr`` continues; ``--restart`` keeps the caches)."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", reason="retrofit needs the hf extra")

from highrank.cli import main  # noqa: E402
from highrank.integrations.retrofit import (  # noqa: E402
    MAX_NONFINITE_STEPS,
    FeatureCache,
    TrainBudget,
    head_from_lm_head,
    train_head,
)
from highrank.train.state import TrainingError  # noqa: E402
from tests.integrations.test_retrofit_command import command, model_and_texts  # noqa: E402


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    return model_and_texts(tmp_path_factory.mktemp("nonfinite"))


def one_line(err: str, prefix: str) -> str:
    """The one message line (the progress bars of the work before it aside)."""
    lines = [line for line in err.strip().splitlines() if line.startswith("highrank ")]
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    assert "Traceback" not in err, err
    return lines[0]


def nothing_saved(out) -> bool:
    return not (out / "model").exists() and not (out / "results.json").exists()


@pytest.mark.parametrize("mode", ["frozen", "full"])
def test_a_diverging_run_saves_no_model_and_no_result(texts, tmp_path, capsys, mode):
    """Campaign: --lr 1e9 trained on losses up to 2e20, then an OverflowError traceback
    (frozen) or exit 0 with a NaN model and a NaN results.json (full)."""
    model, files = texts
    out = tmp_path / "out"
    argv = command(model, files, out, "--head", "mos", "--knob", "n_components=2", "--mode",
                   mode, "--lr", "1e9")
    argv[argv.index("--steps") + 1] = "20"
    assert main(argv) == 1
    line = one_line(capsys.readouterr().err, "highrank retrofit: stopped: ")
    assert "Lower --lr (now 1e+09)" in line or "--restart" in line, line
    assert nothing_saved(out)
    # the saved state does not crash the same command again: it stops the same way
    assert main(argv) == 1
    one_line(capsys.readouterr().err, "highrank retrofit: stopped: ")
    assert nothing_saved(out)


def test_after_a_stop_a_corrected_lr_is_taken_and_restart_keeps_the_caches(
    texts, tmp_path, capsys
):
    model, files = texts
    out = tmp_path / "out"
    argv = command(model, files, out, "--head", "mos", "--knob", "n_components=2", "--lr", "1e9")
    assert main(argv) == 1
    capsys.readouterr()
    features = out / "cache-train" / "features.npy"
    cached = features.stat().st_mtime_ns
    corrected = [*argv]
    corrected[corrected.index("--lr") + 1] = "1e-3"
    status = main(corrected)  # continues from the stopped state: accepted, not "other settings"
    assert "other settings" not in capsys.readouterr().err
    assert status in (0, 1)
    assert main([*corrected, "--restart"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert all(math.isfinite(results["trained"][s]["perplexity"]) for s in ("valid", "test"))
    assert results["plan"]["lr"] == 1e-3
    assert "stopped" not in json.loads((out / "plan.json").read_text())
    assert features.stat().st_mtime_ns == cached  # the caches were kept, not rebuilt
    saved = transformers.AutoModelForCausalLM.from_pretrained(out / "model")
    assert all(bool(torch.isfinite(p).all()) for p in saved.parameters())


def test_a_restart_after_a_stop_binds_its_own_plan(texts, tmp_path, capsys, monkeypatch):
    """--restart after a stop trains from the warm start: interrupted, it resumes with its own
    --lr only (the stop's licence to change --lr stayed in plan.json until the run finished)."""
    from highrank.integrations.retrofit import run as retrofit_run

    model, files = texts
    out = tmp_path / "out"
    argv = command(model, files, out, "--head", "mos", "--knob", "n_components=2", "--lr", "1e9")
    assert main(argv) == 1
    assert "stopped" in json.loads((out / "plan.json").read_text())
    restarted = [*argv, "--restart"]
    restarted[restarted.index("--lr") + 1] = "1e-3"

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C as the restarted training begins

    with monkeypatch.context() as patch:
        patch.setattr(retrofit_run, "_run_frozen", interrupted)
        assert main(restarted) == 130
    assert "stopped" not in json.loads((out / "plan.json").read_text())
    capsys.readouterr()
    other = [*argv]
    other[other.index("--lr") + 1] = "1e-2"
    assert main(other) == 2
    assert "other settings" in capsys.readouterr().err


def test_a_non_finite_row_in_the_feature_cache_is_refused(texts, tmp_path, capsys):
    model, files = texts
    out = tmp_path / "out"
    argv = command(model, files, out, "--head", "mos", "--knob", "n_components=2")
    assert main(argv) == 0
    shutil.rmtree(out / "model")
    (out / "results.json").unlink()
    features = np.load(out / "cache-train" / "features.npy", mmap_mode="r+")
    features[7, 3] = np.nan
    features.flush()
    del features
    capsys.readouterr()
    assert main(argv) == 2
    line = one_line(capsys.readouterr().err, "highrank retrofit: error: ")
    assert "features.npy holds a non-finite hidden state at row 7" in line, line
    assert nothing_saved(out)


@pytest.mark.parametrize("mode", ["frozen", "full"])
def test_a_non_finite_training_state_is_refused_on_resume(texts, tmp_path, capsys, mode):
    model, files = texts
    out = tmp_path / "out"
    argv = command(model, files, out, "--head", "mos", "--knob", "n_components=2", "--mode", mode)
    assert main(argv) == 0
    shutil.rmtree(out / "model")
    (out / "results.json").unlink()
    state = torch.load(out / "state.pt", weights_only=True)
    weights = state["head"] if mode == "frozen" else state["trainable"]
    name = next(k for k, v in weights.items() if v.is_floating_point())
    weights[name] = torch.full_like(weights[name], float("nan"))
    torch.save(state, out / "state.pt")
    capsys.readouterr()
    assert main(argv) == 2
    line = one_line(capsys.readouterr().err, "highrank retrofit: error: ")
    assert f"holds non-finite values in {name}" in line and "--restart" in line, line
    assert nothing_saved(out)
    assert main([*argv, "--restart"]) == 0  # and --restart trains again from the warm start


def test_the_guard_skips_non_finite_steps_and_keeps_the_last_finite_state(tmp_path):
    """Every step non-finite (NaN features): none changes the head; after
    MAX_NONFINITE_STEPS + 1 in a row training stops, the state saved is the finite start."""
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2))
    head = head_from_lm_head(lm, "softmax")
    start = {k: v.clone() for k, v in head.state_dict().items()}
    n = 64
    cache = FeatureCache(tmp_path, torch.full((n, 16), float("nan")),
                         torch.randint(0, 40, (n,)), {})
    budget = TrainBudget(steps=50, batch_tokens=8, lr=1e-2)
    with pytest.raises(TrainingError, match=rf"{MAX_NONFINITE_STEPS + 1} consecutive steps "
                                            r"were non-finite.*holds the last finite state"):
        train_head(head, cache, budget, tmp_path / "state.pt")
    saved = torch.load(tmp_path / "state.pt", weights_only=True)
    assert len(saved["history"]) == MAX_NONFINITE_STEPS + 1
    assert all(h["loss"] is None and h["skipped"] == "loss was nan" for h in saved["history"])
    for key, value in start.items():
        assert torch.equal(saved["head"][key], value), key


def test_a_finished_run_is_reported_at_once_without_loading_the_model(
    texts, tmp_path, capsys, monkeypatch
):
    model, files = texts
    out = tmp_path / "out"
    argv = command(model, files, out, "--head", "softmax")
    assert main(argv) == 0
    import highrank.causal_lm as causal_lm  # where the retrofit loads a model from

    def no_loading(*args, **kwargs):
        raise AssertionError("a finished run loaded the model again")

    monkeypatch.setattr(causal_lm, "load_causal_lm", no_loading)
    capsys.readouterr()
    assert main(argv) == 0
    assert "holds a finished retrofit" in capsys.readouterr().out


def test_a_moved_retrofit_folder_continues(texts, tmp_path, capsys):
    model, files = texts
    first = tmp_path / "first"
    assert main(command(model, files, first, "--head", "softmax")) == 0
    (first / "results.json").unlink()
    moved = tmp_path / "moved"
    shutil.move(first, moved)
    capsys.readouterr()
    assert main(command(model, files, moved, "--head", "softmax")) == 0
    assert "other settings" not in capsys.readouterr().err
    assert json.loads((moved / "results.json").read_text())["plan"]["out"] == str(moved)
