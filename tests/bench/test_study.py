"""benchmarks/study.py: the resumable study runner, on tiny fake stages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from benchmarks._common import REPO
from benchmarks.study import Stage, StageLock, Study

ABC = [Stage("a"), Stage("b", needs=("a",)), Stage("c", needs=("b",))]


def study_of(tmp_path: Path, stages=ABC, work=None, **kwargs) -> tuple[Study, list[str]]:
    ran: list[str] = []

    def default_work(name: str) -> dict:
        ran.append(name)
        return {"value": name.upper()}

    kwargs.setdefault("wait_seconds", 0.05)
    kwargs.setdefault("log", lambda line: print(line))
    return Study(stages, work or default_work, records=tmp_path / "out", **kwargs), ran


def test_records_are_done_markers_and_a_rerun_runs_nothing(tmp_path):
    study, ran = study_of(tmp_path, extra=lambda: {"settings": {"x": 1}})
    assert study.run() == 0
    assert ran == ["a", "b", "c"]
    record = json.loads((tmp_path / "out" / "b.json").read_text())
    assert list(record) == ["value", "stage", "stage_seconds", "peak_rss_mib", "settings"]
    assert record["stage"] == "b" and record["stage_seconds"] >= 0 and record["peak_rss_mib"] > 0
    again, ran_again = study_of(tmp_path)
    assert again.run() == 0 and ran_again == []
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_a_failed_stage_stops_the_study_and_a_rerun_resumes_after_the_done_ones(tmp_path, capsys):
    def failing(name: str) -> dict:
        if name == "b":
            raise RuntimeError("boom")
        return {}

    study, _ = study_of(tmp_path, work=failing)
    assert study.run() == 1
    assert "stopped: stage b failed" in capsys.readouterr().out
    assert [p.stem for p in sorted((tmp_path / "out").glob("*.json"))] == ["a"]
    again, ran = study_of(tmp_path)
    assert again.run() == 0 and ran == ["b", "c"]


def test_after_runs_once_per_stage_finished_here(tmp_path):
    finished = []
    study, _ = study_of(tmp_path, after=finished.append)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.json").write_text("{}")
    assert study.run() == 0 and finished == ["b", "c"]


def run_while_another_process_makes(study: Study, records: Path, name: str) -> int:
    """``study.run()`` while "another process" holds stage ``name``'s lock and writes its record
    a little later."""
    lock = StageLock(study.lock_path(name))
    assert lock.__enter__()

    def finish() -> None:
        time.sleep(0.3)
        (records / f"{name}.json").write_text("{}")
        lock.__exit__()

    other = threading.Thread(target=finish)
    other.start()
    try:
        return study.run()
    finally:
        other.join()


def test_a_stage_waits_for_an_input_another_process_is_making(tmp_path, capsys):
    study, ran = study_of(tmp_path)
    assert run_while_another_process_makes(study, tmp_path / "out", "b") == 0
    assert ran == ["a", "c"]  # b was never run here
    assert "waiting" in capsys.readouterr().out


def test_stages_waiting_for_inputs_nobody_makes_stop_with_one_line(tmp_path, capsys):
    stages = [Stage("a"), Stage("b", needs=("elsewhere",)), Stage("c", ready=lambda: False)]
    study, ran = study_of(tmp_path, stages=stages)
    assert study.run() == 1
    assert ran == ["a"]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("stopped")]
    assert lines == ["stopped: the stages left wait for inputs no process is making: b, c"]


def test_a_custom_done_test_replaces_the_record(tmp_path):
    marker = tmp_path / "made"
    study, ran = study_of(tmp_path, stages=[Stage("m")], done=lambda name: marker.exists(),
                          work=lambda name: marker.write_text("") or {})
    assert study.run() == 0 and marker.exists()
    assert study.pending() == []


FAKE_STUDY = """
import sys, time
from pathlib import Path
from benchmarks.study import Stage, Study

out, log = Path(sys.argv[1]), Path(sys.argv[2])

def work(name):
    with open(log, "a") as handle:
        handle.write(name + "\\n")
    time.sleep(0.4)
    return {"pid": __import__("os").getpid()}

firsts = [Stage(f"s{i}") for i in range(6)]
stages = firsts + [Stage("last", needs=tuple(s.name for s in firsts))]
study = Study(stages, work, records=out, wait_seconds=0.1,
              child=lambda name: [sys.executable, __file__, str(out), str(log), "--stage", name])
