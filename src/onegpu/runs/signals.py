"""SIGTERM and SIGINT stop a run gracefully: the step in flight finishes, a checkpoint and the
summary are written, and the process exits 128 + the signal's number (143, 130), as shells and
schedulers expect of a run that did not finish. A second signal stops at once: `StopNow`, which
the command line turns into one line and the same exit code (what was saved before is intact:
every save is all-or-nothing)."""

from __future__ import annotations

import signal
import threading
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopNow(KeyboardInterrupt):
    """A second SIGTERM/SIGINT: stop without finishing the step or the save in flight."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class GracefulStop:
    """`with GracefulStop() as stop: ... if stop.requested: break`."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.diverged = False  # set by the loop: too many skipped updates in a row
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def agree(self, signums: list[int]) -> None:
        """Under torchrun: every process's signal number (0: none), so that all stop after
        the same step when any of them was asked to (torchrun forwards a SIGTERM to each,
        but they may receive it during different steps)."""
        if self.signum is None and any(signums):
            self.signum = next(s for s in signums if s)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:  # asked twice: stop now
            self._restore()
            raise StopNow(signum)
        self.signum = signum

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # handlers live there only
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __exit__(self, *exc) -> None:
        self._restore()
