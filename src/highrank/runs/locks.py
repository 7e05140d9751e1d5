"""Exclusive locks on run directories and records, so two processes never write one run.

A lock is ``fcntl.flock(LOCK_EX | LOCK_NB)`` on a small lock file (``RUN_DIR/.lock``,
``RUN_DIR/analysis/<record>.lock``) that also holds the holder's pid and command line, for
the message a second process gets. flock rather than an ``O_EXCL`` lock file because the
kernel releases a flock when its holder dies in any way (``kill -9``, out of memory, a power
cut's reboot): a stale lock can never block a run, and there is no pid-liveness guess (a
recycled pid, a pid of another machine) to get wrong. The lock file itself stays behind
(deleting it while another process may open it would let two processes lock two different
files); its contents only describe the last holder. Where ``fcntl`` is missing (Windows)
nothing is locked.

Locks are re-entrant within a process: ``resume`` may call ``train`` on the same directory.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK_FILE = ".lock"

_held: dict[Path, int] = {}  # lock file -> depth, for this process


class LockedError(ValueError):
    """Another process holds the lock; the message names it and what to do."""


def holder(lock_file: Path) -> str:
    """``pid N (command)`` of the process that last took ``lock_file``, or what is known."""
    try:
        text = lock_file.read_text(encoding="utf-8").strip()
    except OSError:
        return "another process"
    pid, _, command = text.partition(" ")
    return f"pid {pid}" + (f" ({command})" if command else "") if pid else "another process"


@contextmanager
def exclusive(lock_file: str | os.PathLike, what: str) -> Iterator[None]:
    """Hold the lock ``lock_file`` for the block; :class:`LockedError` naming the holder's
    pid when another process holds it. ``what`` names the locked thing in the message."""
    lock_file = Path(lock_file).absolute()
    if fcntl is None or lock_file in _held:
        _held[lock_file] = _held.get(lock_file, 0) + 1
        try:
            yield
        finally:
            _release_depth(lock_file)
        return
    handle = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LockedError(
                f"{what} is in use by {holder(lock_file)}; wait for it to finish, or stop it "
                "(a lock of a process that died is taken over by itself)"
            ) from None
        os.ftruncate(handle, 0)
        os.write(handle, f"{os.getpid()} {shlex.join(sys.argv)}\n".encode())
        _held[lock_file] = 1
        try:
            yield
        finally:
            _release_depth(lock_file)
    finally:
        os.close(handle)  # closing the descriptor releases the flock


def _release_depth(lock_file: Path) -> None:
    _held[lock_file] -= 1
    if not _held[lock_file]:
        del _held[lock_file]


@contextmanager
def run_lock(run_dir: str | os.PathLike) -> Iterator[None]:
    """Hold ``RUN_DIR/.lock`` while a train / resume / finetune writes the run. A directory
    that does not exist yet is created for the lock, and removed again when the block fails
    before anything but the lock file was written in it (bad input writes nothing)."""
    run_dir = Path(run_dir)
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        with exclusive(run_dir / LOCK_FILE, f"run directory {run_dir}"):
            yield
    except BaseException:
        if created and [p.name for p in run_dir.iterdir()] == [LOCK_FILE]:
            (run_dir / LOCK_FILE).unlink(missing_ok=True)
            run_dir.rmdir()
        raise


__all__ = ["LOCK_FILE", "LockedError", "exclusive", "holder", "run_lock"]