if "--stage" in sys.argv:
    study.run_stage(sys.argv[-1])
else:
    sys.exit(study.run())
"""


def test_two_processes_split_the_work_with_the_locks(tmp_path):
    script = tmp_path / "fake_study.py"
    script.write_text(textwrap.dedent(FAKE_STUDY))
    out, log = tmp_path / "out", tmp_path / "log.txt"
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    command = [sys.executable, str(script), str(out), str(log)]
    processes = [subprocess.Popen(command, env=env) for _ in range(2)]
    assert [p.wait(timeout=120) for p in processes] == [0, 0]
    names = log.read_text().split()
    assert sorted(names) == sorted([f"s{i}" for i in range(6)] + ["last"])  # each stage once
    pids = {json.loads((out / f"s{i}.json").read_text())["pid"] for i in range(6)}
    assert len(pids) == 6  # every stage in a fresh process


@pytest.mark.parametrize("names", [["x", "x"]])
def test_stage_names_must_be_unique(tmp_path, names):
    with pytest.raises(ValueError):
        Study([Stage(n) for n in names], records=tmp_path)


def test_without_records_the_done_test_decides_and_a_busy_stage_is_waited_for(tmp_path):
    made, calls = set(), []

    def busy(name: str) -> bool:  # another program's lock on "x", released after two rounds
        calls.append(name)
        if name == "x" and len(calls) > 2:
            made.add("x")
        return name == "x" and "x" not in made

    study = Study([Stage("x"), Stage("y", needs=("x",))], lambda name: made.add(name),
                  records=None, locks=tmp_path, done=lambda name: name in made, busy=busy,
                  wait_seconds=0.01)
    assert study.run() == 0 and made == {"x", "y"}
    assert not list(tmp_path.glob("*.json"))  # no record of the runner's own
    with pytest.raises(ValueError):
        Study([Stage("x")], records=None)


def test_stages_given_as_a_callable_are_read_again_after_every_stage(tmp_path):
    """A stage a record adds (a third seed where two disagree) runs before the later stages of
    the list, and one added by the last stage still runs."""
    def stages() -> list[Stage]:
        listed = [Stage("first"), Stage("second"), Stage("last")]
        if (tmp_path / "out" / "first.json").exists():
            listed.insert(1, Stage("first-again", needs=("first",)))
        if (tmp_path / "out" / "last.json").exists():
            listed.append(Stage("after-last"))
        return listed

    study, ran = study_of(tmp_path, stages=stages)
    assert study.run() == 0
    assert ran == ["first", "first-again", "second", "last", "after-last"]
    assert study.pending() == []


@pytest.mark.parametrize("swallowed", [False, True], ids=["raised", "turned-into-an-error"])
def test_an_interrupt_stops_with_one_line_and_keeps_the_finished_stages(tmp_path, capsys,
                                                                         swallowed):
    """SIGINT (Ctrl-C, ``timeout --signal=INT``) during a stage: exit status 130 and one line
    naming the stage, also when the code below Python turned the interrupt into an error of its
    own (a torch.save cut short raises RuntimeError('... unexpected pos ...'))."""
    import signal

    def interrupted_at_b(name: str) -> dict:
        if name == "b":
            if not swallowed:
                signal.raise_signal(signal.SIGINT)
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                raise RuntimeError("unexpected pos 254613568 vs 254613456") from None
        return {}

    handler = signal.getsignal(signal.SIGINT)
    study, _ = study_of(tmp_path, work=interrupted_at_b)
    assert study.run() == 130
    assert signal.getsignal(signal.SIGINT) is handler  # put back
    out = capsys.readouterr().out
    assert "stopped: interrupted during stage b" in out and "failed" not in out
    assert [p.stem for p in sorted((tmp_path / "out").glob("*.json"))] == ["a"]
    again, ran = study_of(tmp_path)
    assert again.run() == 0 and ran == ["b", "c"]


def test_an_error_without_an_interrupt_is_still_a_failed_stage(tmp_path, capsys):
    def failing(name: str) -> dict:
        if name == "a":
            raise RuntimeError("unexpected pos 1 vs 2")
        return {}

    study, _ = study_of(tmp_path, work=failing)
    assert study.run() == 1 and "stopped: stage a failed" in capsys.readouterr().out


def test_a_stage_whose_done_test_fails_after_it_ran_stops_the_study(tmp_path, capsys):
    """A done test that the stage's own work cannot satisfy (a file it should leave is not
    there) stops the study in one line instead of running the stage round after round."""
    ran = []
    study = Study([Stage("a")], lambda name: ran.append(name) or {}, records=tmp_path / "out",
                  done=lambda name: False, wait_seconds=0.01, log=print)
    assert study.run() == 1
    assert ran == ["a"] and "stage a ran but its done test still fails" in capsys.readouterr().out


def test_a_child_stopped_by_an_interrupt_reads_as_interrupted_not_failed(tmp_path, capsys):
    """Child mode: a stage process that exits with 130 (Study.main's status when interrupted)
    or dies of SIGINT stops the parent with its one 'interrupted' line, status 130."""
    for code in ("raise SystemExit(130)", "import os, signal; os.kill(os.getpid(), 2)"):
        study, _ = study_of(tmp_path, child=lambda name, c=code: [sys.executable, "-c", c])
        assert study.run() == 130
        out = capsys.readouterr().out
        assert "stopped: interrupted during stage a" in out and "failed" not in out


def test_a_study_started_with_sigint_ignored_keeps_it_ignored(tmp_path):
    """A job started with & by a script ignores SIGINT: the runner leaves that as it is."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        seen = []
        study, _ = study_of(tmp_path, work=lambda name: seen.append(signal.getsignal(
            signal.SIGINT)) or {})
        assert study.run() == 0
        assert seen == [signal.SIG_IGN] * 3
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_stage_child_interrupted_returns_130_quietly(tmp_path):
    """Study.main(stage) in the child: an interrupt, also one a library turned into its own
    error, is status 130 (no traceback), which the parent reads as an interrupt."""
    import signal

    def turned_into_an_error(name):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            raise RuntimeError("unexpected pos") from None

    for work in (lambda name: signal.raise_signal(signal.SIGINT), turned_into_an_error):
        study, _ = study_of(tmp_path, work=work)
        assert study.main("a", summarize=lambda: None) == 130


def test_a_stage_whose_command_alone_was_interrupted_returns_130(tmp_path):
    """A SIGINT sent to a stage's command (a training, which saves and exits 130), not to the
    stage's process: the stage is interrupted, not failed; any other failure still raises."""
    import subprocess
    import sys

    def command(code):
        return lambda name: subprocess.run([sys.executable, "-c", code], check=True)

    for code in ("raise SystemExit(130)", "import os, signal; os.kill(os.getpid(), 2)"):
        study, _ = study_of(tmp_path, work=command(code))
        assert study.main("a", summarize=lambda: None) == 130
    study, _ = study_of(tmp_path, work=command("raise SystemExit(1)"))
    with pytest.raises(subprocess.CalledProcessError):
        study.main("a", summarize=lambda: None)


def test_a_stage_admit_refuses_is_left_and_the_study_stops_with_one_line(tmp_path, capsys):
    """admit (a deadline, say) refuses the long stage: the short one after it still runs, the
    refused one stays pending for a later run, and the study stops with 0 and names it."""
    ran = []

    def work(name):
        ran.append(name)
        return {}

    stages = [Stage("long"), Stage("short"), Stage("after-long", needs=("long",))]
    study = Study(stages, work, records=tmp_path, admit=lambda name: name != "long")
    assert study.run() == 0
    assert ran == ["short"]
    assert study.pending() == ["long", "after-long"]
    assert "stopped: not let run here now (left for a later run): long" in capsys.readouterr().out
    assert Study(stages, work, records=tmp_path).run() == 0  # no deadline: the rest runs
    assert ran == ["short", "long", "after-long"]


def test_a_refused_stage_waits_while_another_process_works(tmp_path, capsys):
    """admit refuses c while "another process" holds b: the study waits for b (its end may
    let a later stage run) and stops only once nobody else is working."""
    stages = [Stage("a"), Stage("b"), Stage("c")]
    study, ran = study_of(tmp_path, stages=stages, admit=lambda name: name != "c")
    assert run_while_another_process_makes(study, tmp_path / "out", "b") == 0
    out = capsys.readouterr().out
    assert ran == ["a"] and study.is_done("b") and not study.is_done("c")
    assert "waiting" in out and out.strip().endswith("left for a later run): c")
