"""Contestants timed in turns: every process alive at once, one running at a time.

A shared VM's speed can move 3x within seconds (results/rate-drift-2026-12-06.md: a bf16
matmul flips between ~700 and ~2,000 GFLOP/s every few seconds), so rounds minutes apart
compare different machines as much as different programs. Here every contestant starts and
warms up alone and is then frozen (SIGSTOP to its process group); then each runs a few steps
in turn, cycle after cycle, so that one cycle compares all of them within seconds. The step a
stop cut in two is dropped: the first step a process completes after it is continued. Each
contestant writes one JSON line per completed step with its `step_time_s` (onegpu's
metrics.jsonl at `--train.log_every 1`; the peers' `--steps-file`), flushed as it goes.

The ratio of two contestants is the median over cycles of the ratio of their median steps in
that cycle: a slow moment of the machine falls on one cycle, not on one contestant.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

POLL_S = 0.02
START_TIMEOUT_S = 900.0  # startup, first compilation and the warm steps of one contestant
TURN_TIMEOUT_S = 300.0


@dataclass
class Contestant:
    """One process in the turns: its command, environment and the file it logs steps to."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    steps_file: Path
    proc: subprocess.Popen | None = None
    turns: list[list[float]] = field(default_factory=list)
    """The clean steps of each turn (seconds), cycle by cycle."""
    peak_rss_bytes: int = 0

    def start(self) -> None:
        # a session of its own: SIGSTOP reaches its helpers too (inductor's compile workers)
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def steps(self) -> list[float]:
        """Every step completed so far (complete lines only)."""
        if not self.steps_file.exists():
            return []
        rows = []
        for line in self.steps_file.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line still being written
                break
            if "step_time_s" in row:
                rows.append(row["step_time_s"])
        return rows

    def signal(self, sig: signal.Signals) -> None:
        os.killpg(self.proc.pid, sig)

    def freeze(self) -> int:
        """Stop the process group; the number of steps it had completed by then."""
        self.signal(signal.SIGSTOP)
        while _state(self.proc.pid) not in ("T", "t", "Z", None):
            time.sleep(POLL_S)
        return len(self.steps())

    def run_until(self, count: int, timeout_s: float) -> None:
        """Continue the process and wait until `count` steps are completed."""
        self.signal(signal.SIGCONT)
        deadline = time.monotonic() + timeout_s
        while len(self.steps()) < count:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode()[-3000:]
                raise RuntimeError(f"{self.name} ended early:\n{err}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no step {count} within {timeout_s:.0f} s")
            time.sleep(POLL_S)

    def finish(self) -> None:
        """Read the peak RSS (VmHWM: what ru_maxrss reports), then end the process."""
        self.peak_rss_bytes = _peak_rss(self.proc.pid)
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait()


def _state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def run_in_turns(
    contestants: list[Contestant], warm: int, cycles: int, turn_steps: int, log=print
) -> None:
    """Warm each contestant alone (`warm` steps), then `cycles` cycles of `turn_steps` clean
    steps each; fills each contestant's `turns` and `peak_rss_bytes`."""
    try:
        for c in contestants:  # one at a time: no startup or compilation overlaps a timed step
            c.start()
            c.run_until(warm, START_TIMEOUT_S)
            c.freeze()
            log(f"{c.name}: warm ({warm} steps)")
        for cycle in range(cycles):
            for c in contestants:
                before = len(c.steps())
                c.run_until(before + turn_steps + 1, TURN_TIMEOUT_S)  # +1: the cut step
                after = c.freeze()
                c.turns.append(c.steps()[before + 1 : after])
            log(
                f"cycle {cycle + 1}: "
                + ", ".join(
                    f"{c.name} {statistics.median(c.turns[-1]) * 1e3:,.0f} ms" for c in contestants
                )
            )
    finally:
        for c in contestants:
            if c.proc is not None and c.proc.poll() is None:
                c.finish()


def step_time(c: Contestant) -> float:
    """The median of every clean step."""
    return statistics.median(t for turn in c.turns for t in turn)


def ratio(fast: Contestant, slow: Contestant) -> float:
    """How many times faster `fast` ran than `slow`: the median over cycles of the ratio of
    their median steps in that cycle."""
    return statistics.median(
        statistics.median(s) / statistics.median(f) for f, s in zip(fast.turns, slow.turns)
    )
