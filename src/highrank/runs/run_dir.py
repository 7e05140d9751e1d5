"""Run directories: what a training run writes besides its checkpoints.

Layout of ``config.run.out_dir``::

    config.toml         the resolved config (highrank.config.save_config); load_config reads it
    command.txt         the command line that started the run; resumes and finetunes append one
    environment.json    the run id, the machine (highrank.util.machine), git commit (or null)
    vocab.json          the vocabulary (highrank.data.Vocab.save), id order
    corpus.json         crc32 of each split's token ids (word corpora), checked on resume
    metrics.jsonl       one JSON object per line: "kind": "step" every train.log_every steps,
                        "kind": "epoch" after each epoch's validation, "kind": "eval" after a
                        mid-epoch one (see highrank.train.reporting); never a half line (a
                        failed write is cut off; a resume keeps whole lines only)
    .lock               held (flock) while a train / resume / finetune runs: highrank.runs.locks
    checkpoints/        last.pt (+ last.prev.pt), best.pt, finetune-last.pt, finetuned.pt
    tensorboard/        the same scalars, when the optional ``tensorboard`` package imports
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import uuid
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from highrank.config import Config, load_config, save_config
from highrank.data import Vocab
from highrank.runs.checkpoint import CHECKPOINT_DIR, CONFIG_FILE, ENVIRONMENT_FILE, VOCAB_FILE
from highrank.util.atomic import write_bytes_atomic
from highrank.util.machine import describe_machine

COMMAND_FILE = "command.txt"
CORPUS_FILE = "corpus.json"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"  # one subfolder per stage: train, finetune


class RunDirError(ValueError):
    """A run directory is missing, incomplete, or would be overwritten."""


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory (see the module docstring)."""

    path: Path

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def metrics_file(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def vocab_file(self) -> Path:
        return self.path / VOCAB_FILE

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINT_DIR

    def checkpoint(self, name: str) -> Path:
        """``checkpoints/<name>.pt``."""
        return self.checkpoints / f"{name}.pt"

    def has_checkpoint(self) -> bool:
        """Whether ``checkpoints/`` holds any ``.pt`` file (a run that saved something)."""
        return self.checkpoints.is_dir() and any(self.checkpoints.glob("*.pt"))

    @property
    def run_id(self) -> str | None:
        """The id written at creation (environment.json's ``run_id``; None for runs from
        before ids): every checkpoint of the run carries it, so resume can refuse another's."""
        try:
            record = json.loads(self.path.joinpath(ENVIRONMENT_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return record.get("run_id") if isinstance(record, dict) else None

    def remove_temporaries(self) -> list[Path]:
        """Delete what killed writes left behind: checkpoint temporaries
        (``checkpoints/.<name>.pt.*.tmp``) and atomic-write temporaries of the run's own files
        (``.<name>.*.tmp``). Only call it holding the run's lock (a live writer's temporary
        would go too). Returns the paths removed."""
        patterns = [(self.checkpoints, ".*.pt.*.tmp"), (self.path, ".*.tmp")]
        removed = [p for folder, pattern in patterns for p in folder.glob(pattern) if p.is_file()]
        for path in removed:
            path.unlink(missing_ok=True)
        return removed

    @property
    def corpus_file(self) -> Path:
        return self.path / CORPUS_FILE

    def load_corpus_checksums(self) -> dict[str, str] | None:
        """``{split: crc32}`` of the corpus the run started on; None for runs without them
        (translation runs, runs written before they existed)."""
        if not self.corpus_file.is_file():
            return None
        return json.loads(self.corpus_file.read_text(encoding="utf-8"))["ids_crc32"]

    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        config: Config,
        vocab: Vocab,
        command: Sequence[str],
        corpus_checksums: Mapping[str, str] | None = None,
    ) -> RunDir:
        """A new run directory with config, command, environment and vocabulary written (and
        ``corpus_checksums``, when given, as corpus.json).

        Refuses a directory that already holds a run with a checkpoint, so nothing is
        overwritten; a run stopped before its first checkpoint starts again in place (its
        metrics are cleared, command.txt keeps its earlier lines).
        """
        run = cls(Path(path))
        if run.config_file.exists() and run.has_checkpoint():
            raise RunDirError(
                f"{run.path} already holds a run ({CONFIG_FILE} exists); continue it with "
                f"`highrank train --resume {run.path}`, or choose another run.out_dir "
                f"(--run.out_dir=...)"
            )
        run.checkpoints.mkdir(parents=True, exist_ok=True)
        run.metrics_file.unlink(missing_ok=True)
        save_config(config, run.config_file)
        run.append_command(command)
        facts = {"run_id": uuid.uuid4().hex, **environment()}
        run.path.joinpath(ENVIRONMENT_FILE).write_text(
            json.dumps(facts, indent=2) + "\n", encoding="utf-8"
        )
        vocab.save(run.vocab_file)
        run.corpus_file.unlink(missing_ok=True)
        if corpus_checksums is not None:
            record = {"ids_crc32": dict(corpus_checksums)}
            run.corpus_file.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        return run

    @classmethod
    def open(cls, path: str | os.PathLike) -> RunDir:
        """An existing run directory (it must hold ``config.toml``)."""
        run = cls(Path(path))
        if not run.config_file.is_file():
            raise RunDirError(
                f"{run.path} is not a run directory: {CONFIG_FILE} is missing (expected a "
                f"directory written by `highrank train`)"
            )
        return run

    def append_command(self, command: Sequence[str]) -> None:
        """Add one shell-quoted command line to ``command.txt``."""
        with self.path.joinpath(COMMAND_FILE).open("a", encoding="utf-8") as handle:
            handle.write(shlex.join(command) + "\n")

    def load_config(self) -> Config:
        return load_config(self.config_file)

    def load_vocab(self) -> Vocab:
        return Vocab.load(self.vocab_file)


# ---- environment ------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    """The machine (:func:`highrank.util.machine.describe_machine`), the code's git commit and
    the start time: what is worth keeping beside a result."""
    return {
        **describe_machine(),
        "git_commit": git_commit(Path(__file__).resolve().parent),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def git_commit(directory: Path, timeout: float = 5.0) -> str | None:
    """``git rev-parse HEAD`` in ``directory`` (+ ``-dirty`` with local changes), or None when
    git is missing, slow, or the directory is not in a repository."""
    try:
        head = _git(["rev-parse", "HEAD"], directory, timeout)
        dirty = _git(["status", "--porcelain", "--untracked-files=no"], directory, timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def _git(arguments: list[str], directory: Path, timeout: float) -> str:
    done = subprocess.run(
        ["git", *arguments],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return done.stdout.strip()


# ---- metrics ----------------------------------------------------------------------------------


class MetricsLog:
    """Append-only ``metrics.jsonl``: one JSON object per line, flushed at once.

    A write that fails part-way (disk full) is cut back to the last whole line before the
    error goes on. :meth:`offset` is the file's size and :meth:`lines` the number of lines of
    a stage; a resumed stage :meth:`rewind` s to what its checkpoint recorded, so lines it
    wrote after that checkpoint are not repeated while every other stage's lines stay.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.touch(exist_ok=True)  # present from the start, even before the first line

    def write(self, record: Mapping[str, Any]) -> None:
        line = (json.dumps(record, allow_nan=True) + "\n").encode("utf-8")
        with self.path.open("ab") as handle:
            size = handle.tell()
            try:
                _append(handle, line)
            except OSError as error:
                handle.truncate(size)  # never leave half a line
                raise RunDirError(
                    f"cannot write {self.path} ({error.strerror or error}); the line was not "
                    "written and the run stopped: free space, then resume from the last "
                    "checkpoint"
                ) from None

    def offset(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def lines(self, stage: str) -> int:
        """Whole lines of ``stage`` (a line without "stage" is a training one)."""
        return sum(1 for record in _parse_lines(self._read()) if _stage(record) == stage)

    def truncate(self, offset: int) -> None:
        """Drop what follows byte ``offset``, cut back to a line boundary."""
        self.rewind(offset, None, None)

    def rewind(self, offset: int, stage: str | None, lines: int | None) -> int:
        """Drop the lines ``stage`` wrote after its checkpoint: beyond its first ``lines``
        lines when the checkpoint counted them, else (older checkpoints) beyond byte
        ``offset``. Other stages' lines and whole lines before the cut stay; a torn last line
        goes. Rewritten atomically, and only when something changes. Returns how many of the
        ``lines`` the checkpoint counted are missing (the file was cut or replaced), or 0."""
        data = self._read()
        kept, seen = [], 0
        position = 0
        for raw in data.splitlines(keepends=True):
            position += len(raw)
            record = _parse_line(raw)
            if record is None:  # torn (unterminated or unparseable) line
                continue
            mine = stage is None or _stage(record) == stage
            if mine:
                seen += 1
                beyond = seen > lines if lines is not None else position > offset
                if beyond:
                    continue
            kept.append(raw)
        text = b"".join(kept)
        if text != data:
            write_bytes_atomic(self.path, text)
        if lines is not None:
            return max(0, lines - seen)
        return max(0, offset - len(data))  # older checkpoints: bytes, not lines

    def _read(self) -> bytes:
        return self.path.read_bytes() if self.path.exists() else b""


def _append(handle, line: bytes) -> None:
    handle.write(line)
    handle.flush()


def check_writable(path: str | os.PathLike) -> None:
    """A :class:`RunDirError` (before anything is written) when ``path`` cannot hold a run:
    it is a file, or ``checkpoints/``, one of its ``.pt`` entries or ``metrics.jsonl`` is not
    what it should be."""
    run = RunDir(Path(path))
    if run.path.exists() and not run.path.is_dir():
        raise RunDirError(
            f"run.out_dir = {str(run.path)!r} is a file; expected a directory (new, or holding "
            "a run); choose another --run.out_dir"
        )
    for parent in run.path.parents:
        if parent.exists() and not parent.is_dir():
            raise RunDirError(f"{parent} is a file, so run directory {run.path} cannot be made")
    if run.checkpoints.exists() and not run.checkpoints.is_dir():
        raise RunDirError(f"{run.checkpoints} is a file; expected the checkpoints folder")
    if run.checkpoints.is_dir():
        for entry in run.checkpoints.glob("*.pt"):
            if not entry.is_file():
                raise RunDirError(
                    f"{entry} is a directory where training writes its {entry.name} checkpoint;"
                    " move it out of the way (nothing else is touched: the run then continues "
                    "from its other checkpoints)"
                )
    if run.metrics_file.exists() and not run.metrics_file.is_file():
        raise RunDirError(f"{run.metrics_file} is not a file; move it out of the way")


def _stage(record: Mapping[str, Any]) -> str:
    return record.get("stage") or "train"


def _parse_line(raw: bytes) -> dict[str, Any] | None:
    if not raw.endswith(b"\n"):
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _parse_lines(data: bytes) -> list[dict[str, Any]]:
    records = (_parse_line(raw) for raw in data.splitlines(keepends=True))
    return [r for r in records if r is not None]


def read_metrics(path: str | os.PathLike, kind: str | None = None) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (only those of ``kind`` when given).

    A torn last line (a run killed while writing it, before this version cut such lines) is
    skipped with a warning; a broken line elsewhere is a :class:`RunDirError` naming it.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                warnings.warn(f"{path}, line {number}: skipped a torn last line", stacklevel=2)
                continue
            raise RunDirError(
                f"{path}, line {number}: not a JSON record ({line[:60]!r}); the file is damaged"
            ) from None
        records.append(record)
    return [r for r in records if kind is None or r.get("kind") == kind]


class TensorBoardLog:
    """Scalars to ``tensorboard/`` when ``torch.utils.tensorboard`` imports, else nothing.

    TensorBoard is an optional extra (``pip install -e '.[tensorboard]'``, README); without
    it nothing is written and nothing is said (metrics.jsonl holds the same scalars).
    """

    def __init__(self, directory: Path, purge_step: int | None = None) -> None:
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return
        self.writer = SummaryWriter(str(directory), purge_step=purge_step)

    def write(self, record: Mapping[str, Any], step: int) -> None:
        if self.writer is None:
            return
        prefix = f"{record.get('stage', 'train')}/{record.get('kind', 'step')}"
        for key, value in record.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.writer.add_scalar(f"{prefix}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


__all__ = [
    "COMMAND_FILE",
    "CONFIG_FILE",
    "ENVIRONMENT_FILE",
    "METRICS_FILE",
    "MetricsLog",
    "RunDir",
    "RunDirError",
    "TensorBoardLog",
    "check_writable",
    "environment",
    "git_commit",
    "read_metrics",
]
