"""A timing taken while another process held the CPUs is used by its run but never cached
(perf/contention.py): the scheduler's per-thread wait, read around the measurement."""

import contextlib
import errno
import json
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


_CPU_QUOTA = contention.cpu_quota


@pytest.fixture(autouse=True)
def _judged(monkeypatch):
    """Every timing here is judged, in a container with a CPU quota too (tested apart)."""
    monkeypatch.setattr(contention, "cpu_quota", lambda: False)


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


class _Scheduler:
    """A stand-in for the kernel's per-thread statistics: each sample, one thread has run
    another 100 ms and waited `waits` x that (the logic's tests need no quiet machine)."""

    def __init__(self, waits: float):
        self.waits, self.ran = waits, 0

    def __call__(self):
        self.ran += 100_000_000
        return {"1": (self.ran, int(self.ran * self.waits))}


def _timing(value: dict, seconds: float = 0.3):
    calls: list[int] = []

    def measure() -> dict:
        calls.append(1)
        _spin(seconds)
        return value

    return measure, calls


def test_the_kernel_reports_this_threads_run_time():
    watch = RunQueueWatch()
    with watch.watching():
        _spin(0.3)
    assert watch.readable
    assert watch.ran_ns >= 0.1e9  # however busy the machine, it ran some of the 0.3 s


def test_a_thread_sharing_its_cpu_with_a_busy_process_waits_for_it():
    watch = RunQueueWatch()
    with _sharing_one_cpu_with_a_busy_process(), watch.watching():
        _spin(0.5)
    assert watch.wait_share() > MAX_WAIT_SHARE  # about 1: half the time each
    assert watch.disturbed()


def test_a_quiet_timing_is_cached(monkeypatch):
    monkeypatch.setattr(contention, "_sample", _Scheduler(waits=0.01))
    measure, calls = _timing({"seconds": 1.0}, seconds=0.0)
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
    monkeypatch.setattr(contention, "_sample", _Scheduler(waits=0.5))
    measure, calls = _timing({"seconds": 2.0}, seconds=0.0)
    with pytest.warns(UserWarning) as seen:
        found = timed_cached("contention-test.json", "busy", measure, what="the test's kernel")
    assert found == {"seconds": 2.0}
    assert cache.peek("contention-test.json", "busy") is None
    # kept apart: a plan, predicting what the last run did, reads it
    assert cache.peek("contention-test.json", "busy", provisional=True) == found
    message = str(seen[0].message)
    assert "the test's kernel was timed on busy CPUs (its threads waited for one 50%" in message
    assert "contention-test.json does not keep it" in message
    # the same process asks again (a plan, then the run): the same value, not timed again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert timed_cached("contention-test.json", "busy", measure, what="x") == found
    assert len(calls) == 1
    # a new process (here: the memo forgotten) on a quiet machine times it and keeps it
    monkeypatch.setattr(contention, "_UNSTORED", {})
    monkeypatch.setattr(contention, "_sample", _Scheduler(waits=0.0))
    assert timed_cached("contention-test.json", "busy", measure, what="x") == found
    assert len(calls) == 2
    assert cache.peek("contention-test.json", "busy") == found


def test_a_caller_that_times_many_hears_of_each_disturbed_one(monkeypatch):
    monkeypatch.setattr(contention, "_UNSTORED", {})
    monkeypatch.setattr(contention, "_sample", _Scheduler(waits=0.6))
    measure, _ = _timing({"seconds": 3.0}, seconds=0.0)
    shares: list[float] = []
    with warnings.catch_warnings():
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


def test_runs_storing_at_once_lose_none_of_each_others_values(tmp_path):
    """Four processes store 25 values each into one cache file at the same time (torchrun's
    ranks, or a plan beside a run, timing at once): every value is in the file after."""
    script = (
        "import sys\n"
        "from onegpu import cache\n"
        "for i in range(25):\n"
        "    cache.cached('shared.json', f'{sys.argv[1]}-{i}', lambda: i)\n"
    )
    env = {**os.environ, "ONEGPU_CACHE": str(tmp_path)}
    writers = [subprocess.Popen([sys.executable, "-c", script, str(n)], env=env) for n in range(4)]
    assert all(w.wait(timeout=120) == 0 for w in writers)
    stored = json.loads((tmp_path / "shared.json").read_text())
    assert stored == {f"{n}-{i}": i for n in range(4) for i in range(25)}


