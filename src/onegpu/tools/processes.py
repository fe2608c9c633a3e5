"""Child processes that end inside a deadline, with everything they started.

Benchmarks run each row as a fresh `onegpu train` (or torchrun, or a worker script). On a
short-lived GPU machine a row that overruns must end, and with it what it started (inductor's
compile workers; torchrun's ranks, which torchrun ends when it is sent SIGTERM): a child given
a deadline starts its own process group, which is sent SIGTERM, then SIGKILL, when the
deadline passes or the caller is interrupted. A child with no deadline stays in ours, so a
Ctrl-C reaches it as before.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

GRACEFUL_EXIT = (128 + signal.SIGTERM, -signal.SIGTERM)
"""A run stopped by SIGTERM: onegpu's graceful stop (143), or killed by it while it was
already shutting down after its last step (-15)."""


def end_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """End `proc` and, where `start` gave it a process group of its own, the whole group:
    SIGTERM first (torchrun then ends the ranks it started in sessions of their own; onegpu
    stops gracefully), SIGKILL for what is left after `grace_s`."""
    if not getattr(proc, "own_group", False):
        proc.kill()
        proc.wait()
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:  # the leader and its group are gone
        proc.wait()
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):  # what is left, the leader included
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def start(cmd: list[str], timeout_s: float | None, **kwargs: Any) -> subprocess.Popen:
    """Popen, in a process group of its own where there is a deadline to enforce."""
    proc = subprocess.Popen(cmd, start_new_session=timeout_s is not None, **kwargs)
    proc.own_group = timeout_s is not None
    return proc


def run_bounded(
    cmd: list[str], timeout_s: float | None, **kwargs: Any
) -> subprocess.CompletedProcess:
    """`subprocess.run(capture_output=True, text=True)` whose timeout ends the child's whole
    process group; raises TimeoutExpired as `subprocess.run` does."""
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    proc = start(cmd, timeout_s, **pipes, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except BaseException:
        end_group(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_stopped(
    cmd: list[str], metrics: Path, stop_after: int, timeout_s: float | None
) -> tuple[int, str]:
    """Run a `onegpu train` command and stop it gracefully (SIGTERM) once `stop_after` steps
    are in its `metrics` file: (exit code, stderr), the graceful stop's code counted as 0."""
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
    with tempfile.TemporaryFile("w+") as err:
        proc = start(cmd, timeout_s, stdout=subprocess.DEVNULL, stderr=err, text=True)
        stopped = False
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(cmd, timeout_s or 0.0)
                if not stopped and logged_steps(metrics) >= stop_after:
                    proc.send_signal(signal.SIGTERM)
                    stopped = True
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                end_group(proc)
        err.seek(0)
        graceful = stopped and proc.returncode in GRACEFUL_EXIT
        return (0 if graceful else proc.returncode), err.read()


def logged_steps(metrics: Path) -> int:
    """Steps a run has logged so far (one `step_time_s` per step line)."""
    try:
        return metrics.read_text().count('"step_time_s"')
    except FileNotFoundError:
        return 0
