"""Run directories (issue 12): one writer at a time, checkpoints of the run only, whole
metrics lines, finetune records kept, killed writes' temporaries removed; and the bad inputs
of a run (disk full, out_dir a file, last.pt a directory, unreadable split, CUDA on a CPU
build, an absurd model size): one line, status 2, nothing written."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from highrank.cli import main
from highrank.runs.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from highrank.runs.locks import LockedError, run_lock
from highrank.runs.run_dir import read_metrics
from highrank.train import TrainOptions, finetune, resume, train
from tests.conftest import TINY_AWD_LSTM_1EPOCH as TINY
from tests.conftest import tiny_awd_lstm, write_train_corpus

QUIET = TrainOptions(progress=False)
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "run-v1" / "run"


def cli_train(corpus: Path, out: Path, *extra: str) -> list[str]:
    config = corpus.parent / "empty.toml"  # the defaults; the overrides make it tiny
    config.write_text("# defaults\n")
    return ["train", str(config), "--no-progress", f"--data.dir={corpus}", f"--run.out_dir={out}",
            *[f"--{o}" for o in TINY], *extra]  # fmt: skip


def one_error_line(capsys) -> str:
    """The one line on stderr (TensorBoard's once-per-process note aside)."""
    err = [x for x in capsys.readouterr().err.strip().splitlines() if not x.startswith("note:")]
    assert len(err) == 1, err
    return err[0]


# ---- the lock -------------------------------------------------------------------------------


def test_a_second_writer_is_refused_naming_the_holders_pid(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    train(tiny_awd_lstm(corpus, out), options=TrainOptions(progress=False, max_steps=4))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from highrank.runs.locks import run_lock\n"
         f"with run_lock({str(out)!r}):\n print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        before = (out / "metrics.jsonl").read_bytes()
        assert main(["train", "--resume", str(out), "--no-progress"]) == 2
        assert f"is in use by pid {holder.pid}" in one_error_line(capsys)
        assert (out / "metrics.jsonl").read_bytes() == before  # nothing written
    finally:
        holder.kill()
        holder.wait()
    # the holder died without releasing anything: its lock is gone with it
    assert resume(out, options=TrainOptions(progress=False, max_steps=6)).steps == 6


def test_the_lock_is_reentrant_in_a_process_and_exclusive_across(tmp_path):
    with run_lock(tmp_path / "r"), run_lock(tmp_path / "r"):
        assert (tmp_path / "r" / ".lock").read_text().startswith(str(os.getpid()))
    with pytest.raises(LockedError):  # another open file description: flock says no
        import fcntl

        with run_lock(tmp_path / "r"):
            handle = os.open(tmp_path / "r" / ".lock", os.O_RDWR)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LockedError("held") from None
            finally:
                os.close(handle)


def test_a_failed_start_leaves_no_directory_behind(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(RuntimeError), run_lock(out):
        raise RuntimeError("bad input")
    assert not out.exists()


# ---- checkpoints of another run --------------------------------------------------------------


def test_resume_refuses_another_runs_checkpoint(corpus, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    three_steps = TrainOptions(progress=False, max_steps=3)
    train(tiny_awd_lstm(corpus, a), options=three_steps)
    train(tiny_awd_lstm(corpus, b, "model.d_hidden=14"), options=three_steps)
    shutil.copy(b / "checkpoints" / "last.pt", a / "checkpoints" / "last.pt")
    with pytest.raises(CheckpointError, match="belongs to another run"):
        resume(a, options=QUIET)


def test_a_checkpoint_without_run_id_but_another_model_is_refused(corpus, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    three_steps = TrainOptions(progress=False, max_steps=3)
    train(tiny_awd_lstm(corpus, a), options=three_steps)
    train(tiny_awd_lstm(corpus, b, "model.d_hidden=14"), options=three_steps)
    payload = load_checkpoint(b / "checkpoints" / "last.pt")
    del payload["run_id"], payload["digest"]
    save_checkpoint(payload, a / "checkpoints" / "last.pt")
    with pytest.raises(CheckpointError, match=r"different \[model\]"):
        resume(a, options=QUIET)


def test_the_v1_fixture_without_run_ids_still_resumes(tmp_path):
    """The fixture's checkpoints name the corpus folder of the machine that made them: the
    corpus is written again (the training corpus, as make_fixture.py wrote it) and given by
    data.dir, and the resumed step equals the straight run's (straight-metrics.jsonl)."""
    run = tmp_path / "v1"
    shutil.copytree(FIXTURE, run)
    assert "run_id" not in (run / "environment.json").read_text()
    payload = load_checkpoint(run / "checkpoints" / "last.pt")
    assert "run_id" not in payload and "metrics_lines" not in payload["training"]
    step = payload["training"]["progress"]["step"]
    corpus = write_train_corpus(tmp_path / "corpus")
    resume(run, overrides=[f"data.dir={corpus}", "run.device=cpu"],  # the twin ran on a CPU
           options=TrainOptions(progress=False, max_steps=step + 1))
    straight = [json.loads(line) for line in (FIXTURE.parent / "straight-metrics.jsonl").open()]
    resumed = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    expected = next(r for r in straight if r["kind"] == "step" and r["step"] == step + 1)
    got = next(r for r in resumed if r["kind"] == "step" and r["step"] == step + 1)
    assert got["train_loss"] == expected["train_loss"]


# ---- metrics.jsonl -----------------------------------------------------------------------------


def test_resume_cuts_a_torn_line_and_report_readers_skip_one(corpus, tmp_path):
    out = tmp_path / "run"
    train(tiny_awd_lstm(corpus, out), options=TrainOptions(progress=False, max_steps=4))
    metrics = out / "metrics.jsonl"
    whole = metrics.read_bytes()
    metrics.write_bytes(whole + b'{"kind": "step", "stage": "tr')  # a write killed mid-line
    with pytest.warns(UserWarning, match="torn last line"):
        assert len(read_metrics(metrics)) == whole.count(b"\n")
    resume(out, options=TrainOptions(progress=False, max_steps=5))
    lines = metrics.read_bytes().splitlines(keepends=True)
    assert all(line.endswith(b"\n") for line in lines)
    assert [json.loads(line)["step"] for line in lines if b'"step"' in line][-1] == 5


def test_resuming_training_after_finetune_keeps_the_finetune_records(corpus, tmp_path):
    out = tmp_path / "run"
    train(tiny_awd_lstm(corpus, out), options=QUIET)
    finetune(out, overrides=["finetune.epochs=1"], options=QUIET)
    stages = [r["stage"] for r in read_metrics(out / "metrics.jsonl")]
    assert "finetune" in stages
    resume(out, overrides=["train.epochs=2"], options=QUIET)
    after = [r["stage"] for r in read_metrics(out / "metrics.jsonl")]
    assert after.count("finetune") == stages.count("finetune")
    assert after.count("train") > stages.count("train")


def test_a_disk_full_record_write_leaves_no_half_line(corpus, tmp_path, monkeypatch, capsys):
    import highrank.runs.run_dir as runs

    out = tmp_path / "run"
    calls = {"n": 0}
    real = runs._append

    def full_at_fifth(handle, line):
        calls["n"] += 1
        if calls["n"] == 5:
            handle.write(line[:7])  # part of the line reached the disk
            raise OSError(errno.ENOSPC, "No space left on device")
        real(handle, line)

    monkeypatch.setattr(runs, "_append", full_at_fifth)
    assert main(cli_train(corpus, out)) == 2
    assert "No space left on device" in one_error_line(capsys)
    data = (out / "metrics.jsonl").read_bytes()
    assert data.endswith(b"\n") and data.count(b"\n") == 4


def test_disk_full_while_saving_a_checkpoint_is_one_line_and_keeps_the_last(
    corpus, tmp_path, monkeypatch, capsys
):
    import highrank.runs.checkpoint as checkpoint

    out = tmp_path / "run"
    train(tiny_awd_lstm(corpus, out), options=TrainOptions(progress=False, max_steps=3))
    before = (out / "checkpoints" / "last.pt").read_bytes()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    assert main(["train", "--resume", str(out), "--no-progress", "--max-steps", "5"]) == 2
    line = one_error_line(capsys)
    assert "No space left on device" in line and "last.pt" in line
    assert (out / "checkpoints" / "last.pt").read_bytes() == before
    assert not list((out / "checkpoints").glob(".*.tmp"))


def test_temporaries_of_killed_writes_are_removed_on_the_next_start(corpus, tmp_path):
    out = tmp_path / "run"
    train(tiny_awd_lstm(corpus, out), options=TrainOptions(progress=False, max_steps=3))
    stale = [out / "checkpoints" / ".last.pt.abc123.tmp", out / ".metrics.jsonl.x1.tmp"]
    for path in stale:
        path.write_bytes(b"half")
    keep = out / "notes.tmp"  # not one of the run's own patterns
    keep.write_text("mine")
    resume(out, options=TrainOptions(progress=False, max_steps=4))
    assert not any(p.exists() for p in stale) and keep.exists()


# ---- bad inputs of a run: one line, status 2, nothing written -------------------------------


def test_out_dir_that_is_a_file(corpus, tmp_path, capsys):
    out = tmp_path / "file"
    out.write_text("x")
    assert main(cli_train(corpus, out)) == 2
    assert "is a file; expected a directory" in one_error_line(capsys)
    assert out.read_text() == "x"


def test_last_pt_that_is_a_directory(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    train(tiny_awd_lstm(corpus, out), options=TrainOptions(progress=False, max_steps=3))
    (out / "checkpoints" / "last.pt").unlink()
    (out / "checkpoints" / "last.pt").mkdir()
    commands = (out / "command.txt").read_text()
    assert main(["train", "--resume", str(out), "--no-progress"]) == 2
    assert "last.pt is a directory" in one_error_line(capsys)
    assert (out / "command.txt").read_text() == commands


def test_an_unreadable_split(corpus, tmp_path, capsys, monkeypatch):
    real = Path.read_bytes

    def denied(self):
        if self.name == "valid.txt":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", denied)
    assert main(cli_train(corpus, tmp_path / "run")) == 2
    assert "cannot read split file" in one_error_line(capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0,
    reason="running as root: file permissions do not stop root from reading the split",
)
def test_an_unreadable_split_by_permissions(corpus, tmp_path, capsys):
    (corpus / "valid.txt").chmod(0)
    try:
        assert main(cli_train(corpus, tmp_path / "run")) == 2
        assert "Permission denied" in one_error_line(capsys)
    finally:
        (corpus / "valid.txt").chmod(0o644)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch build has a CUDA device")
def test_cuda_on_a_cpu_build(corpus, tmp_path, capsys):
    assert main(cli_train(corpus, tmp_path / "run", "--run.device=cuda")) == 2
    assert "run.device = 'cuda'" in one_error_line(capsys)
    assert not (tmp_path / "run").exists()


def test_an_absurd_model_size_is_refused_before_allocating(corpus, tmp_path, capsys):
    start = time.perf_counter()
    args = cli_train(corpus, tmp_path / "run", "--model.d_hidden=2000000", "--run.device=cpu")
    assert main(args) == 2
    line = one_error_line(capsys)
    assert "parameters" in line and "GiB is available on cpu" in line
    assert time.perf_counter() - start < 30  # counted on the meta device
    assert not (tmp_path / "run").exists()


def test_a_corpus_of_the_same_words_in_another_frequency_order_names_the_first_id(
    corpus, tmp_path, capsys
):
    """Campaign: the refusal said "a different vocabulary (8683 vs 8683 tokens)"."""
    out = tmp_path / "run"
    assert main(cli_train(corpus, out, "--max-steps", "2")) == 0
    reordered = tmp_path / "reordered"
    shutil.copytree(corpus, reordered)
    rare = json.loads((out / "vocab.json").read_text())["words"][-1]
    text = (reordered / "train.txt").read_text()
    (reordered / "train.txt").write_text(text + f"{rare} " * 500 + "\n")  # now the most frequent
    capsys.readouterr()
    assert main(["train", "--resume", str(out), f"--data.dir={reordered}", "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert "different vocabulary" in line and "tokens, but id 0 is" in line, line
