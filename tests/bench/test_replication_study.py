"""benchmarks/replication_study.py: equal parameter counts, the plan, resumability, and (slow)
the whole pipeline on a tiny corpus."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from highrank.config import load_config
from highrank.train import parameter_count

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "replication_study.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("replication_study", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_head_gets_the_softmax_parameter_count_within_two_percent(study):
    sizes = study.matched_hidden_sizes()
    assert set(sizes) == set(study.HEADS)
    counts = {
        head: parameter_count(
            load_config(study.config_path(head), [f"model.d_hidden={d}"]), study.PTB_VOCAB
        )
        for head, d in sizes.items()
    }
    target = counts["softmax"]
    assert all(abs(c - target) <= 0.02 * target for c in counts.values()), counts
    assert sizes["moc"] < sizes["softmax"]  # MoC-15's head is the largest: a narrower LSTM


def test_plan_counts_seeds_and_a_finished_stage_is_not_redone(study, tmp_path, capsys):
    args = study.parse_arguments(
        ["--heads", "softmax,gss", "--seeds", "2", "--extra-seeds", "1",
         "--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "results")]
    )
    runs = study.plan(args)
    assert [r.name for r in runs] == ["softmax-seed1", "gss-seed1", "softmax-seed2",
                                      "gss-seed2", "softmax-seed3"]  # seed-major
    assert len(study.remaining(args, runs)) == 4 * 5
    done = tmp_path / "runs" / "gss-seed1"
    done.mkdir(parents=True)
    (done / "study-train.done").write_text("")
    (done / "eval-test-best.json").write_text("{}")
    left = study.remaining(args, runs)
    assert len(left) == 4 * 5 - 2
    assert all(t.run.name != "gss-seed1" or t.stage in ("rank", "kl") for t in left)
    study.print_plan(args, left)
    assert "remaining: 18 stages" in capsys.readouterr().out


def test_measured_stage_times_replace_the_prior_estimates(study, tmp_path):
    args = study.parse_arguments(["--results", str(tmp_path), "--runs", str(tmp_path / "r")])
    task = study.Task(study.Run("mos", 1), "train")
    assert study.estimate_seconds(args, task) == study.PRIOR_EPOCH_SECONDS["mos"] * args.epochs
    study.record_timing(args, task, 10.0)
    study.record_timing(args, task, 30.0)
    study.record_timing(args, task, 20.0)
    assert study.estimate_seconds(args, task) == 20.0
    assert json.loads((tmp_path / "timings.json").read_text()) == {"train:mos": [10.0, 30.0, 20.0]}


def test_bad_arguments_are_refused(study):
    with pytest.raises(SystemExit):
        study.parse_arguments(["--heads", "softmax,nope"])
    with pytest.raises(SystemExit):
        study.parse_arguments(["--epochs", "1"])


@pytest.mark.slow
def test_the_whole_study_runs_and_resumes_on_a_tiny_corpus(study, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = [f"w{i}" for i in range(30)]
    for split, lines in (("train", 300), ("valid", 40), ("test", 40)):
        text = "\n".join(" ".join(words[(i * 7 + j) % 30] for j in range(8)) for i in range(lines))
        (corpus / f"{split}.txt").write_text(text + "\n")
    tiny = [f"--data.dir={corpus}", "--model.d_embed=8", "--model.n_layers=1",
            "--train.batch_size=4", "--train.bptt=8", "--train.eval_batch_size=2",
            "--train.log_every=10"]
    argv = ["--heads", "softmax,mos", "--seeds", "2", "--extra-seeds", "0", "--epochs", "2",
            "--rank-contexts", "50", "--runs", str(tmp_path / "runs"),
            "--results", str(tmp_path / "results")]
    for override in tiny:
        argv.append(f"--override={override}")
    assert study.main(argv) == 0
    summary = json.loads((tmp_path / "results" / "summary.json").read_text())
    assert set(summary["heads"]) == {"softmax", "mos"}
    assert len(summary["runs"]) == 4
    commands = (tmp_path / "results" / "commands.txt").read_text().splitlines()
    assert study.main(argv) == 0  # a rerun trains nothing again
    again = (tmp_path / "results" / "commands.txt").read_text().splitlines()
    assert not any(" train " in line for line in again[len(commands):])
