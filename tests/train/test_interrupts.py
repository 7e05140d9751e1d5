"""Every moment of a run recoverable: SIGINT/SIGTERM save between two steps, checkpoints by
time, a run stopped before its first checkpoint starts again in place."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import highrank.train.awd_lstm as awd_recipe
from highrank.cli import main
from highrank.runs.checkpoint import load_checkpoint
from highrank.runs.run_dir import read_metrics
from highrank.train import Interrupted, TrainOptions, resume, train
from tests.conftest import TINY_AWD_LSTM_1EPOCH as TINY
from tests.conftest import tiny_awd_lstm


def send_at(step: int, *signals: int):
    """A callback that sends ``signals`` to this process after ``step``, one after another,
    each only once the handler it met has run (it puts the previous handler back): two
    signals sent back to back could otherwise coalesce into one before Python runs a handler
    (the usual precaution when a test signals itself).
    """

    def callback(info):
        if info.step == step:
            for number in signals:
                handler = signal.getsignal(number)
                signal.raise_signal(number)
                deadline = time.monotonic() + 10
                while signal.getsignal(number) is handler and time.monotonic() < deadline:
                    time.sleep(0.01)  # a sleep lets a pending handler run

    return callback


def losses(out: Path) -> list[tuple]:
    keys = ("kind", "epoch", "step", "train_loss", "val_loss")
    return [tuple(r.get(k) for k in keys) for r in read_metrics(out / "metrics.jsonl")]


def saved_step(out: Path) -> int:
    return load_checkpoint(out / "checkpoints" / "last.pt")["training"]["progress"]["step"]


@pytest.mark.parametrize(("number", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_between_two_steps_and_the_run_resumes_exactly(
    corpus, tmp_path, number, status
):
    train(tiny_awd_lstm(corpus, tmp_path / "straight"), options=TrainOptions(progress=False))
    out = tmp_path / "run"
    options = TrainOptions(progress=False, callback=send_at(5, number))
    before = signal.getsignal(number)
    with pytest.raises(Interrupted) as stopped:
        train(tiny_awd_lstm(corpus, out), options=options)
    assert signal.getsignal(number) == before  # the handlers were put back
    assert stopped.value.saved == out / "checkpoints" / "last.pt" and stopped.value.step == 5
    assert stopped.value.exit_status == status and saved_step(out) == 5
    assert load_checkpoint(out / "checkpoints/last.pt")["training"]["progress"]["stop_reason"] \
        == "interrupted"
    result = resume(out, options=TrainOptions(progress=False))
    assert losses(out) == losses(tmp_path / "straight")
    # the finished run's last checkpoint says why it ended, not why it once paused
    final = load_checkpoint(out / "checkpoints/last.pt")["training"]["progress"]
    assert result.stop_reason == final["stop_reason"] == "epochs"


@pytest.fixture
def usual_ctrl_c():
    """SIGINT raising KeyboardInterrupt, as in a terminal. A process started in the background
    by a non-interactive shell (CI's runner) inherits SIGINT *ignored*, and Python then keeps
    it ignored: a second Ctrl-C "acting as usual" would do nothing there."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_a_second_signal_interrupts_at_once_without_saving(corpus, tmp_path, usual_ctrl_c):
    out = tmp_path / "run"
    options = TrainOptions(progress=False, callback=send_at(5, signal.SIGINT, signal.SIGINT))
    with pytest.raises(KeyboardInterrupt) as stopped:
        train(tiny_awd_lstm(corpus, out, "train.checkpoint_minutes=0"), options=options)
    assert not isinstance(stopped.value, Interrupted)
    assert not (out / "checkpoints" / "last.pt").exists()


def test_cli_names_what_an_interrupt_saved(corpus, tmp_path, capsys, monkeypatch):
    real, calls = awd_recipe.training_loss, {"n": 0}

    def interrupted_at_the_third(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args)

    monkeypatch.setattr(awd_recipe, "training_loss", interrupted_at_the_third)
    out, empty = tmp_path / "run", tmp_path / "empty.toml"
    empty.write_text("")
    argv = ["train", str(empty), "--no-progress", f"--data.dir={corpus}", f"--run.out_dir={out}"]
    assert main([*argv, *(f"--{o}" for o in TINY)]) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"highrank train: interrupted by SIGINT at step 3; saved {out}/checkpoints/last.pt; "
        f"continue from it with `highrank train --resume {out}`"
    )


def test_last_checkpoint_is_also_saved_by_time(corpus, tmp_path):
    def crash_at(step):
        def callback(info):
            if info.step == step:
                raise RuntimeError("simulated crash")

        return callback

    for minutes, expected in (("1e-9", 5), ("0", None)):  # every step / never by time
        out = tmp_path / f"run-{minutes}"
        config = tiny_awd_lstm(corpus, out, f"train.checkpoint_minutes={minutes}")
        with pytest.raises(RuntimeError):
            train(config, options=TrainOptions(progress=False, callback=crash_at(5)))
        last = out / "checkpoints" / "last.pt"
        assert (saved_step(out) if last.exists() else None) == expected


