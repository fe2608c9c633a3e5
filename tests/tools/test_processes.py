"""Child processes given a deadline end with everything they started, and a run stopped after
its steps counts its graceful stop as success (onegpu.tools.processes)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from onegpu.tools.processes import logged_steps, run_bounded, run_stopped


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent that may never reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_deadline_ends_the_child_and_what_it_started(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    parent = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_bounded([sys.executable, "-c", parent], timeout_s=5.0)
    assert time.monotonic() - t0 < 30
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_without_a_deadline_the_child_runs_to_its_end():
    done = run_bounded([sys.executable, "-c", "print('out'); raise SystemExit(3)"], None)
    assert (done.returncode, done.stdout) == (3, "out\n")


def _fake_run(tmp_path: Path, steps_by_itself: int) -> list[str]:
    """A stand-in for `onegpu train`: logs a step line every 50 ms; SIGTERM finishes the step
    and exits 143, as onegpu's graceful stop does; alone it ends after `steps_by_itself`."""
    metrics = tmp_path / "metrics.jsonl"
    script = (
        "import json, signal, sys, time\n"
        "stop = []\n"
        "signal.signal(signal.SIGTERM, lambda *a: stop.append(1))\n"
        f"for step in range(1, {steps_by_itself} + 1):\n"
        "    time.sleep(0.05)\n"
        f"    with open({str(metrics)!r}, 'a') as f:\n"
        "        f.write(json.dumps({'step': step, 'step_time_s': 0.05}) + '\\n')\n"
        "    if stop:\n"
        "        print('stopped', file=sys.stderr)\n"
        "        sys.exit(143)\n"
    )
    return [sys.executable, "-c", script]


def test_a_run_stopped_after_its_steps_counts_the_graceful_stop_as_success(tmp_path):
    code, err = run_stopped(_fake_run(tmp_path, 10_000), tmp_path / "metrics.jsonl", 5, 60.0)
    assert (code, err.strip()) == (0, "stopped")
    assert 5 <= logged_steps(tmp_path / "metrics.jsonl") < 100


def test_a_run_that_ends_before_its_steps_keeps_its_own_exit_code(tmp_path):
    code, _ = run_stopped(_fake_run(tmp_path, 2), tmp_path / "metrics.jsonl", 5, 60.0)
    assert code == 0 and logged_steps(tmp_path / "metrics.jsonl") == 2
    crash = [sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(1)"]
    assert run_stopped(crash, tmp_path / "none.jsonl", 5, 60.0) == (1, "boom\n")


def test_a_run_that_never_logs_its_steps_ends_at_its_deadline(tmp_path):
    pid_file = tmp_path / "run.pid"
    silent = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        run_stopped([sys.executable, "-c", silent], tmp_path / "metrics.jsonl", 5, 3.0)
    assert not _alive(int(pid_file.read_text()))
