"""highrank.train: the AWD-LSTM loop, the run directory, exact resume, NaN guard, finetuning."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import highrank.train.awd_lstm as awd_recipe
import highrank.train.runner as runner
import highrank.train.stream as stream_lm
from highrank.config import load_config
from highrank.models import load_run
from highrank.runs.checkpoint import load_checkpoint
from highrank.runs.run_dir import read_metrics
from highrank.train import (
    TrainingError,
    TrainOptions,
    evaluate_loss,
    finetune,
    resume,
    train,
)
from tests.conftest import TINY_AWD_LSTM

# The training tests' 2-layer AWD-LSTM; ~33 steps per epoch on the training corpus (the
# ``corpus`` fixture, tests/train/conftest.py).
TINY = [
    *TINY_AWD_LSTM,
    "run.device=cpu",  # exact figures are the CPU's (tests/test_cuda.py checks a GPU)
]
QUIET = TrainOptions(progress=False)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine runs timing benchmarks; and results are exact
    yield
    torch.set_num_threads(threads)


def tiny_config(corpus: Path, out: Path, *overrides: str):
    return load_config(None, [f"data.dir={corpus}", f"run.out_dir={out}", *TINY, *overrides])


def options(**kwargs) -> TrainOptions:
    return TrainOptions(progress=False, **kwargs)


def trajectory(run_dir: Path) -> list[tuple]:
    """Every logged loss of a run, without timings."""
    keys = ("kind", "stage", "epoch", "step", "train_loss", "val_loss", "phase", "lr")
    return [tuple(r.get(k) for k in keys) for r in read_metrics(run_dir / "metrics.jsonl")]


def weights(path: Path, key: str = "model") -> dict[str, torch.Tensor]:
    payload = load_checkpoint(path)
    return payload[key] if key == "model" else payload["training"][key]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ---- the run directory ------------------------------------------------------------------------


def test_run_directory_holds_config_command_environment_vocab_metrics_checkpoints(corpus, tmp_path):
    out = tmp_path / "run"
    result = train(tiny_config(corpus, out, "train.epochs=2"), options=QUIET, command=["x", "y"])
    assert result.epochs_completed == 2 and result.stop_reason == "epochs"
    names = {p.name for p in out.iterdir()}
    assert {"config.toml", "command.txt", "environment.json", "vocab.json"} <= names
    assert {"metrics.jsonl", "checkpoints"} <= names
    stored = load_config(out / "config.toml")
    assert stored.train.epochs == 2 and Path(stored.data.dir).is_absolute()
    assert (out / "command.txt").read_text() == "x y\n"
    env = json.loads((out / "environment.json").read_text())
    assert env["torch"] == torch.__version__ and {"python", "numpy", "platform"} <= env.keys()
    assert "git_commit" in env
    vocab = json.loads((out / "vocab.json").read_text())["words"]
    assert len(vocab) == 31 and "<eos>" in vocab
    checkpoints = {p.name for p in (out / "checkpoints").iterdir()}
    assert checkpoints == {"last.pt", "last.prev.pt", "best.pt"}


def test_awd_lstm_gives_a_head_that_reads_layers_its_last_layer_only(corpus, tmp_path):
    """CPR with input_layers = 1 trains on AWD-LSTM (its last layer and the segment's tokens);
    more layers are refused when the model is built (the config's check: test_config.py)."""
    from highrank.heads import build_head
    from highrank.models import LanguageModel
    from highrank.models.backbones.awd_lstm import AWDLSTM

    overrides = ["head.name=cpr", "head.input_layers=1", "head.reranker_k1=5", "train.epochs=1"]
    run = train(tiny_config(corpus, tmp_path / "run", *overrides), options=QUIET).run_dir
    losses = [r["val_loss"] for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r]
    assert losses and all(math.isfinite(loss) for loss in losses)
    backbone = AWDLSTM(31, d_embed=8, d_hidden=12, n_layers=2)
    with pytest.raises(ValueError, match=r"reads the last 2 layers, but AWD-LSTM gives a head its "
                       r"last layer only \(its layers differ in width: 12, 8\)"):
        LanguageModel(backbone, build_head("mfs", d_in=8, vocab_size=31, input_layers=2))


def test_metrics_have_a_line_per_logged_step_and_per_epoch(corpus, tmp_path):
    out = tmp_path / "run"
    train(tiny_config(corpus, out, "train.epochs=2", "train.log_every=5"), options=QUIET)
    epochs = read_metrics(out / "metrics.jsonl", "epoch")
    steps = read_metrics(out / "metrics.jsonl", "step")
    assert [e["epoch"] for e in epochs] == [1, 2]
    for field in ("train_loss", "val_loss", "val_ppl", "lr", "phase", "tokens_per_s"):
        assert field in epochs[0]
    assert {"skipped_steps", "seconds"} <= epochs[0].keys()
    assert epochs[0]["val_ppl"] == pytest.approx(math.exp(epochs[0]["val_loss"]))
    assert epochs[0]["phase"] == "sgd" and epochs[0]["lr"] == 5.0
    assert [s["step"] for s in steps] == list(range(5, epochs[-1]["step"] + 1, 5))
    assert all(s["train_loss"] > 0 for s in steps)


def test_refuses_to_overwrite_an_existing_run(corpus, tmp_path):
    config = tiny_config(corpus, tmp_path / "run", "train.epochs=1")
    train(config, options=options(max_steps=2))
    with pytest.raises(ValueError, match="already holds a run.*--resume"):
        train(config, options=QUIET)


# ---- exact resume -----------------------------------------------------------------------------

# ET-ASGD switching after epoch 1 (step 33 on the tiny corpus): interruptions mid-epoch before
# the switch, exactly at the end of epoch 1 (before its validation), and after the switch.
SWITCHING = ("train.epochs=3", "train.optimizer=et-asgd", "train.switch_epoch=1")


def test_nt_asgd_switches_by_its_latest_epoch(corpus, tmp_path):
    """nonmono 5 cannot fire within 3 epochs; train.latest_switch_epoch = 1 switches after
    the first, and the run resumes the bounded trigger."""
    out = tmp_path / "bounded"
    overrides = ("train.epochs=3", "train.nonmono=5", "train.latest_switch_epoch=1")
    result = train(tiny_config(corpus, out, *overrides), options=QUIET)
    phases = [r["phase"] for r in read_metrics(out / "metrics.jsonl", "epoch")]
    assert result.phase == "asgd" and phases == ["sgd", "asgd", "asgd"]


@pytest.fixture
def straight_run(corpus, tmp_path) -> Path:
    out = tmp_path / "straight"
    train(tiny_config(corpus, out, *SWITCHING), options=QUIET)
    return out


def epoch_end_step(run_dir: Path, epoch: int) -> int:
    lines = read_metrics(run_dir / "metrics.jsonl", "epoch")
    return next(r["step"] for r in lines if r["epoch"] == epoch)


@pytest.mark.parametrize("stop", ["mid-epoch", "epoch-end", "after-switch"])
def test_interrupted_and_resumed_run_is_bit_identical(straight_run, corpus, tmp_path, stop):
    end = epoch_end_step(straight_run, 1)
    max_steps = {"mid-epoch": 10, "epoch-end": end, "after-switch": end + 7}[stop]
    out = tmp_path / "interrupted"
    first = train(tiny_config(corpus, out, *SWITCHING), options=options(max_steps=max_steps))
    assert first.stop_reason == "max_steps" and first.steps == max_steps
    second = resume(out, options=QUIET)
    assert second.stop_reason == "epochs" and second.phase == "asgd"
    assert trajectory(out) == trajectory(straight_run)
    for name in ("last.pt", "best.pt"):
        ours, straight = out / "checkpoints" / name, straight_run / "checkpoints" / name
        assert_same_weights(weights(ours), weights(straight))
    assert_same_weights(
        weights(out / "checkpoints/last.pt", "optimizer")["state"][0],
        weights(straight_run / "checkpoints/last.pt", "optimizer")["state"][0],
    )


@pytest.mark.parametrize(
    "head",
    [
        ["head.name=mos", "head.n_components=2"],  # latent dropout: draws from the torch RNG
        ["head.name=mixtape", "head.gate_dim=3", "head.gate_noise=0.1", "head.gate_dropout=0.2"],
        ["head.name=plif", "head.n_pieces=50"],  # slopes in their own parameter group
    ],
    ids=lambda head: head[0].removeprefix("head.name="),
)
def test_resume_is_bit_identical_for_stochastic_and_grouped_heads(corpus, tmp_path, head):
    overrides = ("train.epochs=2", "train.optimizer=et-asgd", "train.switch_epoch=1", *head)
    train(tiny_config(corpus, tmp_path / "straight", *overrides), options=QUIET)
    out = tmp_path / "interrupted"
    train(tiny_config(corpus, out, *overrides), options=options(max_steps=40))
    resume(out, options=QUIET)
    assert trajectory(out) == trajectory(tmp_path / "straight")


def test_a_crash_resumes_from_the_periodic_checkpoint_exactly(straight_run, corpus, tmp_path):
    """The callback raises right after the checkpoint at the last step of epoch 1 is written:
    metrics lines logged after it are dropped on resume, validation and switch happen then."""
    end = epoch_end_step(straight_run, 1)

    def crash(info):
        if info.step == end:
            raise KeyboardInterrupt("simulated crash")

    out = tmp_path / "crashed"
    config = tiny_config(corpus, out, *SWITCHING, f"train.checkpoint_every={end}")
    with pytest.raises(KeyboardInterrupt):
        train(config, options=options(callback=crash))
    saved = load_checkpoint(out / "checkpoints/last.pt")["training"]["progress"]
    assert saved["step"] == end and saved["epoch"] == 1  # before the end-of-epoch work
    resume(out, options=QUIET, command=["highrank", "train", "--resume", "x"])
    assert trajectory(out) == trajectory(straight_run)
    assert_same_weights(
        weights(out / "checkpoints/best.pt"), weights(straight_run / "checkpoints/best.pt")
    )
    assert (out / "command.txt").read_text().splitlines()[-1] == "highrank train --resume x"


def test_checkpoint_every_is_a_config_key_that_a_resume_may_change(corpus, tmp_path):
    def crash_at(step):
        def callback(info):
            if info.step == step:
                raise KeyboardInterrupt("simulated crash")

        return callback

    def saved_step(out: Path) -> int:
        return load_checkpoint(out / "checkpoints/last.pt")["training"]["progress"]["step"]

    out = tmp_path / "run"
    config = tiny_config(corpus, out, "train.epochs=1", "train.checkpoint_every=4")
    with pytest.raises(KeyboardInterrupt):
        train(config, options=options(callback=crash_at(11)))
    assert saved_step(out) == 8
    changed = ["train.checkpoint_every=3"]
    with pytest.raises(KeyboardInterrupt):
        resume(out, overrides=changed, options=options(callback=crash_at(17)))
    assert saved_step(out) == 15
    assert load_checkpoint(out / "checkpoints/last.pt")["config"]["train"]["checkpoint_every"] == 3


def test_resume_may_raise_the_epoch_limit_but_not_change_the_model(corpus, tmp_path):
    out = tmp_path / "run"
    train(tiny_config(corpus, out, "train.epochs=1"), options=QUIET)
    result = resume(out, overrides=["--train.epochs=2"], options=QUIET)
    assert result.epochs_completed == 2
    with pytest.raises(ValueError, match="train.lr cannot change when continuing"):
        resume(out, overrides=["train.lr=1"], options=QUIET)


# ---- NT-ASGD and averaged evaluation ----------------------------------------------------------


def test_nt_asgd_switches_on_the_crafted_validation_sequence_and_evaluates_the_average(
    corpus, tmp_path, monkeypatch
):
    # n = 2: at epoch 4 the history is [5, 4, 4.5] and 5.5 > min(history[:-2]) = 5 switches;
    # 4.9 at epoch 3 would not (not > 5), nor would any loss before the history has 3 entries.
    crafted = iter([5.0, 4.0, 4.5, 5.5, 3.0, 2.9])
    seen: list[dict] = []

    def fake_evaluate(model, source, bptt, *, chunk_size=None):
        seen.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return next(crafted)

    monkeypatch.setattr(stream_lm, "evaluate_loss", fake_evaluate)
    out = tmp_path / "run"
    config = tiny_config(corpus, out, "train.epochs=6", "train.nonmono=2")
    result = train(config, options=QUIET)
    epochs = read_metrics(out / "metrics.jsonl", "epoch")
    assert [e["switched"] for e in epochs] == [False, False, False, True, False, False]
    assert [e["phase"] for e in epochs] == ["sgd"] * 4 + ["asgd"] * 2
    assert result.phase == "asgd" and result.best_epoch == 6
    # Epoch 6 was evaluated with the averages that best.pt and last.pt's "model" hold, and
    # these differ from the raw iterates the training continues from.
    last = load_checkpoint(out / "checkpoints/last.pt")
    for name, value in seen[-1].items():
        assert torch.equal(value, last["model"][name]), name
    raw = last["training"]["model"]
    assert any(not torch.equal(raw[name], last["model"][name]) for name in seen[-1])


# ---- non-finite guard -------------------------------------------------------------------------


def poison(monkeypatch, steps: set[int], where: str = "loss"):
    """Make the training loss (or only its gradient) non-finite at the given 1-based steps."""
    real = awd_recipe.training_loss
    calls = {"n": 0}

    def poisoned(model, tokens, target, state, chunk_size):
        calls["n"] += 1
        loss, nll, new_state = real(model, tokens, target, state, chunk_size)
        if calls["n"] in steps:
            if where == "loss":
                loss = loss * math.nan
            else:  # finite loss, NaN gradient: d sqrt(x)/dx at 0 is inf, times 0
                loss = loss + torch.sqrt(0 * model.backbone.embedding.weight.sum())
        return loss, nll, new_state

    monkeypatch.setattr(awd_recipe, "training_loss", poisoned)


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_a_non_finite_step_is_skipped_without_touching_the_weights(
    corpus, tmp_path, monkeypatch, where
):
    poison(monkeypatch, {3}, where)
    models = []
    real_build = runner.build_model
    monkeypatch.setattr(
        runner, "build_model", lambda *args: models.append(real_build(*args)) or models[-1]
    )
    seen = {}

    def snapshot(info):
        params = list(models[0].parameters())
        seen[info.step] = (info.skipped, [p.detach().clone() for p in params])
        if info.skipped:
            assert all(p.grad is None for p in params)  # gradients zeroed

    out = tmp_path / "run"
    train(tiny_config(corpus, out, "train.epochs=1"), options=options(callback=snapshot))
    assert seen[3][0] and not seen[2][0] and not seen[4][0]
    for before, after in zip(seen[2][1], seen[3][1], strict=True):
        assert torch.equal(before, after)
    lines = read_metrics(out / "metrics.jsonl")
    assert next(r for r in lines if r["step"] == 3)["skipped_steps"] == 1
    assert next(r for r in lines if r["step"] == 3)["train_loss"] is None
    assert next(r for r in lines if r["kind"] == "epoch")["skipped_steps"] == 1


def test_too_many_consecutive_non_finite_steps_stop_with_advice(corpus, tmp_path, monkeypatch):
    poison(monkeypatch, set(range(4, 100)))
    out = tmp_path / "run"
    overrides = ("train.epochs=1", "train.max_nonfinite_skips=3", "train.checkpoint_every=2")
    config = tiny_config(corpus, out, *overrides)
    with pytest.raises(TrainingError) as error:
        train(config, options=QUIET)
    message = str(error.value)
    assert "step 7" in message and "train.max_nonfinite_skips = 3" in message
    assert "--train.lr=2.5" in message and "train.clip" in message
    assert "Start a new run" in message and f"({out}/checkpoints/last.pt) holds" in message
    # last.pt is from step 6: three skipped steps left the weights finite and as they were.
    assert load_checkpoint(out / "checkpoints/last.pt")["training"]["progress"]["step"] == 6


def test_a_loss_far_above_a_uniform_distribution_s_warns_once_and_goes_on(
    corpus, tmp_path, monkeypatch, capsys
):
    """A new user's walk: CPR on AWD-LSTM at the recipe's lr 30 went 4.1 -> 76 -> 489 -> 1,036
    in 4 steps and on to a perplexity of 2e245, finite, so no guard said a word."""
    real = awd_recipe.training_loss
    calls = {"n": 0}

    def exploding(model, tokens, target, state, chunk_size):
        calls["n"] += 1
        loss, nll, new_state = real(model, tokens, target, state, chunk_size)
        return loss, nll * (100.0 if calls["n"] in (3, 4) else 1.0), new_state

    monkeypatch.setattr(awd_recipe, "training_loss", exploding)
    result = train(tiny_config(corpus, tmp_path / "run", "train.epochs=1"), options=QUIET)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "diverging" in line]
    assert len(warnings) == 1, warnings  # once a stage
    assert warnings[0].startswith("warning: train step 3 (epoch 1): the training loss ")
    assert "above 2 x a uniform distribution's (log V = " in warnings[0]
    assert "--train.lr=2.5" in warnings[0]  # the recipe's advice
    assert result.steps > 4  # and the run went on


# ---- evaluation, finetuning, load_run ---------------------------------------------------------


def test_best_checkpoint_reproduces_its_validation_loss_through_load_run(corpus, tmp_path):
    out = tmp_path / "run"
    result = train(tiny_config(corpus, out, "train.epochs=2"), options=QUIET)
    model, config, vocab = load_run(out)
    assert not model.training and len(vocab) == 31 and config.train.epochs == 2
    from highrank.data import load_corpus

    valid = load_corpus(corpus).batchify("valid", config.train.eval_batch_size)
    assert evaluate_loss(model, valid, config.train.bptt) == result.best_val_loss


def test_finetune_restarts_averaged_sgd_from_best_and_saves_improvements(
    corpus, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    train(tiny_config(corpus, out, "train.epochs=2"), options=QUIET)
    best_loss = load_checkpoint(out / "checkpoints/best.pt")["training"]["progress"]
    # Finetune validation: better at epoch 1, then never better than min(history[:-1]).
    crafted = iter([best_loss["best_val_loss"] - 1.0, 100.0, 100.0, 100.0, 100.0])
    monkeypatch.setattr(stream_lm, "evaluate_loss", lambda *a, **k: next(crafted))
    result = finetune(out, overrides=["finetune.epochs=5", "train.nonmono=1"], options=QUIET)
    assert result.stage == "finetune" and result.stop_reason == "nonmono"
    assert result.epochs_completed == 3 and result.best_epoch == 1
    lines = read_metrics(out / "metrics.jsonl", "epoch")
    finetuned = [r for r in lines if r["stage"] == "finetune"]
    assert [r["stopped"] for r in finetuned] == [False, False, True]
    assert all(r["phase"] == "asgd" and r["lr"] == 30.0 for r in finetuned)
    saved = load_checkpoint(out / "checkpoints/finetuned.pt")
    assert saved["kind"] == "finetuned" and saved["training"]["progress"]["best_epoch"] == 1
    model, _, _ = load_run(out, "finetuned")
    assert model.backbone.vocab_size == 31
    with pytest.raises(Exception, match="already finetuned.*--resume"):
        finetune(out, options=QUIET)


def test_finetune_resumes_exactly(corpus, tmp_path):
    for name in ("a", "b"):
        train(tiny_config(corpus, tmp_path / name, "train.epochs=1"), options=QUIET)
    finetune(tmp_path / "a", overrides=["finetune.epochs=2"], options=QUIET)
    finetune(tmp_path / "b", overrides=["finetune.epochs=2"], options=options(max_steps=40))
    finetune(tmp_path / "b", resume=True, options=QUIET)
    assert trajectory(tmp_path / "a") == trajectory(tmp_path / "b")


# ---- the command line -------------------------------------------------------------------------


def cli_overrides(corpus: Path, out: Path) -> list[str]:
    return [f"--data.dir={corpus}", f"--run.out_dir={out}", *(f"--{o}" for o in TINY)]


def test_cli_train_resume_and_finetune_on_a_tiny_corpus(corpus, tmp_path, capsys):
    from highrank.cli import main

    out = tmp_path / "run"
    config = tmp_path / "tiny.toml"
    config.write_text('[head]\nname = "softmax"\n\n[train]\nepochs = 3\n')
    args = ["train", str(config), *cli_overrides(corpus, out), "--train.epochs=1"]
    assert main([*args, "--checkpoint-every", "2", "--no-progress", "--max-steps", "5"]) == 0
    assert "stopped at --max-steps" in capsys.readouterr().out
    stored = load_config(out / "config.toml")
    assert stored.train.epochs == 1  # the override beat the file
    assert stored.train.checkpoint_every == 2  # --checkpoint-every N is that override
    previous = load_checkpoint(out / "checkpoints/last.prev.pt")
    assert previous["training"]["progress"]["step"] == 4  # saved at step 4, then 5 (the stop)
    assert main(["train", "--resume", str(out), "--no-progress", "--checkpoint-every=3"]) == 0
    assert "all epochs done after 1 epoch(s)" in capsys.readouterr().out
    command = (out / "command.txt").read_text().splitlines()
    assert command[0].startswith(f"highrank train {config} --data.dir=")
    assert command[0].endswith("--train.epochs=1 --train.checkpoint_every=2 --max-steps 5")
    assert command[1] == f"highrank train --resume {out} --train.checkpoint_every=3"
    assert main(["finetune", str(out), "--finetune.epochs=1", "--no-progress"]) == 0
    assert "finetune: all epochs done after 1 epoch(s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--train.lr=-1"], ["train.lr = -1.0", "out of range"]),
        (["--head.n_components=3"], ["'softmax' has no knob 'n_components'"]),
        (["--data.dir=/nonexistent/corpus"], ["/nonexistent/corpus does not exist"]),
    ],
)
def test_cli_train_reports_bad_input_in_one_line_with_status_2(
    corpus, tmp_path, capsys, argv, words
):
    from highrank.cli import main

    base = cli_overrides(corpus, tmp_path / "run")
    code = main(["train", str(write_toml(tmp_path)), *base, *argv, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.startswith("highrank train: error: ") and len(err.strip().splitlines()) == 1
    for word in words:
        assert word in err


def write_toml(tmp_path: Path) -> Path:
    path = tmp_path / "empty.toml"
    path.write_text("")
    return path


def test_cli_train_needs_exactly_one_of_config_and_resume(tmp_path, capsys):
    from highrank.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train"])
    assert exit_info.value.code == 2
    assert "nothing to train" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "x.toml", "--resume", str(tmp_path)])
    assert "either CONFIG" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_cli_eval_and_dynamic_eval_of_a_tiny_run(tiny_run, tiny_corpus, tmp_path, capsys):
    import shutil

    from highrank.cli import main
    from highrank.data import load_corpus
    from highrank.evaluate import evaluate_perplexity

    out = shutil.copytree(tiny_run, tmp_path / "run")  # the shared run: eval writes records
    corpus = tiny_corpus
    nll_file = tmp_path / "nll.tsv"
    assert (
        main(["eval", str(out), "--split", "valid", "--no-progress", "--token-nll", str(nll_file)])
        == 0
    )
    printed = capsys.readouterr().out
    record = json.loads((out / "eval-valid-best.json").read_text())
    model, _, _ = load_run(out)
    expected = evaluate_perplexity(model, load_corpus(corpus).valid, batch_size=2, bptt=70)
    assert record["perplexity"] == pytest.approx(expected.perplexity, rel=1e-9)
    assert record["batch_size"] == 2  # the run's train.eval_batch_size
    assert f"perplexity {expected.perplexity:.2f}" in printed
    assert nll_file.read_text().startswith("position\ttarget\tnll\n")

    assert main(["dynamic-eval", str(out), "--no-progress", "--max-stats-batches", "3"]) == 0
    dynamic = json.loads((out / "dynamic-eval-test-best.json").read_text())
    assert dynamic["split"] == "test" and dynamic["lr"] == 0.002 and dynamic["tokens"] > 0
    assert math.isfinite(dynamic["perplexity"])
    # the static figure to compare with: the same tokens in the same segments, no adaptation
    static = evaluate_perplexity(model, load_corpus(corpus).test, batch_size=1, bptt=5)
    assert dynamic["static_perplexity"] == pytest.approx(static.perplexity, rel=1e-9)
    assert f"(no adaptation): {static.perplexity:.2f}" in capsys.readouterr().out


