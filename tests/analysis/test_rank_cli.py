"""``highrank analyze rank``: files per run, the combined outputs, reuse and resume."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from highrank.analysis.logprob_matrix import write_log_prob_matrix
from highrank.analysis.output import record_tag
from highrank.analysis.rank import analyze_run, rank_report
from highrank.analysis.spectrum import cumulative_share
from highrank.cli import main


@pytest.fixture
def run_copy(tiny_run, tmp_path):
    return shutil.copytree(tiny_run, tmp_path / "run")


def test_analyze_rank_writes_the_record_values_and_combined_outputs(run_copy, tmp_path, capsys):
    status = main(
        [
            "analyze",
            "rank",
            str(run_copy),
            "--keep-matrix",
            "--no-progress",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert "Press rank" in printed and "run (softmax, test-best)" in printed
    folder = run_copy / "analysis"
    record = json.loads((folder / "rank-test-best.json").read_text())
    matrix = np.load(folder / "logprob-test-best.npy")
    expected = rank_report(matrix)
    assert record["press_rank"] == expected["press_rank"]
    assert record["effective_rank"] == expected["effective_rank"]
    assert record["shape"] == list(matrix.shape) and record["head"] == "softmax"
    values = np.load(folder / record["singular_values_file"])
    np.testing.assert_allclose(values, expected["singular_values"], rtol=1e-4, atol=1e-5)
    for name in ("rank.json", "rank.md", "spectrum.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert not (folder / "rank-test-best.state").exists()


def test_the_matrix_is_deleted_unless_kept_and_reused_when_it_matches(run_copy, monkeypatch):
    record = analyze_run(run_copy, split="valid", max_contexts=30)
    tag = record_tag("valid", "best", max_contexts=30)
    assert tag == "valid-best-first30" and record["shape"][0] == 30
    assert not (run_copy / "analysis" / f"logprob-{tag}.npy").exists()

    analyze_run(run_copy, split="valid", max_contexts=30, keep_matrix=True)
    import highrank.analysis.rows as rows

    def no_model(*args, **kwargs):
        raise AssertionError("the kept matrix should have been reused")

    monkeypatch.setattr(rows, "load_run_split", no_model)
    again = analyze_run(run_copy, split="valid", max_contexts=30, keep_matrix=True)
    assert again["press_rank"] == record["press_rank"]


def test_logits_kind_and_bad_run_dir(run_copy, tmp_path, capsys):
    record = analyze_run(run_copy, kind="logits", max_contexts=40)
    assert record["kind"] == "logits" and record["shape"] == [40, record["shape"][1]]
    status = main(["analyze", "rank", str(tmp_path / "nowhere"), "--no-progress"])
    assert status == 2
    assert "nowhere" in capsys.readouterr().err


def test_cumulative_share_counts_values_strictly_below():
    values = np.array([8.0, 1.0, 0.5, 0.125])  # normalised: 1, 1/8, 1/16, 1/64 (exact)
    share = cumulative_share(values, np.array([0.01, 1 / 64, 0.07, 1.0, 2.0]))
    np.testing.assert_allclose(share, [0, 0, 0.5, 0.75, 1.0])
    with pytest.raises(ValueError, match="positive singular value"):
        cumulative_share(np.zeros(3), np.array([1.0]))


def test_a_matrix_from_other_settings_or_an_older_checkpoint_is_rewritten(run_copy, monkeypatch):
    import highrank.analysis.rows as rows
    from highrank.analysis.contexts import load_run_split

    matrix = run_copy / "analysis" / "logprob-test-best-first30.npy"
    loaded = load_run_split(run_copy, "test")
    # written by the library with different reading options and no head name: rewritten
    write_log_prob_matrix(
        matrix,
        loaded.model,
        loaded.ids,
        bptt=5,
        max_contexts=30,
        metadata={"split": "test", "which": "best"},
    )
    calls = []
    real = rows.load_run_split
    monkeypatch.setattr(
        rows, "load_run_split", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    analyze_run(run_copy, max_contexts=30, keep_matrix=True)
    analyze_run(run_copy, max_contexts=30, keep_matrix=True)  # reused: same settings
    assert len(calls) == 1
    best = run_copy / "checkpoints" / "best.pt"
    best.touch()  # as if training had written a new best checkpoint
    os.utime(best, ns=(best.stat().st_atime_ns, best.stat().st_mtime_ns + 10**9))
    analyze_run(run_copy, max_contexts=30, keep_matrix=True)
    assert len(calls) == 2


def test_a_bad_backend_fails_before_the_matrix_is_written(run_copy):
    with pytest.raises(ValueError, match="'scipy' runs on the CPU only"):
        analyze_run(run_copy, backend="scipy", device="cuda")
    assert (
        not list((run_copy / "analysis").glob("logprob-*"))
        if (run_copy / "analysis").exists()
        else True
    )


def test_concurrent_analyses_of_one_record_do_not_collide(run_copy, capsys):
    """A second `analyze rank` of the same run and record while one runs is refused in one
    line naming the first one's pid (the matrix and Gram temporaries have fixed names); an
    analysis of another record of the run is not held up."""
    import subprocess
    import sys

    folder = run_copy / "analysis"
    folder.mkdir(exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time; from highrank.runs.locks import exclusive\n"
         f"with exclusive({str(folder / 'rank-test-best.lock')!r}, 'x'):\n"
         " print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["analyze", "rank", str(run_copy), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"in use by pid {holder.pid}" in err[0]
        assert not (folder / "rank-test-best.json").exists()
        assert main(["analyze", "rank", str(run_copy), "--split", "valid", "--no-progress"]) == 0
    finally:
        holder.kill()
        holder.wait()
    assert main(["analyze", "rank", str(run_copy), "--no-progress"]) == 0
