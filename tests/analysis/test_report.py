"""``highrank report``: one self-contained HTML page from what the run directories hold."""

from __future__ import annotations

import json
import shutil

import pytest

from highrank.analysis.rank import analyze_run
from highrank.analysis.report import collect_run, write_report
from highrank.cli import main
from highrank.runs.run_dir import RunDirError


@pytest.fixture
def runs(tiny_run, tmp_path):
    first = shutil.copytree(tiny_run, tmp_path / "first")
    second = shutil.copytree(tiny_run, tmp_path / "second")
    return first, second


def test_a_bare_run_gets_hints_naming_the_commands(runs, tmp_path):
    page = write_report([runs[0]], tmp_path / "out").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "highrank eval RUN_DIR --split test" in page
    assert "highrank analyze rank RUN_DIR" in page
    assert "data:image/png;base64," in page  # the training curve, embedded
    assert (tmp_path / "out" / "training.png").is_file()
    record = json.loads((tmp_path / "out" / "report.json").read_text())
    assert record["runs"][0]["head"] == "softmax" and record["runs"][0]["parameters"] > 0


def test_recorded_analyses_appear_with_their_numbers(runs, tmp_path):
    first, second = runs
    assert main(["eval", str(first), "--split", "test", "--no-progress"]) == 0
    rank = analyze_run(first, max_contexts=50)
    analyze_run(second, max_contexts=40)
    page = write_report([first, second], tmp_path / "out").read_text()
    test_ppl = json.loads((first / "eval-test-best.json").read_text())["perplexity"]
    assert f"{test_ppl:.4g}" in page
    row = (f"<tr><td>first</td><td>rank-test-best-first50</td><td>test</td>"
           f"<td>50 x {rank['shape'][1]}</td>")
    assert row + f"<td class='num'>{rank['press_rank']}</td>" in page
    assert "50 x " in page and "40 x " in page
    assert page.count("data:image/png;base64,") == 2  # training curves and spectrum
    assert "highrank eval RUN_DIR --split test" in page  # second has no eval yet


def test_an_eval_of_a_checkpoint_that_changed_since_is_marked_stale(runs, tmp_path):
    """A new user's walk: after a resumed training rewrote best.pt, the report showed the old
    test perplexity as the run's."""
    first, _ = runs
    assert main(["eval", str(first), "--split", "test", "--no-progress"]) == 0
    assert "STALE" not in write_report([first], tmp_path / "before").read_text()
    best = first / "checkpoints" / "best.pt"
    best.write_bytes(best.read_bytes() + b"\0")  # other bytes, as a resumed training writes
    page = write_report([first], tmp_path / "after").read_text()
    assert f"(STALE: best has changed since; rerun `highrank eval {first}`)" in page


def test_report_verb_and_a_folder_that_is_not_a_run(runs, tmp_path, capsys):
    assert main(["report", str(runs[0]), "--out", str(tmp_path / "out")]) == 0
    assert "report.html" in capsys.readouterr().out
    with pytest.raises(RunDirError, match="not a run directory"):
        collect_run(tmp_path)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "no config.toml" in capsys.readouterr().err


def test_two_rank_records_of_one_moved_run_give_two_curves(runs, tmp_path):
    first, _ = runs
    analyze_run(first, max_contexts=30)
    analyze_run(first, split="valid", max_contexts=30)
    moved = first.rename(tmp_path / "moved")  # the records still name the old folder
    write_report([moved], tmp_path / "out")
    record = json.loads((tmp_path / "out" / "report.json").read_text())
    assert len(record["runs"][0]["rank"]) == 2
    assert {r["run_dir"] for r in record["runs"][0]["rank"].values()} == {str(moved)}


def test_a_pickled_singular_values_file_is_one_line_and_runs_nothing(runs, tmp_path, capsys):
    """Issue: report on a pickled .npy ended in a traceback."""
    import numpy as np

    first = runs[0]
    rank = analyze_run(first, max_contexts=30)
    values = first / "analysis" / rank["singular_values_file"]
    np.save(values, np.array([object()], dtype=object), allow_pickle=True)
    capsys.readouterr()
    assert main(["report", str(first), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be read as a plain array" in err[0]


def test_an_out_that_is_an_existing_file_is_one_line(runs, tmp_path, capsys):
    """Issue 29: `report --out EXISTING_FILE` was a FileExistsError traceback."""
    (tmp_path / "taken").write_text("x")
    assert main(["report", str(runs[0]), "--out", str(tmp_path / "taken")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    taken = tmp_path / "taken"
    assert f"--out {taken}: {taken} is a file; expected a folder" in err[0]
    assert main(["report", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    assert f"run directory {tmp_path / 'nowhere'} does not exist" in capsys.readouterr().err


def test_saturation_and_gradient_records_appear_with_their_record_names(runs, tmp_path):
    """A new user's walk: the report showed five of the instruments, and two rank records
    of one run as two identical-looking rows."""
    first, _ = runs
    argv = ["--max-contexts", "20", "--no-progress"]
    assert main(["analyze", "saturation", str(first), *argv]) == 0
    assert main(["analyze", "gradient-bottleneck", str(first), *argv]) == 0
    analyze_run(first, max_contexts=20)
    analyze_run(first, max_contexts=20, batch_size=2)
    page = write_report([first], tmp_path / "out").read_text()
    assert "<h2>LM-head saturation</h2>" in page and "<h2>Gradient bottleneck</h2>" in page
    gradient = json.loads((first / "analysis" / "gradient-bottleneck-test-best-first20.json")
                          .read_text())
    assert "<td>gradient-bottleneck-test-best-first20</td>" in page
    assert f"{gradient['share']['mean']:.4g}" in page
    assert "<td>saturation-test-first20</td>" in page
    assert "<td>rank-test-best-first20</td>" in page
    assert "<td>rank-test-best-first20-b2</td>" in page


def test_hidden_size_unargmaxable_and_topk_records_have_sections(runs, tmp_path):
    """A new user's walk: three instruments' records were left out of the page."""
    first, second = runs
    assert main(["analyze", "hidden-size", str(first), "--max-contexts", "30"]) == 0
    assert main(["analyze", "unargmaxable", str(first)]) == 0
    assert main(["analyze", "topk", str(first), "--positions", "3", "--k", "2",
                 "--no-progress"]) == 0
    page = write_report([first, second], tmp_path / "out").read_text()
    hidden = json.loads((first / "analysis" / "hidden-size-test-best-first30.json").read_text())
    assert "<td>hidden-size-test-best-first30</td>" in page
    assert hidden["verdict"] in page.replace("&#x27;", "'")
    unarg = json.loads((first / "analysis" / "unargmaxable-best-box100.json").read_text())
    assert "<td>unargmaxable-best-box100</td>" in page
    assert f"<td class='num'>{unarg['unargmaxable']}</td>" in page
    top = json.loads((first / "analysis" / "topk-test-best.json").read_text())
    assert "<h3>first: topk-test-best</h3>" in page
    assert f"[{top['contexts'][0]['target']}]" in page  # the reference word, bracketed
    bare = write_report([second], tmp_path / "bare").read_text()  # no records: the commands
    for command in ("hidden-size RUN_DIR", "unargmaxable RUN_DIR", "topk RUN_DIR --random"):
        assert f"highrank analyze {command}" in bare and f"highrank analyze {command}" not in page
