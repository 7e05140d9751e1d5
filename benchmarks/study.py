"""A resumable study: ordered, named stages whose JSON records are their done markers.

    study = Study(
        [Stage("cache"), Stage("train-a", needs=("cache",)), Stage("eval-a", needs=("train-a",))],
        work=lambda name: {...},          # does the stage here; returns its record
        records=OUT,                       # OUT/<stage>.json: the record, written atomically
        child=lambda name: [sys.executable, "-m", "benchmarks.studies.x", *argv, "--stage", name],
    )
    return study.run()                     # rounds until every stage has its record

* A stage is **done** when its record exists (or, for a study whose records are another
  program's, when its ``done`` test says so). Done stages are never run again: a study that
  stopped (killed, or a stage failed) continues where it stopped when run again.
* :meth:`Study.run_stage` runs one stage in this process and writes its record: what ``work``
  returned, then ``stage``, ``stage_seconds``, ``peak_rss_mib`` (this process's peak resident
  memory) and whatever ``extra()`` adds. With ``child`` every stage runs in a fresh process
  (the command ``child(name)``, run from this process's folder unless ``cwd`` says otherwise,
  which must call :meth:`Study.run_stage`), so that its peak RSS is its own.
* Several processes may run the same study, or studies whose stages overlap. Each takes a
  non-blocking ``flock`` on ``locks/.<stage>.lock`` before it runs a stage and skips a stage
  another process holds or has finished meanwhile. A stage whose inputs are not there yet (the
  records it ``needs``, and its ``ready`` test) waits: the study goes round again after
  ``wait_seconds`` while another process holds a stage, and stops with one line naming the
  stuck stages when nobody is making what they wait for.
* ``after(name)`` runs after every stage this process finished (a summary, a ``--commit``).
* A study whose done markers are another program's records (``records=None``) gives its own
  ``done`` test and lock folder; ``busy(name)`` says that a stage is held by a lock of that
  program's own (it then counts as being made elsewhere).
* ``admit(name)`` may refuse a stage that is ready to run (say, one that would not finish
  before a deadline, so that a machine taken away loses no half-made stage): it is left for a
  later run, the rounds go on with the stages after it, and when only refused stages are left
  the study stops with one line naming them (exit status 0: it did what it was let do).

The kernel releases a lock however its holder dies, so a killed process holds nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._common import write_json


@dataclass(frozen=True)
class Stage:
    """One stage: its ``name`` (and record ``<name>.json``), the records it ``needs`` before it
    may run, and ``ready``, a test of any other input (a cache another study completes)."""

    name: str
    needs: tuple[str, ...] = ()
    ready: Callable[[], bool] | None = None


class StageFailed(RuntimeError):
    """A stage's work raised or its process exited non-zero: the study stops; rerun it."""