def test_a_file_system_that_refuses_locks_still_stores(monkeypatch):
    """Some network and FUSE mounts refuse `flock`: the value is stored unlocked."""

    def refused(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(cache.fcntl, "flock", refused)
    with pytest.warns(UserWarning, match="refuses file locks"):
        assert cache.cached("contention-test.json", "unlocked", lambda: 11) == 11
    assert cache.peek("contention-test.json", "unlocked") == 11


def test_a_value_keep_rejects_is_returned_and_stored_only_as_provisional():
    assert cache.cached("contention-test.json", "rejected", lambda: 9, keep=lambda v: False) == 9
    assert cache.peek("contention-test.json", "rejected") is None
    assert cache.peek("contention-test.json", "rejected", provisional=True) == 9
    # a later measurement that is kept wins, provisional or not
    assert cache.cached("contention-test.json", "rejected", lambda: 10) == 10
    assert cache.peek("contention-test.json", "rejected", provisional=True) == 10
    assert "contention-test.json|rejected" not in cache.entries(cache.PROVISIONAL)  # spent


def test_a_disturbed_refresh_forgets_the_figure_it_was_to_replace(monkeypatch):
    """`onegpu info --refresh` (or a peak found stale) on a busy machine: the old figure is
    not kept either, so the next run measures."""
    monkeypatch.setattr(contention, "_UNSTORED", {})
    cache.cached("contention-test.json", "stale", lambda: {"seconds": 5.0})
    monkeypatch.setattr(contention, "_sample", _Scheduler(waits=0.5))
    measure, _ = _timing({"seconds": 6.0}, seconds=0.0)
    with pytest.warns(UserWarning):
        got = timed_cached("contention-test.json", "stale", measure, what="x", refresh=True)
    assert got == {"seconds": 6.0}
    assert cache.peek("contention-test.json", "stale") is None


def test_the_memo_is_per_cache_folder(monkeypatch, tmp_path):
    """A disturbed timing under one ONEGPU_CACHE is not another folder's."""
    monkeypatch.setattr(contention, "_UNSTORED", {})
    monkeypatch.setattr(contention, "_sample", _Scheduler(waits=0.5))
    with pytest.warns(UserWarning):
        timed_cached("contention-test.json", "where", lambda: 1, what="x")
    monkeypatch.setenv("ONEGPU_CACHE", str(tmp_path))
    monkeypatch.setattr(contention, "_sample", _Scheduler(waits=0.0))
    assert timed_cached("contention-test.json", "where", lambda: 2, what="x") == 2


def test_only_a_plan_for_another_process_follows_provisional_timings(monkeypatch):
    """`onegpu train` plans its memory check under the allocator it runs with: that plan times
    again with its run; `onegpu plan` (glibc) predicts a run's and follows the last one."""
    monkeypatch.setattr(contention, "run_allocator", lambda: "mimalloc")
    monkeypatch.setattr(contention, "active_allocator", lambda: "mimalloc")
    assert not contention.follows_last_run()
    monkeypatch.setattr(contention, "active_allocator", lambda: "system")
    assert contention.follows_last_run()


@pytest.mark.parametrize(
    ("membership", "files", "capped"),
    [
        ("0::/\n", {"cpu.max": "max 100000"}, False),
        ("0::/job\n", {"job/cpu.max": "200000 100000"}, True),  # a container's --cpus 2
        ("2:cpu,cpuacct:/\n1:memory:/x\n", {"cpu,cpuacct/cpu.cfs_quota_us": "-1"}, False),
        ("2:cpu,cpuacct:/d\n", {"cpu,cpuacct/d/cpu.cfs_quota_us": "150000"}, True),
        ("0::/\n", {}, False),  # nothing to read: no quota known
    ],
)
def test_a_cpu_quota_is_found_and_left_unjudged(tmp_path, membership, files, capped):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    (tmp_path / "self-cgroup").write_text(membership)
    assert _CPU_QUOTA(tmp_path, tmp_path / "self-cgroup") is capped


def test_under_a_cpu_quota_nothing_is_judged(monkeypatch):
    monkeypatch.setattr(contention, "cpu_quota", lambda: True)
    monkeypatch.setattr(contention, "_sample", _Scheduler(waits=0.9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert timed_cached("contention-test.json", "quota", lambda: 3, what="x") == 3
    assert cache.peek("contention-test.json", "quota") == 3
