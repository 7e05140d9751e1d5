"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM.

While a stage runs, :class:`SignalCatcher` replaces the handlers of both signals by one that only
records the signal; the loop looks at it between steps (where the state is whole: the same
point as a ``--max-steps`` stop), saves the last checkpoint there and raises
:class:`~highrank.train.state.Interrupted` naming the file. The first signal also puts the
previous handlers back, so a second Ctrl-C interrupts at once (inside a long step or a
validation) without saving: the last periodic checkpoint is then what remains. Under torchrun
(``once=False``) every process keeps catching: a Ctrl-C reaches each twice (from the terminal
and from torchrun), and the processes agree on the step to stop at
(:mod:`highrank.train.distributed`). Handlers can
only be set in the main thread; elsewhere signals keep their usual effect.

A step may take minutes on a loaded machine, so the handler says at once, in one line on
stderr (process 0 only under torchrun), that the signal arrived and the run stops after the
current step.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType, TracebackType

from highrank.train.distributed import launched_rank

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SignalCatcher:
    """``with SignalCatcher() as caught:`` ... ``caught.name`` is "SIGINT"/"SIGTERM" once one
    arrived, else None; ``enabled=False`` catches nothing; ``once=False`` keeps catching
    after the first signal (torchrun's processes, which receive a Ctrl-C twice)."""

    def __init__(self, enabled: bool = True, once: bool = True) -> None:
        self.enabled, self.once = enabled, once
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def name(self) -> str | None:
        return None if self.signal is None else signal.Signals(self.signal).name

    def __enter__(self) -> SignalCatcher:
        if self.enabled and threading.current_thread() is threading.main_thread():
            for number in SIGNALS:
                self._previous[number] = signal.signal(number, self._catch)
        return self

    def _catch(self, number: int, frame: FrameType | None) -> None:
        first = self.signal is None
        self.signal = number
        if self.once:
            self._restore()  # a second signal acts as usual
        if first and launched_rank() in (None, 0):
            _say(received_line(number, once=self.once))

    def _restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._restore()


def received_line(number: int, *, once: bool = True) -> str:
    """What the handler prints when the first signal arrives."""
    line = f"highrank: {signal.Signals(number).name} received: stopping after the current step"
    if once and number == signal.SIGINT:
        line += " (Ctrl-C again stops at once, saving nothing)"
    return line


def _say(line: str) -> None:
    """``line`` on stderr from a signal handler: a handler that interrupted another write to
    stderr must not fail (a reentrant write), so the line is then dropped."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (RuntimeError, OSError, ValueError):
        pass


__all__ = ["SIGNALS", "SignalCatcher", "received_line"]
