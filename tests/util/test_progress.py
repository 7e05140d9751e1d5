"""Progress output: a tqdm bar on a terminal, a plain line now and then in a log file."""

from __future__ import annotations

import io
from pathlib import Path

from tqdm.auto import tqdm

from highrank.util.progress import LineProgress, progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_tqdm_and_a_file_gets_lines():
    assert isinstance(progress_bar(total=3, desc="x", file=Terminal()), tqdm)
    assert isinstance(progress_bar(total=3, desc="x", file=io.StringIO()), LineProgress)
    assert progress_bar(total=3, desc="x", file=io.StringIO(), disable=True).disable


def test_lines_come_once_per_interval_and_at_the_end(monkeypatch):
    clock = iter(range(0, 10_000, 10))  # every call to monotonic advances 10 s
    monkeypatch.setattr("highrank.util.progress.time.monotonic", lambda: next(clock))
    out = io.StringIO()
    with LineProgress(100, "eval", "seg", file=out, seconds=25) as bar:
        for _ in range(10):
            bar.update(10)
            bar.set_postfix({"loss": "1.0"})
    lines = out.getvalue().splitlines()
    assert 1 < len(lines) < 10  # not one per update
    assert lines[-1].startswith("eval: 100/100 seg (100%), ") and lines[-1].endswith("loss=1.0")
    assert "\r" not in out.getvalue()


def test_lines_keep_the_tqdm_methods_callers_use():
    out = io.StringIO()
    with LineProgress(2, "first", "step", file=out) as bar:
        bar.set_description("softmax")  # the demo names each head this way
        bar.update(2)
    assert out.getvalue().startswith("softmax: 2/2 step (100%)")


def test_train_and_eval_logs_to_a_file_hold_lines_not_bars(tmp_path, capsys, monkeypatch):
    from highrank.cli import main
    from tests.conftest import TINY_AWD_LSTM_1EPOCH as TINY

    monkeypatch.setenv("HIGHRANK_PROGRESS_SECONDS", "0")  # a line per update: easy to see
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = " ".join(f"w{i % 17}" for i in range(40))
    for split in ("train", "valid", "test"):
        (corpus / f"{split}.txt").write_text((words + "\n") * 20)
    config = tmp_path / "c.toml"
    config.write_text("# defaults\n")
    out = tmp_path / "run"
    overrides = [f"--{o}" for o in TINY]
    assert main(["train", str(config), f"--data.dir={corpus}", f"--run.out_dir={out}",
                 *overrides]) == 0  # fmt: skip
    log = capsys.readouterr().err  # captured: not a terminal
    assert "\r" not in log
    assert any(line.startswith("train epoch 1: ") and " tok/s" in line for line in log.splitlines())
    assert main(["eval", str(out)]) == 0
    log = capsys.readouterr().err
    assert "\r" not in log and "eval: " in log
    assert Path(out / "eval-test-best.json").is_file()


def test_lines_say_about_how_long_is_left(monkeypatch):
    clock = iter(range(0, 10_000, 10))  # every call to monotonic advances 10 s
    monkeypatch.setattr("highrank.util.progress.time.monotonic", lambda: next(clock))
    out = io.StringIO()
    bar = LineProgress(1000, "cache", "win", file=out, seconds=0)  # started at 0 s
    bar.update(10)  # read at 20 s: 0.5 win/s, 990 to go: 1,980 s
    assert out.getvalue().splitlines()[-1].endswith("0.5 win/s, about 33 min left")


def test_a_max_steps_run_counts_its_bar_in_steps_to_the_limit(tmp_path, capsys, monkeypatch):
    """Issue: with --max-steps the bar counted the epoch's tokens, so its end and time
    estimate were the epoch's."""
    from highrank.cli import main
    from tests.conftest import TINY_AWD_LSTM_1EPOCH as TINY

    monkeypatch.setenv("HIGHRANK_PROGRESS_SECONDS", "0")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    line = " ".join(f"w{i % 17}" for i in range(40)) + "\n"
    for split in ("train", "valid", "test"):
        (corpus / f"{split}.txt").write_text(line * 20)
    (tmp_path / "c.toml").write_text("# defaults\n")
    argv = ["train", str(tmp_path / "c.toml"), f"--data.dir={corpus}",
            f"--run.out_dir={tmp_path / 'run'}", *(f"--{o}" for o in TINY), "--max-steps", "3"]
    assert main(argv) == 0
    lines = capsys.readouterr().err.splitlines()
    assert any(line.startswith("train to --max-steps 3: 3/3 step (100%)") for line in lines)


def test_below_a_tenth_per_second_a_line_shows_seconds_per_step(monkeypatch):
    """Issue 29: under load the training line showed `0.0 step/s`."""
    clock = iter(range(0, 10_000, 10))  # every call to monotonic advances 10 s
    monkeypatch.setattr("highrank.util.progress.time.monotonic", lambda: next(clock))
    out = io.StringIO()
    bar = LineProgress(20, "train to --max-steps 20", "step", file=out, seconds=0)  # 0 s
    bar.update(1)  # read at 20 s: 0.05 step/s
    line = out.getvalue().splitlines()[-1]
    assert "1/20 step (5%), 20 s/step, about 6 min left" in line and "0.0 step/s" not in line
    bar.update(9)  # read at 40 s: 0.25 step/s, as before
    assert "10/20 step (50%), 0.2 step/s" in out.getvalue().splitlines()[-1]
