"""Progress of long loops: a tqdm bar on a terminal, a plain line now and then in a log file.

A tqdm bar redraws itself many times a second with carriage returns; written to a file (a
``nohup`` log, a batch job's output) it becomes megabytes of half lines. :func:`progress_bar`
gives a tqdm bar when its stream is a terminal and otherwise a :class:`LineProgress`, which
prints one line every ``HIGHRANK_PROGRESS_SECONDS`` seconds (default 60) and one at the end:

    train epoch 1: 412,160/929,589 tok (44%), 2,315.0 tok/s, loss=5.123 ppl=167.8

(below 0.1 per second the rate is the seconds each takes: ``3/20 step (15%), 14 s/step``).

Both have what the loops use of tqdm: ``update``, ``set_postfix``, ``close``, ``disable`` and
use as a context manager. Every progress display of highrank is made here.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from tqdm.auto import tqdm

DEFAULT_SECONDS = 60.0


def interval_seconds() -> float:
    """Seconds between two lines when the output is not a terminal."""
    try:
        return max(0.0, float(os.environ.get("HIGHRANK_PROGRESS_SECONDS", DEFAULT_SECONDS)))
    except ValueError:
        return DEFAULT_SECONDS


def progress_bar(
    *,
    total: int | None,
    desc: str,
    unit: str = "it",
    disable: bool = False,
    initial: int = 0,
    file: TextIO | None = None,
    **tqdm_options: Any,
):
    """A tqdm bar on a terminal, a :class:`LineProgress` elsewhere (``disable``: shows
    nothing)."""
    stream = file if file is not None else sys.stderr
    if disable or _is_terminal(stream):
        options = {"total": total, "initial": initial, "desc": desc, "unit": unit}
        return tqdm(**options, file=stream, disable=disable, **tqdm_options)
    return LineProgress(total, desc, unit, initial=initial, file=stream)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class LineProgress:
    """One line per interval (and one when closed, if anything moved since the last)."""

    disable = False

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str,
        *,
        initial: int = 0,
        file: TextIO | None = None,
        seconds: float | None = None,
    ) -> None:
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.file = file if file is not None else sys.stderr
        self.seconds = interval_seconds() if seconds is None else seconds
        self._start_n, self._started = initial, time.monotonic()
        self._last_time, self._last_n = self._started, initial
        self._postfix = ""

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self._last_time >= self.seconds:
            self._print()

    def set_description(self, desc: str, refresh: bool = False) -> None:
        """tqdm's: name what the following lines count (the demo names each head)."""
        self.desc = desc

    def set_postfix(
        self, values: Mapping[str, Any] | None = None, refresh: bool = False, **more: Any
    ) -> None:
        shown = {**(values or {}), **more}
        self._postfix = " ".join(f"{key}={value}" for key, value in shown.items())

    def close(self) -> None:
        if self.n != self._last_n:
            self._print()

    def line(self) -> str:
        """``desc: n/total unit (p%), rate unit/s, postfix``."""
        done = f"{self.n:,}/{self.total:,}" if self.total else f"{self.n:,}"
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        elapsed = time.monotonic() - self._started
        rate = (self.n - self._start_n) / elapsed if elapsed > 0 else 0.0
        tail = f", {self._postfix}" if self._postfix else ""
        left = ""
        if self.total and rate > 0 and self.n < self.total:
            left = f", about {_duration((self.total - self.n) / rate)} left"
        return f"{self.desc}: {done} {self.unit}{share}, {_speed(rate, self.unit)}{left}{tail}"

    def _print(self) -> None:
        print(self.line(), file=self.file, flush=True)
        self._last_time, self._last_n = time.monotonic(), self.n

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_note(message: str, *, file: TextIO | None = None) -> None:
    """One plain progress line (what a long step is about to do), to ``file`` (stderr): the
    library modules (analysis/) show progress through here and never print themselves."""
    print(message, file=file if file is not None else sys.stderr, flush=True)


def _speed(rate: float, unit: str) -> str:
    """``2,315.0 tok/s``; below 0.1 per second the seconds each takes (``14 s/step``, as tqdm
    does), which ``0.0 step/s`` would hide on a loaded machine."""
    if 0 < rate < 0.1:
        return f"{1 / rate:,.0f} s/{unit}"
    return f"{rate:,.1f} {unit}/s"


def _duration(seconds: float) -> str:
    """``42 s``, ``7 min``, ``3.2 h``: a time estimate at the precision it deserves."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


__all__ = ["LineProgress", "interval_seconds", "progress_bar", "progress_note"]
