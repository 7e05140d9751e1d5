"""benchmarks/heads/billion_word_step.py and benchmarks/heads/heads_under_load.py on tiny shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch


def test_the_billion_word_models_have_the_asked_shape():
    from benchmarks.heads import billion_word_step as bws

    shape = bws.Shape(batch=2, bptt=3, vocab=500, width=32)
    softmax, optimizer, (tokens, target), chunk, _ = bws.build("softmax", shape)
    mos = bws.build("mos", shape)[0]
    assert softmax.head.vocab_size == 500 and softmax.backbone.d_last == 32
    assert mos.head.n_components == 7 and tokens.shape == target.shape == (3, 2)
    assert bws.build("softmax-unchunked", shape)[3] is None and chunk == "auto"
    before = softmax.backbone.embedding.weight.detach().clone()
    bws.step(softmax, optimizer, (tokens, target), chunk, clip=0.25)
    assert not torch.equal(before, softmax.backbone.embedding.weight)  # one SGD update happened


def test_the_billion_word_benchmark_writes_its_table(tmp_path):
    from benchmarks.heads import billion_word_step as bws

    arguments = ["--vocab", "300", "--width", "16", "--batch", "2", "--bptt", "3"]
    assert (
        bws.main([*arguments, "--rounds", "1", "--heads", "softmax,mos", "--out", str(tmp_path)])
        == 0
    )
    record = json.loads((tmp_path / "billion-word-step.json").read_text())
    rows = {row["head"]: row for row in record["rows"]}
    for row in rows.values():  # the medians of the recorded step times, as a ratio to softmax
        median = sorted(row["step_times_s"])[len(row["step_times_s"]) // 2]
        assert row["median_s_per_step"] == median
    expected = rows["mos"]["median_s_per_step"] / rows["softmax"]["median_s_per_step"]
    assert rows["mos"]["time_vs_softmax"] == pytest.approx(expected)
    assert rows["mos"]["parameters"] > rows["softmax"]["parameters"]
    assert record["vocab"] == 300 and "| mos |" in (tmp_path / "billion-word-step.md").read_text()


def test_under_load_summary_compares_each_condition_quiet_and_loaded():
    from benchmarks.heads import heads_under_load as hul

    def condition(load, policy, threads, head_ms, naive_ms):
        rows = {
            "naive-softmax": {"ops_per_step": 10},
            "mos": {
                "time_ratio": head_ms / naive_ms,
                "head_ms": head_ms,
                "baseline_ms": naive_ms,
                "ops_per_step": 500,
            },
        }
        return {"round": 0, "load": load, "policy": policy, "threads": threads, "rows": rows}

    conditions = [
        condition("quiet", "default", 2, 100.0, 10.0),
        condition("loaded", "default", 2, 400.0, 16.0),
    ]
    (row,) = hul.summarize(conditions, ["mos"])
    assert (row["quiet_ratio"], row["loaded_ratio"]) == (10.0, 25.0)
    assert (row["head_slowdown"], row["naive_slowdown"]) == (4.0, 1.6)
    text = hul.markdown(
        {
            "machine": "m",
            "conditions": conditions,
            "table": [row],
            "settings": {"vocab": 100, "tokens": 70, "repeats": 1, "rounds": 1},
        }
    )
    assert "| mos | 500 | default | 2 | 10.00 | 25.00 | 4.00 | 1.60 |" in text


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_pausing_stops_a_process_and_its_children_and_continues_them():
    from benchmarks.heads import heads_under_load as hul

    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\ntime.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        family = hul.descendants(parent.pid)
        assert set(family) == {parent.pid, child}

        def state(pid):
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

        hul.signal_all(family, hul.signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while {state(p) for p in family} != {"T"} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {state(p) for p in family} == {"T"}
        hul.signal_all(family, hul.signal.SIGCONT)
        while "T" in {state(p) for p in family} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "T" not in {state(p) for p in family}
    finally:
        for pid in hul.descendants(parent.pid):
            os.kill(pid, 9)
        parent.wait()


def _sleeper_family():
    """A parent process with one child, both sleeping; (parent Popen, child pid)."""
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\ntime.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    return parent, int(parent.stdout.readline())


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_paused_processes_are_continued_when_the_benchmark_fails(monkeypatch):
    from benchmarks.heads import heads_under_load as hul

    parent, child = _sleeper_family()
    try:

        def failing_measure(args):
            deadline = time.monotonic() + 10  # SIGSTOP is delivered asynchronously
            while {_state(parent.pid), _state(child)} != {"T"} and time.monotonic() < deadline:
                time.sleep(0.05)
            assert {_state(parent.pid), _state(child)} == {"T"}  # stopped while measuring
            raise RuntimeError("a worker failed")

        monkeypatch.setattr(hul, "measure", failing_measure)
        with pytest.raises(RuntimeError, match="a worker failed"):
            hul.main(["--pause", str(parent.pid), "--out", "/nonexistent"])
        deadline = time.monotonic() + 10
        while "T" in {_state(parent.pid), _state(child)} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "T" not in {_state(parent.pid), _state(child)}
    finally:
        for pid in (child, parent.pid):
            os.kill(pid, 9)
        parent.wait()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_pause_refuses_the_benchmark_itself_and_unknown_processes():
    from benchmarks.heads import heads_under_load as hul

    with pytest.raises(SystemExit, match="this benchmark or one of its parents"):
        hul.processes_to_pause([os.getppid()])
    with pytest.raises(SystemExit, match="no such process"):
        hul.processes_to_pause([2**22 + 12345])