class StageLock:
    """An exclusive, non-blocking ``flock`` on ``path``: ``with StageLock(p) as held`` gives
    False when another process holds it (then nothing is held)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.file = None

    def __enter__(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.path, "a")  # noqa: SIM115 (closed in __exit__)
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            self.file = None
            return False
        return True

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def peak_rss_mib() -> float:
    """This process's peak resident memory so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Study:
    """The stages of one study, run in order, resumable, shareable between processes."""

    def __init__(
        self,
        stages: Iterable[Stage] | Callable[[], Iterable[Stage]],
        work: Callable[[str], dict] | None = None,
        *,
        records: Path | None,
        locks: Path | None = None,
        child: Callable[[str], Sequence[str]] | None = None,
        extra: Callable[[], dict] | None = None,
        after: Callable[[str], Any] | None = None,
        done: Callable[[str], bool] | None = None,
        busy: Callable[[str], bool] | None = None,
        admit: Callable[[str], bool] | None = None,
        wait_seconds: float = 30.0,
        indent: int = 1,
        end: str = "",
        cwd: Path | None = None,
        log: Callable[[str], Any] | None = None,
    ) -> None:
        # a callable: the stages are read again before each stage is chosen (a study whose
        # later stages depend on earlier results, e.g. a third seed where two disagree)
        self._source = stages if callable(stages) else None
        self.stages = self._read_stages(stages() if callable(stages) else stages)
        self.work, self.child, self.extra, self.after = work, child, extra, after
        if records is None and (done is None or locks is None):
            raise ValueError("a Study without records needs its own done test and a lock folder")
        self.records = Path(records) if records is not None else None
        self.locks = Path(locks) if locks is not None else self.records
        self._done, self.busy, self.admit = done, busy, admit
        self.refused: list[str] = []  # the ready stages ``admit`` refused in the last round
        self.wait_seconds, self.indent, self.end, self.cwd = wait_seconds, indent, end, cwd
        self.log = log or (lambda line: print(line, flush=True))
        self.interrupted = False  # a SIGINT arrived during run() (see _noting_interrupts)
        self.running: str | None = None  # the stage this process is running now

    @staticmethod
    def _read_stages(stages: Iterable[Stage]) -> list[Stage]:
        stages = list(stages)
        names = [stage.name for stage in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names repeat: {names}")
        return stages

    # ---- state on disk ----------------------------------------------------------------------

    def record_path(self, name: str) -> Path:
        return self.records / f"{name}.json"

    def lock_path(self, name: str) -> Path:
        return self.locks / f".{name}.lock"

    def is_done(self, name: str) -> bool:
        return self._done(name) if self._done is not None else self.record_path(name).exists()

    def pending(self) -> list[str]:
        if self._source is not None:
            self.stages = self._read_stages(self._source())
        return [stage.name for stage in self.stages if not self.is_done(stage.name)]

    def inputs_ready(self, stage: Stage) -> bool:
        return all(self.is_done(need) for need in stage.needs) and (
            stage.ready is None or stage.ready()
        )

    def held_elsewhere(self, name: str) -> bool:
        """Whether another process holds ``name``'s lock now (taken and released at once)."""
        if not self.lock_path(name).exists():
            return False
        with StageLock(self.lock_path(name)) as held:
            return not held

    # ---- running ----------------------------------------------------------------------------

    def run_stage(self, name: str) -> dict:
        """Do stage ``name`` here (``work``) and write its record; the record."""
        if self.work is None:
            raise ValueError("this Study has no work to run a stage with")
        began = time.perf_counter()
        record = dict(self.work(name) or {})
        if self.records is None:  # the stage's own output is its done marker
            return record
        record.update(stage=name, stage_seconds=time.perf_counter() - began,
                      peak_rss_mib=peak_rss_mib())
        if self.extra is not None:
            record.update(self.extra())
        self.records.mkdir(parents=True, exist_ok=True)
        write_json(self.record_path(name), record, indent=self.indent, end=self.end)
        return record

    def _execute(self, name: str) -> None:
        if self.child is None:
            try:
                self.run_stage(name)
            except Exception as error:
                if self.interrupted:  # a SIGINT that code below Python (a torch.save) turned
                    raise KeyboardInterrupt from error  # into an error of its own
                raise StageFailed(f"stage {name} failed: {error!r}; rerun to continue") from error
            if not self.is_done(name):  # else the rounds would run it again and again
                raise StageFailed(f"stage {name} ran but its done test still fails")
            return
        status = subprocess.run(list(self.child(name)), cwd=self.cwd).returncode
        if status in (130, -signal.SIGINT):  # the child was interrupted (Study.main: 130)
            raise KeyboardInterrupt
        if status != 0:
            raise StageFailed(f"stage {name} failed (its process exited with {status}); "
                              "rerun to continue")
        if not self.is_done(name):
            raise StageFailed(f"stage {name} wrote no record; rerun to continue")

    def run_round(self) -> tuple[int, list[str], int]:
        """Run every stage that is not done, not held by another process, whose inputs are
        there and that ``admit`` lets run, in order: ``(stages run, stages still pending,
        stages being made elsewhere)``; the refused ones are in :attr:`refused`. A study whose
        stages are a callable reads them again first and returns after one stage (the next
        round sees the stages its record added)."""
        if self._source is not None:
            self.stages = self._read_stages(self._source())
        ran, elsewhere, self.refused = 0, 0, []
        for stage in self.stages:
            if self.is_done(stage.name):
                continue
            with StageLock(self.lock_path(stage.name)) as held:
                if not held or (self.busy is not None and self.busy(stage.name)):
                    elsewhere += 1
                    continue
                if self.is_done(stage.name):  # finished by another process since
                    continue
                if not self.inputs_ready(stage):
                    elsewhere += sum(self.held_elsewhere(n) for n in stage.needs
                                     if not self.is_done(n))
                    continue
                if self.admit is not None and not self.admit(stage.name):
                    self.refused.append(stage.name)
                    continue
                self.log(f"== {stage.name} ({time.strftime('%H:%M:%S')})")
                began, self.running = time.perf_counter(), stage.name
                self._execute(stage.name)
                ran, self.running = ran + 1, None
                self.log(f"   {stage.name} done in {time.perf_counter() - began:.0f} s")
            if self.after is not None:
                self.after(stage.name)
            if self._source is not None:
                break
        return ran, self.pending(), elsewhere

    def run(self) -> int:
        """Rounds until every stage is done: 0; also 0 when the stages left are refused by
        ``admit`` and no other process holds one (one line names them); 1 when the stages left
        wait for inputs that no process is making (one line names them) or a stage failed (one
        line says which); 130 when interrupted (SIGINT: Ctrl-C, ``timeout --signal=INT``), also
        in one line."""
        self.interrupted, self.running = False, None
        try:
            with self._noting_interrupts():
                return self._rounds()
        except KeyboardInterrupt:
            during = f" during stage {self.running}" if self.running else ""
            self.log(f"stopped: interrupted{during}; the finished stages are kept, a rerun "
                     "continues")
            return 130

    @contextlib.contextmanager
    def _noting_interrupts(self):
        """Python's SIGINT handler, noting that the signal came: an interrupted stage then
        reads as interrupted even where a library's own code caught the KeyboardInterrupt and
        raised another error (a torch.save cut short: 'unexpected pos')."""
        previous = signal.getsignal(signal.SIGINT)
        # Left as they are: other threads (handlers belong to the main one), an ignored SIGINT
        # (a job started with & by a script) and a handler set outside Python (None).
        if (threading.current_thread() is not threading.main_thread()
                or previous in (signal.SIG_IGN, None)):
            yield
            return

        def note_and_interrupt(signum, frame):
            self.interrupted = True
            signal.default_int_handler(signum, frame)

        signal.signal(signal.SIGINT, note_and_interrupt)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _rounds(self) -> int:
        try:
            while True:
                ran, pending, elsewhere = self.run_round()
                if not pending:
                    return 0
                if ran:
                    continue
                if self.refused and not elsewhere:
                    self.log("stopped: not let run here now (left for a later run): "
                             + ", ".join(self.refused))
                    return 0
                if not elsewhere:
                    self.log("stopped: the stages left wait for inputs no process is making: "
                             + ", ".join(pending))
                    return 1
                self.log(f"waiting {self.wait_seconds:.0f} s for {elsewhere} stage(s) another "
                         "process is running")
                time.sleep(self.wait_seconds)
        except StageFailed as error:
            self.log(f"stopped: {error}")
            return 1

    def main(
        self, stage: str | None, *, summarize: Callable[[], None], only_summary: bool = False
    ) -> int:
        """A study script's ``main`` once its arguments are parsed: the one ``stage`` a parent
        asked for (``--stage``, in a child process), the summary alone (``only_summary``), or
        every stage in rounds and then ``summarize()``."""
        if stage:  # a child process of a parent's rounds: interrupted, it exits with 130
            try:  # and the parent says so in its one line
                with self._noting_interrupts():
                    self.run_stage(stage)
            except KeyboardInterrupt:
                return 130
            except Exception as error:
                if self.interrupted:  # an interrupt a library turned into its own error
                    return 130
                if _interrupted_command(error):  # a command of the stage's, itself signalled
                    return 130
                raise
            return 0
        if only_summary:
            summarize()
            return 0
        status = self.run()
        if status == 0:
            summarize()
        return status


def _interrupted_command(error: BaseException) -> bool:
    """A command that exited as interrupted: 130, or killed by SIGINT (a SIGINT sent to the
    command alone, not to the stage's process, which would have noted it)."""
    return (isinstance(error, subprocess.CalledProcessError)
            and error.returncode in (130, -signal.SIGINT))


def search_lr(pilot: Callable[[float], dict], grid: Sequence[float], *, factor: float,
              max_extensions: int) -> tuple[float, list[float], dict[float, dict]]:
    """A learning rate by pilots: ``pilot(lr)`` (a record with ``valid_loss``; a non-finite
    one loses) at each lr of ``grid``; while the best is at an end of the grid, the grid is
    extended that way by ``factor`` (at most ``max_extensions`` times). Returns the best lr,
    the grid as searched and every pilot's record."""
    lrs = list(grid)
    records = {lr: pilot(lr) for lr in lrs}

    def best() -> float:
        return min(lrs, key=lambda lr: _finite(records[lr]["valid_loss"]))

    for _ in range(max_extensions):
        if best() == lrs[0]:
            lrs.insert(0, lrs[0] / factor)
            records[lrs[0]] = pilot(lrs[0])
        elif best() == lrs[-1]:
            lrs.append(lrs[-1] * factor)
            records[lrs[-1]] = pilot(lrs[-1])
        else:
            break
    return best(), lrs, records


def _finite(value: Any) -> float:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else math.inf


def wikitext_study(
    stages: Sequence[Stage], work: Callable[[str], dict], *, args: Any, argv: Sequence[str],
    module: str, settings: Callable[[], dict], summarize: Callable[[], None],
    done: Callable[[str], bool] | None = None,
) -> Study:
    """The SmolLM2 studies' runner: records ``args.out/<stage>.json`` (indent 1), locks in
    ``args.work_dir``, every stage in a fresh process of ``module``, ``settings()`` in every
    record, ``summarize()`` after each stage and, with ``args.commit``, ``args.out`` committed.
    With ``args.in_process`` (where the study has that option) the stages run in this process
    and the summary only at the end (``Study.main``). ``done`` replaces the record as the
    done test (it should still ask for the record)."""
    from benchmarks._common import commit

    label = module.rsplit(".", 1)[-1].replace("_", "-")
    in_process = getattr(args, "in_process", False)

    def after(stage: str) -> None:
        if not in_process:
            summarize()
        if args.commit:
            commit(args.out, f"{label}: {stage} recorded")

    return Study(stages, work, records=args.out, locks=args.work_dir, indent=1, end="", done=done,
                 extra=lambda: {"settings": settings()}, after=after,
                 child=None if in_process else module_command(module, argv, "--commit"))


def wikitext_missing(args: Any) -> bool:
    """True (and a line saying so) when ``args.data_dir`` has no WikiText-2: a skip, not a
    failure; else the study's folders are made."""
    if not (Path(args.data_dir) / "wikitext-2" / "test.txt").exists():
        print(f"skipped: no WikiText-2 under {args.data_dir} (pass --data-dir)")
        return True
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return False


def module_command(module: str, argv: Sequence[str], *drop: str) -> Callable[[str], list[str]]:
    """``child`` for a study run as ``python -m MODULE ARGV``: the same command (less the flags
    in ``drop``, e.g. ``--commit``) with ``--stage NAME``."""
    kept = [word for word in argv if word not in drop]
    return lambda name: [sys.executable, "-m", module, *kept, "--stage", name]


__all__ = ["Stage", "StageFailed", "StageLock", "Study", "module_command", "peak_rss_mib",
           "wikitext_missing", "wikitext_study"]
