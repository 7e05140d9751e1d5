"""What the benchmark scripts share: paths, the ``highrank`` command, machine facts, records.

    REPO, DATA, RESULTS            the repository, the shared data folder beside it
                                   (``REPO.parent / "shared" / "data"``), benchmarks/results
    highrank(*words)               run ``python -m highrank WORDS`` in a subprocess from REPO
    run_env(threads)               the environment of a child limited to ``threads`` threads
    machine(threads, note)         highrank.util.machine.describe_machine (the one home of the
                                   machine facts every record carries)
    write_json(path, payload)      a JSON record, written atomically (highrank.util.atomic)
    write_text(path, text)         a text record (a table, a page, a done marker), atomically
    save_array(path, array)        a NumPy array as .npy, atomically
    save_torch(path, obj)          ``torch.save(obj)``, atomically
    save_figure(figure, path)      a matplotlib figure, atomically
    append_line(path, line)        one line appended to a log (commands.txt), never rewritten

Every file a benchmark writes goes through these (tests/bench/test_writes.py holds the rule): a
reader, another study process or a commit in between, sees the old file or the whole new one.
    commit(path, message)          commit ``path`` (the study's results) to git, retrying while
                                   another process holds the index lock
    module_name(__file__)          the dotted name ``python -m`` runs a benchmark module by

The library is installed (``pip install -e .``): nothing here edits ``sys.path``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from highrank.util.atomic import atomic_file, write_text_atomic

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
RESULTS = REPO / "benchmarks" / "results"
SHARED_MACHINE = "a machine shared with other jobs unless said otherwise"


def run_env(threads: int | None = None) -> dict[str, str]:
    """This process's environment, with OMP / MKL limited to ``threads`` threads if given."""
    env = dict(os.environ)
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def highrank(
    *words: str,
    threads: int | None = None,
    check: bool = True,
    echo: bool = True,
    log: Path | None = None,
    cwd: Path = REPO,
    **run_kwargs: Any,
) -> subprocess.CompletedProcess:
    """Run one ``highrank`` command as a user would (``python -m highrank WORDS``, from
    ``cwd``), printing its line (``echo``) and appending it to ``log`` if given. With ``check``
    a failing command raises ``subprocess.CalledProcessError``."""
    line = shlex.join(["highrank", *words])
    if echo:
        print(f"+ {line}", flush=True)
    if log is not None:
        append_line(log, line)
    command = [sys.executable, "-m", "highrank", *words]
    run_kwargs.setdefault("env", run_env(threads))
    return subprocess.run(command, cwd=cwd, check=check, **run_kwargs)


def module_name(file: str | os.PathLike) -> str:
    """The dotted name ``python -m`` runs the benchmark module at ``file`` (its ``__file__``)
    by: ``benchmarks/studies/bottleneck_map.py`` -> ``benchmarks.studies.bottleneck_map``. How a
    script names itself in the child commands it starts and the commands it records (under
    ``python -m`` its ``__name__`` is ``"__main__"``), so that moving it moves them too."""
    return ".".join(Path(file).resolve().relative_to(REPO).with_suffix("").parts)


def machine(threads: int | None = None, note: str | None = SHARED_MACHINE) -> dict[str, Any]:
    """The machine facts of a record (:func:`highrank.util.machine.describe_machine`)."""
    from highrank.util.machine import describe_machine

    return describe_machine(threads=threads, note=note)


def write_json(
    path: str | os.PathLike, payload: Any, *, indent: int = 2, end: str = "\n",
    sort_keys: bool = False,
) -> Path:  # fmt: skip
    """``payload`` as JSON (``indent``, then ``end``; values JSON cannot hold as their
    ``str``), replacing ``path`` atomically; the folder is created if need be."""
    text = json.dumps(payload, indent=indent, default=str, sort_keys=sort_keys) + end
    return write_text_atomic(path, text)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """``text`` (UTF-8) replacing ``path`` atomically; the folder is created if need be."""
    return write_text_atomic(path, text)


def save_array(path: str | os.PathLike, array: Any) -> Path:
    """``array`` as a ``.npy`` file (``np.save``) replacing ``path`` atomically."""
    import numpy as np

    with atomic_file(path) as handle:
        np.save(handle, array)
    return Path(path)


def save_torch(path: str | os.PathLike, obj: Any) -> Path:
    """``torch.save(obj)`` replacing ``path`` atomically."""
    import torch

    with atomic_file(path) as handle:
        torch.save(obj, handle)
    return Path(path)


def save_figure(figure: Any, path: str | os.PathLike, **savefig: Any) -> Path:
    """A matplotlib ``figure`` saved to ``path`` atomically: written to a temporary file beside
    it (the format named by ``path``'s suffix unless ``format=`` says otherwise), then renamed
    onto it. ``savefig`` goes to ``figure.savefig`` (``dpi=...``)."""
    path = Path(path)
    savefig.setdefault("format", path.suffix.removeprefix(".") or None)
    with atomic_file(path) as handle:
        figure.savefig(handle, **savefig)
    return path


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append ``line`` (and a newline) to the log at ``path`` (created, with its folder, if
    need be): the command logs are appended to as a study goes, never rewritten, so a line
    written stays written and a torn last line is all a kill can leave."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")


def commit(
    path: str | os.PathLike, message: str, *, attempts: int = 20, pause: float = 3.0
) -> bool:
    """``git add`` and ``git commit`` ``path`` alone with ``message``; while another process
    holds the index lock, try again (``attempts`` times, ``pause`` seconds apart). Nothing to
    commit counts as done. False (and a line on stderr) when it could not."""
    lock = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--git-path", "index.lock"],
        capture_output=True, text=True,
    ).stdout.strip()
    index_lock = Path(lock) if Path(lock).is_absolute() else REPO / lock
    for _ in range(attempts):
        if not index_lock.exists():
            added = subprocess.run(["git", "-C", str(REPO), "add", str(path)])
            done = subprocess.run(
                ["git", "-C", str(REPO), "commit", "-q", "-m", message, "--", str(path)]
            )
            if added.returncode == 0 and done.returncode in (0, 1):
                return True
        time.sleep(pause)
    print(f"could not commit {path}; commit it by hand", file=sys.stderr)
    return False
