"""Contestants timed in turns: every process alive at once, one running at a time.

A shared VM's speed can move 3x within seconds (results/rate-drift-2026-12-06.md: a bf16
matmul flips between ~700 and ~2,000 GFLOP/s every few seconds), so rounds minutes apart
compare different machines as much as different programs. Here every contestant starts and
warms up alone and is then frozen (SIGSTOP to its process group); then each runs a few steps
in turn, cycle after cycle, so that one cycle compares all of them within tens of seconds
(a cycle of 4-7 contestants at 3 steps took 15-40 s in our runs), not minutes. Slow phases
shorter than a cycle still fall on single turns: the ratio of two contestants is the median
over cycles of the ratio of their median steps in that cycle, and `spread` gives its
quartiles, so a reader sees how far one cycle's ratio can move.

Two steps are dropped after each continue: the one the freeze cut in two, and the next, since
a trainer may start its next step's clock before it writes the last step's line (onegpu's
meter does), and a freeze in between would land in that next step. Each contestant writes one
JSON line per completed step with its `step_time_s` (onegpu's metrics.jsonl at
`--train.log_every 1`; the peers' `--steps-file`), flushed as it goes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

POLL_S = 0.05
DROPPED = 2
"""Steps dropped after each continue (see the module's docstring)."""
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
    stderr: Path | None = None
    """Where the process's stderr goes (a temporary file, not in the run's folder, which a
    trainer may want empty): read when it ends early."""
    turns: list[list[float]] = field(default_factory=list)
    """The clean steps of each turn (seconds), cycle by cycle."""
    peak_rss_bytes: int = 0

    def start(self) -> None:
        # a session of its own: SIGSTOP reaches its helpers too (inductor's compile workers);
        # stderr to a file, which nothing has to drain while the process is frozen
        fd, name = tempfile.mkstemp(prefix=f"paired-{self.name}-", suffix=".stderr")
        self.stderr = Path(name)
        with os.fdopen(fd, "w") as err:
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=err,
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
                err = self.stderr.read_text()[-3000:]
                raise RuntimeError(f"{self.name} ended early:\n{err}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no step {count} within {timeout_s:.0f} s")
            time.sleep(POLL_S)

    def finish(self) -> None:
        """Read the peak RSS (VmHWM: what ru_maxrss reports), then end the process (a graceful
        SIGTERM, SIGKILL after a minute); a process already gone is left as it is."""
        try:
            self.peak_rss_bytes = _peak_rss(self.proc.pid)
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
        except (FileNotFoundError, ProcessLookupError):
            return
        finally:
            self.stderr.unlink(missing_ok=True)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
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
    """Warm each contestant alone (`warm` steps), then `cycles` cycles of at least `turn_steps`
    clean steps each; fills each contestant's `turns` and `peak_rss_bytes`."""
    try:
        for c in contestants:  # one at a time: no startup or compilation overlaps a timed step
            c.start()
            c.run_until(warm, START_TIMEOUT_S)
            c.freeze()
            log(f"{c.name}: warm ({warm} steps)")
        for cycle in range(cycles):
            for c in contestants:
                before = len(c.steps())
                c.run_until(before + DROPPED + turn_steps, TURN_TIMEOUT_S)
                after = c.freeze()
                c.turns.append(c.steps()[before + DROPPED : after])
            log(
                f"cycle {cycle + 1}: "
                + ", ".join(
                    f"{c.name} {statistics.median(c.turns[-1]) * 1e3:,.0f} ms" for c in contestants
                )
            )
    finally:
        for c in contestants:  # every one, whatever another's end raised
            if c.proc is not None and c.proc.poll() is None:
                try:
                    c.finish()
                except OSError as e:
                    print(f"{c.name}: could not be ended cleanly ({e})", flush=True)


def step_time(c: Contestant) -> float:
    """The median of every clean step."""
    return statistics.median(t for turn in c.turns for t in turn)


def cycle_ratios(fast: Contestant, slow: Contestant) -> list[float]:
    """How many times faster `fast` ran than `slow` in each cycle (their median steps)."""
    return [statistics.median(s) / statistics.median(f) for f, s in zip(fast.turns, slow.turns)]


def ratio(fast: Contestant, slow: Contestant) -> float:
    """How many times faster `fast` ran than `slow`: the median over cycles."""
    return statistics.median(cycle_ratios(fast, slow))


def spread(fast: Contestant, slow: Contestant) -> tuple[float, float]:
    """The first and third quartiles of the per-cycle ratios."""
    ratios = cycle_ratios(fast, slow)
    if len(ratios) < 2:
        return ratios[0], ratios[0]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return q1, q3


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """--paired, --cycles and --turn-steps, as every benchmark that offers turns takes them."""
    ap.add_argument("--paired", action="store_true", help="time every contestant in turns, "
                    "all alive at once (benchmarks/paired.py): for machines whose speed drifts")  # fmt: skip
    ap.add_argument("--cycles", type=int, default=12, help="with --paired: turns per contestant")
    ap.add_argument("--turn-steps", type=int, default=3, help="with --paired: clean steps a turn")


def flags(a: argparse.Namespace) -> str:
    """The turns' flags as a result file's command line shows them."""
    return f"--paired --cycles {a.cycles} --turn-steps {a.turn_steps}"


def method(a: argparse.Namespace, what: str) -> str:
    """How a result file's ratios were timed, in its header."""
    return (
        f"every {what} alive at once and timed in turns (benchmarks/paired.py): {a.cycles} "
        f"cycles of {a.turn_steps} clean steps each; ratios: the median over cycles of each "
        "cycle's ratio (in brackets: their quartiles)"
    )