def test_cli_eval_of_a_missing_run_is_a_clear_error(tmp_path, capsys):
    from highrank.cli import main

    assert main(["eval", str(tmp_path / "nowhere"), "--no-progress"]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_metrics_file_exists_even_before_the_first_logged_line(corpus, tmp_path):
    out = tmp_path / "run"
    train(tiny_config(corpus, out, "train.log_every=1000"), options=options(max_steps=1))
    assert (out / "metrics.jsonl").is_file()
    assert read_metrics(out / "metrics.jsonl", kind="step") == []


# ---- the references' window choices -----------------------------------------------------------


def test_finetune_caps_windows_at_bptt_plus_its_own_delta(corpus, tmp_path):
    """Training caps at bptt + train.max_seq_len_delta (6 + 3 here), finetuning at bptt +
    finetune.max_seq_len_delta: 10 by default as awd-lstm-lm's finetune.py, 0 here."""
    seen: dict[str, list[int]] = {"train": [], "finetune": []}

    def record(info):
        seen[info.stage].append(info.seq_len)

    out = tmp_path / "run"
    train(tiny_config(corpus, out, "train.epochs=2"), options=options(callback=record))
    assert max(seen["train"]) == 9  # N(6, 5) draws above 9 were capped
    assert load_config(None).finetune.max_seq_len_delta == 10
    overrides = ["finetune.epochs=2", "finetune.max_seq_len_delta=0"]
    finetune(out, overrides=overrides, options=options(callback=record))
    assert max(seen["finetune"]) == 6 and seen["finetune"].count(6) > 10


@pytest.mark.parametrize(("length", "trained_rows", "last"), [(7, 203, 7), (5, 204, 4)])
def test_an_epoch_skips_a_last_window_of_one_token_as_the_references_do(
    corpus, tmp_path, monkeypatch, length, trained_rows, last
):
    """awd-lstm-lm and MoS train ``while i < T - 1 - 1``: no window starts at row T - 2, where
    it would hold a single token. The tiny corpus has T = 205 rows of inputs and targets; fixed
    windows of 7 rows end exactly at row 203 = T - 2, so the epoch ends there, one row short;
    windows of 5 end at row 200 and a last window of 4 still trains up to row 204 = T - 1."""
    from highrank.data import load_corpus
    from highrank.models.backbones import BpttLength

    assert load_corpus(corpus).batchify("train", 4).size(0) == 205
    fixed = lambda bptt, rng, delta: BpttLength(length, length / bptt)  # noqa: E731
    monkeypatch.setattr(awd_recipe, "variable_bptt_length", fixed)
    lengths: list[int] = []

    def record(info):
        if info.epoch == 1:
            lengths.append(info.seq_len)

    train(tiny_config(corpus, tmp_path / "run", "train.epochs=1"), options=options(callback=record))
    assert sum(lengths) == trained_rows and lengths[-1] == last and 1 not in lengths


def test_divergence_before_any_checkpoint_says_none_was_saved(corpus, tmp_path, monkeypatch):
    poison(monkeypatch, set(range(1, 100)))
    config = tiny_config(corpus, tmp_path / "run", "train.max_nonfinite_skips=2")
    with pytest.raises(TrainingError, match="no checkpoint of this stage was saved yet"):
        train(config, options=QUIET)
    assert not (tmp_path / "run" / "checkpoints" / "last.pt").exists()


# ---- train.patience: early stopping at epoch ends ---------------------------------------------


def test_patience_stops_when_validation_stops_improving_and_a_resume_agrees(corpus, tmp_path):
    """A large min delta makes every epoch after the first 'not improved': patience 2 stops
    after epoch 3 (two epochs without an improvement of more than 10 nats)."""
    overrides = ("train.epochs=8", "train.patience=2", "train.patience_min_delta=10")
    result = train(tiny_config(corpus, tmp_path / "run", *overrides), options=QUIET)
    assert result.stop_reason == "patience" and result.epochs_completed == 3
    # stopped part-way (max_steps) and resumed: the same stop at the same epoch
    out = tmp_path / "resumed"
    train(tiny_config(corpus, out, *overrides), options=options(max_steps=40))
    again = resume(out, options=QUIET)
    assert again.stop_reason == "patience" and again.epochs_completed == 3
    assert trajectory(out) == trajectory(tmp_path / "run")


def test_without_patience_a_run_goes_to_its_epochs(corpus, tmp_path):
    result = train(tiny_config(corpus, tmp_path / "run", "train.epochs=3",
                               "train.patience_min_delta=10"), options=QUIET)
    assert result.stop_reason == "epochs" and result.epochs_completed == 3


def test_patience_counts_again_from_a_switch_to_averaged_sgd(corpus, tmp_path):
    """NT-ASGD switches when validation stalls, when patience would run out too: the count
    starts again in the averaged phase, so the averages get their epochs. ET-ASGD switching
    after epoch 2: without the restart patience 2 stopped after epoch 3, now after epoch 4."""
    overrides = ("train.epochs=8", "train.patience=2", "train.patience_min_delta=10",
                 "train.optimizer=et-asgd", "train.switch_epoch=2")
    result = train(tiny_config(corpus, tmp_path / "run", *overrides), options=QUIET)
    assert result.stop_reason == "patience" and result.epochs_completed == 4
    assert result.phase == "asgd"
