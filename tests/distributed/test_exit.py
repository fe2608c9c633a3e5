"""A process that opened a process group leaves without the interpreter's teardown.

After FSDP2 the gloo group outlives destroy_process_group (held from C++, its threads
running); the interpreter's teardown around them once ended a CI run's rank in "terminate
called without an active exception" (SIGABRT). The exit keeps what teardown is for: the
run's exit code, the exit handlers, flushed output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import atexit, os, sys
from pathlib import Path
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))

class Teardown:
    # what __del__ needs, held by the object: the teardown may have cleared module globals
    # (set to None, in no fixed order) by the time it collects the object
    def __init__(self, path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self.write = os.write

    def __del__(self):
        self.write(self.fd, b"ran")

marker = Teardown(out / "teardown")  # collected only by the interpreter's teardown
sys.argv = ["onegpu", "train", "--preset", "tiny", "--train.max_steps", "2",
            "--out.progress", "false", "--out.dir", str(out / "run"), *sys.argv[2:]]
from onegpu.cli import entry
entry()
"""


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ONEGPU_ALLOCATOR": "system", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), *args],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip


@pytest.mark.slow
def test_after_a_process_group_exit_handlers_run_and_teardown_is_skipped(tmp_path):
    proc = _run(tmp_path, "--memory.offload_params", "true")  # FSDP2 over a group of one
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"val_loss"' in proc.stdout  # the summary was flushed before the exit
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "teardown").read_text() == ""  # made, never written
    assert (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.slow
def test_without_a_process_group_the_interpreter_ends_as_usual(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "teardown").read_text() == "ran"


POOL = """
import concurrent.futures, sys
from onegpu.distributed import context
context.opened_a_group = lambda: True  # as after torchrun
pool = concurrent.futures.ThreadPoolExecutor(2)  # as inductor's compile pool, idle at the end
pool.submit(print, "used").result()
from onegpu.cli import _leave_without_teardown_after_a_process_group
_leave_without_teardown_after_a_process_group(3)
"""


def test_idle_pool_workers_do_not_hold_the_exit(tmp_path):
    """A pool's idle workers wait for work until told to leave: joined before they are told
    (the interpreter tells them first), a torchrun rank that had compiled never ended."""
    proc = subprocess.run([sys.executable, "-c", POOL], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout == "used\n"