def test_a_run_stopped_before_its_first_checkpoint_starts_again_in_place(corpus, tmp_path, capsys):
    def crash(info):
        if info.step == 3:
            raise KeyboardInterrupt("a crash before any checkpoint")

    train(tiny_awd_lstm(corpus, tmp_path / "straight"), options=TrainOptions(progress=False))
    out = tmp_path / "run"
    config = tiny_awd_lstm(corpus, out, "train.checkpoint_minutes=0")
    for again in (
        lambda: resume(out, options=TrainOptions(progress=False)),
        lambda: train(config, options=TrainOptions(progress=False)),
    ):
        with pytest.raises(KeyboardInterrupt):
            train(config, options=TrainOptions(progress=False, callback=crash))
        assert not any((out / "checkpoints").iterdir())
        result = again()
        assert result.stop_reason == "epochs" and losses(out) == losses(tmp_path / "straight")
        assert "stopped before its first checkpoint; starting it again" in capsys.readouterr().err
        for path in (out / "checkpoints").iterdir():
            path.unlink()  # the next round starts from a run with no checkpoint again
    train(config, options=TrainOptions(progress=False, max_steps=1))  # now it has one
    with pytest.raises(ValueError, match="already holds a run"):
        train(config, options=TrainOptions(progress=False))


def test_cli_says_when_an_interrupt_saved_nothing(corpus, tmp_path, capsys, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt  # a second Ctrl-C inside a step: no clean point to save at

    monkeypatch.setattr(awd_recipe, "training_loss", interrupted)
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    argv = ["train", str(empty), "--no-progress", f"--data.dir={corpus}"]
    assert main([*argv, f"--run.out_dir={tmp_path / 'run'}", *(f"--{o}" for o in TINY)]) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("highrank train: interrupted; nothing was saved now; continue from")


def test_an_application_may_keep_its_own_signal_handlers(corpus, tmp_path):
    seen = []
    before = signal.signal(signal.SIGTERM, lambda number, frame: seen.append(number))
    try:
        options = TrainOptions(progress=False, callback=send_at(2, signal.SIGTERM))
        options.catch_signals, options.max_steps = False, 4
        result = train(tiny_awd_lstm(corpus, tmp_path / "run"), options=options)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert seen == [signal.SIGTERM] and result.stop_reason == "max_steps" and result.steps == 4


def test_a_resume_says_when_the_metrics_file_lost_lines(corpus, tmp_path, capsys):
    """Issue: a metrics.jsonl shorter than the checkpoint's record was continued silently."""
    out = tmp_path / "run"
    train(tiny_awd_lstm(corpus, out), options=TrainOptions(progress=False, max_steps=6))
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(lines[:2]))
    capsys.readouterr()
    resume(out, options=TrainOptions(progress=False))
    err = capsys.readouterr().err
    assert f"lacks {len(lines) - 2} lines of the train history" in err


@pytest.mark.parametrize("rank, says", [("0", True), ("1", False)])
def test_under_torchrun_only_process_zero_says_what_an_interrupt_saved(
    tmp_path, capsys, monkeypatch, rank, says
):
    """Campaign: a SIGTERM to a two-process run printed "interrupted ... saved last.pt" from
    both processes, although only process 0 writes the run directory."""
    from highrank.cli.common import guarded

    for key, value in {"RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": rank}.items():
        monkeypatch.setenv(key, value)
    saved = tmp_path / "run" / "checkpoints" / "last.pt"

    def job():
        raise Interrupted("SIGTERM", 143, saved, 40)

    assert guarded("train", job) == 143
    assert ("interrupted by SIGTERM at step 40" in capsys.readouterr().err) == says


def test_a_caught_signal_is_announced_at_once(capsys, monkeypatch):
    """Issue 29: a Ctrl-C waiting for the step boundary said nothing until the step ended
    (minutes under load); the handler now says at once that the run stops after this step."""
    from highrank.train import distributed
    from highrank.train.interrupts import SignalCatcher

    with SignalCatcher() as caught:
        signal.raise_signal(signal.SIGINT)
        err = capsys.readouterr().err  # still inside the "step"
        assert caught.name == "SIGINT"
    assert err == (
        "highrank: SIGINT received: stopping after the current step (Ctrl-C again stops at "
        "once, saving nothing)\n"
    )
    with SignalCatcher(once=False) as caught:  # torchrun: every signal caught, said once
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
    assert capsys.readouterr().err == (
        "highrank: SIGTERM received: stopping after the current step\n"
    )
    for key in distributed.ENV_KEYS:  # process 1 of a torchrun job: process 0 says it
        monkeypatch.setenv(key, "1")
    with SignalCatcher(once=False) as caught:
        signal.raise_signal(signal.SIGINT)
    assert caught.name == "SIGINT" and capsys.readouterr().err == ""
