"""Library notes stay off the terminal and nothing else does: the profiler's native
`USDT: profiler_start/stop` lines written to fd 2 are dropped, every other line written there in
the same block comes back; torchao's and torch's noisy loggers are raised to ERROR."""

import logging
import subprocess
import sys

import pytest

CHILD = r"""
import os, sys
from onegpu.quiet import native_notes_dropped
with native_notes_dropped():
    os.write(2, b"USDT:2026-11-24 11:10:09 836:836 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
    os.write(2, b"a real error from C++\n")
    print("a python warning", file=sys.stderr)
    os.write(2, b"USDT:2026-11-24 11:10:10 836:836 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
print("after", file=sys.stderr)
"""


def test_only_the_profilers_notes_are_dropped_from_fd_2():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    assert out.stderr.splitlines() == ["a real error from C++", "a python warning", "after"]


def test_noisy_library_loggers_are_raised_to_error():
    from onegpu.quiet import NOISY_LOGGERS, library_notes_off

    library_notes_off()
    assert all(logging.getLogger(n).level == logging.ERROR for n in NOISY_LOGGERS)
    assert logging.getLogger("onegpu").level == logging.NOTSET  # ours untouched


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc_trim is a Linux call")
def test_the_allocator_hands_free_pages_back_on_linux():
    from onegpu.perf.allocator import release_free_memory

    # glibc has malloc_trim; a preloaded mimalloc or tcmalloc answers with its own call first
    called = release_free_memory()
    assert called in ("mi_collect", "MallocExtension_ReleaseFreeMemory", "malloc_trim")
