"""The GPU suite's time budget: a lent GPU machine is short-lived, so the suite must end inside it.

A lease gives a session 15 minutes of device time, the machine's start included, and 10 minutes
a command (docs/gpu-suite.md). `--budget-s` makes the suite end inside one command with what it
measured: a row starts only if the longest row of its section so far (or the section's first
guess) still fits, every process it starts is killed at the deadline with what it started
(onegpu.tools.processes), and a row left out says so in the result file instead of vanishing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

# The first row's guess per section on one H100 (a fresh `onegpu train` process each: CUDA
# start, model build, the steps; the speed rows compile). Later rows use the longest so far.
FIRST_GUESS_S = {"tests": 150.0, "memory": 45.0, "explain": 60.0, "overlap": 45.0, "speed": 150.0}


@dataclass
class Budget:
    """Seconds the suite may run (None: no limit), and how long each section's rows took."""

    seconds: float | None
    start: float = field(default_factory=time.monotonic)
    longest: dict[str, float] = field(default_factory=dict)

    def left(self) -> float:
        if self.seconds is None:
            return math.inf
        return self.seconds - (time.monotonic() - self.start)

    def skip_reason(self, section: str, guess_s: float | None = None) -> str | None:
        """None when the next row of `section` fits in what is left, else why it is left out.
        `guess_s`: the least this row is taken to need (a larger model than those timed)."""
        need = max(self.longest.get(section, FIRST_GUESS_S[section]), guess_s or 0.0)
        left = self.left()
        if left >= need:
            return None
        return f"left out: {max(0.0, left):.0f} s of --budget-s left, a {section} row takes ~{need:.0f} s"

    def timeout(self) -> float | None:
        """The longest a process started now may run (None: as long as it takes)."""
        left = self.left()
        return None if math.isinf(left) else max(1.0, left)

    def took(self, section: str, seconds: float) -> None:
        self.longest[section] = max(self.longest.get(section, 0.0), seconds)
