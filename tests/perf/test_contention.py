"""A timing taken while another process held the CPUs is used by its run but never cached
(perf/contention.py): the scheduler's per-thread wait, read around the measurement."""

import contextlib
import os
import subprocess
import sys
import time
import warnings

import pytest

from onegpu import cache
from onegpu.perf import contention
from onegpu.perf.contention import MAX_WAIT_SHARE, RunQueueWatch, timed_cached

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the scheduler's statistics are Linux's"
)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@contextlib.contextmanager
def _sharing_one_cpu_with_a_busy_process():
    """This thread and a spinning process on the same CPU: each gets about half of it."""
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    busy = subprocess.Popen(
        [sys.executable, "-c", "import sys\nprint(flush=True)\nwhile True: pass"],
        stdout=subprocess.PIPE,
    )
    try:
        os.sched_setaffinity(busy.pid, {cpu})
        os.sched_setaffinity(0, {cpu})  # this thread only
        busy.stdout.readline()  # it runs
        yield
    finally:
        os.sched_setaffinity(0, before)
        busy.kill()
        busy.wait()


def _timing(value: dict, seconds: float = 0.3):
    calls: list[int] = []

    def measure() -> dict:
        calls.append(1)
        _spin(seconds)
        return value

    return measure, calls


def test_a_quiet_thread_barely_waits_for_a_cpu():
    watch = RunQueueWatch()
    with watch.watching():
        _spin(0.3)
    assert watch.readable
    assert watch.ran_ns >= 0.2e9
    assert watch.wait_share() is not None and watch.wait_share() < MAX_WAIT_SHARE


def test_a_thread_sharing_its_cpu_with_a_busy_process_waits_for_it():
    watch = RunQueueWatch()
    with _sharing_one_cpu_with_a_busy_process(), watch.watching():
        _spin(0.5)
    assert watch.wait_share() > 0.3  # about 1: half the time each


def test_a_quiet_timing_is_cached():
    measure, calls = _timing({"seconds": 1.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning
        assert timed_cached("contention-test.json", "quiet", measure, what="x") == {"seconds": 1.0}
    assert cache.peek("contention-test.json", "quiet") == {"seconds": 1.0}
    assert timed_cached("contention-test.json", "quiet", measure, what="x") == {"seconds": 1.0}
    assert len(calls) == 1
    # what this process timed is not "cached" to its user, though read back from the file
    assert contention.measured_here("contention-test.json", "quiet")
    assert not contention.measured_here("contention-test.json", "never-timed")


def test_a_disturbed_timing_is_used_once_per_process_and_never_cached(monkeypatch):
    monkeypatch.setattr(contention, "_UNSTORED", {})
    measure, calls = _timing({"seconds": 2.0})
    with _sharing_one_cpu_with_a_busy_process(), pytest.warns(UserWarning) as seen:
        found = timed_cached("contention-test.json", "busy", measure, what="the test's kernel")
    assert found == {"seconds": 2.0}
    assert cache.peek("contention-test.json", "busy") is None
    # kept apart: a plan, predicting what the last run did, reads it
    assert cache.peek("contention-test.json", "busy", provisional=True) == found
    message = str(seen[0].message)
    assert "the test's kernel was timed while other processes held" in message
    assert "contention-test.json does not keep it" in message
    # the same process asks again (a plan, then the run): the same value, not timed again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert timed_cached("contention-test.json", "busy", measure, what="x") == found
    assert len(calls) == 1
    # a new process (here: the memo forgotten) on a quiet machine times it and keeps it
    monkeypatch.setattr(contention, "_UNSTORED", {})
    assert timed_cached("contention-test.json", "busy", measure, what="x") == found
    assert len(calls) == 2
    assert cache.peek("contention-test.json", "busy") == found


def test_a_caller_that_times_many_hears_of_each_disturbed_one(monkeypatch):
    monkeypatch.setattr(contention, "_UNSTORED", {})
    measure, _ = _timing({"seconds": 3.0})
    shares: list[float] = []
    with _sharing_one_cpu_with_a_busy_process(), warnings.catch_warnings():
        warnings.simplefilter("error")  # told, not warned
        timed_cached("contention-test.json", "many", measure, what="x", on_disturbed=shares.append)
    assert len(shares) == 1 and shares[0] > MAX_WAIT_SHARE
    assert cache.peek("contention-test.json", "many") is None


def test_where_the_kernel_says_nothing_the_timing_is_cached_unjudged(monkeypatch):
    monkeypatch.setattr(contention, "_sample", lambda: None)
    measure, _ = _timing({"seconds": 4.0}, seconds=0.0)
    watch = RunQueueWatch()
    with watch.watching():
        pass
    assert watch.wait_share() is None and not watch.disturbed()
    assert timed_cached("contention-test.json", "unread", measure, what="x") == {"seconds": 4.0}
    assert cache.peek("contention-test.json", "unread") == {"seconds": 4.0}


def test_a_value_measured_meanwhile_by_another_run_stays_in_the_file():
    def measure() -> int:
        cache.cached("contention-test.json", "other-run", lambda: 7)  # another process, say
        return 8

    assert cache.cached("contention-test.json", "this-run", measure) == 8
    assert cache.peek("contention-test.json", "other-run") == 7
    assert cache.peek("contention-test.json", "this-run") == 8


def test_a_value_keep_rejects_is_returned_and_stored_only_as_provisional():
    assert cache.cached("contention-test.json", "rejected", lambda: 9, keep=lambda v: False) == 9
    assert cache.peek("contention-test.json", "rejected") is None
    assert cache.peek("contention-test.json", "rejected", provisional=True) == 9
    # a later measurement that is kept wins, provisional or not
    assert cache.cached("contention-test.json", "rejected", lambda: 10) == 10
    assert cache.peek("contention-test.json", "rejected", provisional=True) == 10
