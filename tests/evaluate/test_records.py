"""Eval records name what they came from and never overwrite the full-data figure; report
and compare show the source and prefer the finetuned checkpoint (issue 12)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from highrank.analysis.significance import compare_runs
from highrank.cli import main
from highrank.evaluate.records import file_sha256
from highrank.train import TrainOptions, train
from tests.conftest import tiny_awd_lstm, write_train_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The training corpus (its test split holds more than 100 tokens): read-only."""
    return write_train_corpus(tmp_path_factory.mktemp("records") / "corpus")


@pytest.fixture(scope="module")
def trained(corpus) -> Path:
    """One epoch of the tiny 2-layer AWD-LSTM on ``corpus``, trained once: read-only."""
    out = corpus.parent / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a module fixture runs before the per-test one-thread fixture
    try:
        train(tiny_awd_lstm(corpus, out), options=TrainOptions(progress=False))
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run: the tests write records into it."""
    return shutil.copytree(trained, tmp_path / "run")


def evaluate(*argv: str) -> None:
    assert main([*argv, "--no-progress"]) == 0


def test_records_name_checkpoint_and_data_and_other_data_gets_another_name(run, corpus, tmp_path):
    evaluate("eval", str(run))
    default = json.loads((run / "eval-test-best.json").read_text())
    assert default["checkpoint_sha256"] == file_sha256(run / "checkpoints" / "best.pt")
    assert default["checkpoint_file"] == str((run / "checkpoints" / "best.pt").resolve())
    assert default["data_dir"] == str(corpus.resolve()) and default["split"] == "test"
    assert default["data_sha256"] == file_sha256(corpus / "test.txt")
    assert default["default_data"] is True and default["tokens"] > 100

    evaluate("eval", str(run), "--max-tokens", "40")
    first = json.loads((run / "eval-test-best-first40.json").read_text())
    assert first["tokens"] == 39 and first["default_data"] is False  # 40 tokens, 39 predicted

    subset = tmp_path / "subset"
    shutil.copytree(corpus, subset)
    lines = (corpus / "test.txt").read_text().splitlines()
    (subset / "test.txt").write_text("\n".join(lines[:10]) + "\n")
    evaluate("eval", str(run), "--data-dir", str(subset))
    other = list(run.glob("eval-test-best-data*.json"))
    assert len(other) == 1 and other[0].name == (
        f"eval-test-best-data{file_sha256(subset / 'test.txt')[:8]}.json"
    )
    # the full test set's figure is untouched
    assert json.loads((run / "eval-test-best.json").read_text()) == default

    evaluate("dynamic-eval", str(run), "--max-tokens", "30", "--max-stats-batches", "2")
    dynamic = json.loads((run / "dynamic-eval-test-best-first30.json").read_text())
    assert dynamic["tokens"] == 29 and dynamic["max_tokens"] == 30


def test_report_shows_the_source_and_prefers_the_finetuned_figure(run, tmp_path):
    evaluate("eval", str(run), "--max-tokens", "40")
    evaluate("eval", str(run))
    # as if finetuning had improved on best.pt (its weights do not matter here)
    shutil.copy(run / "checkpoints" / "best.pt", run / "checkpoints" / "finetuned.pt")
    evaluate("eval", str(run), "--which", "finetuned")
    assert main(["report", str(run), "--out", str(tmp_path / "report")]) == 0
    page = (tmp_path / "report" / "report.html").read_text()
    finetuned = json.loads((run / "eval-test-finetuned.json").read_text())
    assert f"run test ppl: finetuned.pt on {finetuned['data_dir']} test" in page
    assert format(finetuned["perplexity"], ".4g") in page


def fake_run(folder: Path, ppl: float, finetuned: float | None = None) -> str:
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text("[train]\nseed = 1\n")  # a run of `highrank train`
    for which, value in (("best", ppl), ("finetuned", finetuned)):
        if value is not None:
            record = {"split": "test", "perplexity": value, "tokens": 100, "data_dir": "/d",
                      "checkpoint_file": f"/r/{which}.pt", "default_data": True}  # fmt: skip
            (folder / f"eval-test-{which}.json").write_text(json.dumps(record))
    return str(folder)


def test_compare_prefers_finetuned_records_and_names_them(tmp_path):
    a = [fake_run(tmp_path / "a1", 60.0, 58.0), fake_run(tmp_path / "a2", 61.0)]
    b = [fake_run(tmp_path / "b1", 70.0), fake_run(tmp_path / "b2", 71.0)]
    record = compare_runs({"A": a, "B": b}, which="auto")
    assert record["groups"]["A"]["perplexities"] == [58.0, 61.0]
    assert record["groups"]["A"]["sources"][0].startswith("finetuned.pt on /d test")
    assert record["groups"]["A"]["sources"][1].startswith("best.pt on /d test")


def test_finetune_from_last_and_one_missing_best_hint_everywhere(corpus, tmp_path, capsys):
    out = tmp_path / "short"
    train(tiny_awd_lstm(corpus, out), options=TrainOptions(progress=False, max_steps=3))
    messages = []
    for argv in (["eval", str(out)], ["dynamic-eval", str(out)], ["finetune", str(out)],
                 ["analyze", "rank", str(out)]):  # fmt: skip
        assert main([*argv, "--no-progress"]) == 2
        err = [x for x in capsys.readouterr().err.splitlines() if not x.startswith("note:")]
        messages.append(err[-1].split(": ", 1)[1])  # without the verb's name
    assert len(set(messages)) == 1 and "pass --which last" in messages[0]
    assert main(["finetune", str(out), "--which", "last", "--finetune.epochs=1"]) == 0
    assert (out / "checkpoints" / "finetune-last.pt").is_file()
