"""benchmarks/studies/saturation_study.py --steps replication: the replication study's runs
trained in segments, a snapshot of last.pt at every REPLICATION_SNAPSHOTS step, resumable, and
refusing a run already past a snapshot step (its copy would be mislabelled). Training is
simulated: the ``highrank train`` calls are recorded and write the checkpoint a real run would."""

from __future__ import annotations

import argparse

import pytest

import highrank.analysis.saturation as saturation
import highrank.runs.checkpoint as checkpoint


@pytest.fixture()
def study(monkeypatch, tmp_path):
    from benchmarks.studies import saturation_study

    calls: list[tuple[str, ...]] = []
    state = {"step": 0}

    def fake_timed(*words, threads):
        calls.append(words)
        run_dir = tmp_path / "runs" / "replication" / "softmax-seed1"
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        limit = int(words[words.index("--max-steps") + 1]) if "--max-steps" in words else 1730
        state["step"] = max(state["step"], limit)
        (run_dir / "checkpoints" / "last.pt").write_text(f"step {state['step']}")
        return 0.1

    monkeypatch.setattr(saturation_study, "timed", fake_timed)
    monkeypatch.setattr(checkpoint, "read_run", lambda run_dir, which: argparse.Namespace(
        payload=(run_dir / "checkpoints" / "last.pt").read_text()))
    monkeypatch.setattr(saturation, "checkpoint_step", lambda payload: int(payload.split()[1]))
    # the replication study's widths, not its committed hidden-sizes.json (which a rerun of that
    # study rewrites): the runs' words must not change with the records
    results = tmp_path / "results"
    (results / "replication").mkdir(parents=True)
    (results / "replication" / "hidden-sizes.json").write_text('{"softmax": 650, "mos": 620}')
    monkeypatch.setattr(saturation_study, "RESULTS", results)
    args = argparse.Namespace(runs_dir=tmp_path / "runs", threads=1)
    return saturation_study, args, calls, state


def test_a_run_is_trained_in_segments_with_a_snapshot_at_every_step(study):
    module, args, calls, _ = study
    seconds: dict = {}
    run_dir = module.train_replication_run("softmax", args, seconds)

    steps = module.REPLICATION_SNAPSHOTS
    assert [p.name for p in sorted((run_dir / "snapshots").glob("*.pt"))] == [
        f"step-{s:04d}.pt" for s in steps
    ]
    assert [(run_dir / "snapshots" / f"step-{s:04d}.pt").read_text() for s in steps] == [
        f"step {s}" for s in steps
    ]
    # the first call starts the run with the replication study's words; the others resume
    assert calls[0][:2] == ("train", "configs/ptb/small-softmax.toml")
    assert "--model.d_hidden=650" in calls[0] and "--train.switch_epoch=1" in calls[0]
    assert all(call[:2] == ("train", "--resume") for call in calls[1:])
    assert [c[c.index("--max-steps") + 1] for c in calls[:-1]] == [str(s) for s in steps]
    assert "--max-steps" not in calls[-1]  # the last call trains to the end
    assert (run_dir / "study-train.done").is_file()

    calls.clear()
    module.train_replication_run("softmax", args, seconds)
    assert calls == []  # finished: nothing runs again


def test_a_run_past_a_snapshot_step_is_refused(study):
    module, args, calls, state = study
    state["step"] = 500  # the run already went past step 100 and 300
    with pytest.raises(SystemExit, match="last.pt is at step 500, not 100"):
        module.train_replication_run("softmax", args, {})


def test_a_finished_run_without_snapshots_is_refused(study, tmp_path):
    module, args, calls, _ = study
    run_dir = tmp_path / "runs" / "replication" / "softmax-seed1"
    run_dir.mkdir(parents=True)
    (run_dir / "study-train.done").write_text("")
    with pytest.raises(SystemExit, match="finished without snapshots"):
        module.train_replication_run("softmax", args, {})
    assert calls == []
