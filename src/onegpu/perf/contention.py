"""Whether a timing had the CPUs to itself, so that `auto` never caches a choice made on a
machine that had lost a core.

Every `auto` choice that times kernels in this process (attention, the loss chunk and its
kernels, the compile modes, the matmul peak and floor, the host optimizer's rate, JAX's
precision and loss chunk) caches its result for good. A trial taken while another process ran
on the same CPUs measures that process as much as the kernels: on our 2-core EPYC a
loss-kernel trial timed while a compile ran on the other core found eager and compiled equal
(1.63 s each; 1.04 and 0.93 s when quiet) and cached "eager" (docs/cpu-notes.md).
Interleaving the contestants protects their ratio from a machine that is uniformly slower,
not from one whose spare core comes and goes.

The signal is Linux's per-thread scheduler statistics (`/proc/self/task/*/schedstat`): the
time this process's threads ran, and the time they were ready to run but waited for a CPU.
Quiet, torch's trials wait under 4% of their run time whatever the kernels' parallelism (a
thread that has nothing to do sleeps; it does not wait), XLA's up to 7% (its thread pools
hold more threads than cores); beside one busy process 40-66%
(benchmarks/results/contention-2026-11-28*.md). Not seen: a hypervisor's steal, another process's own
slowness. Not judged: systems without the statistics, and a cgroup with a CPU quota (its
throttled threads wait too, a wait that says nothing of other processes).

A disturbed timing is still used by the run that took it, with a warning naming it, but is
not cached as measured: the next run times again. It is kept apart as provisional
(cache.PROVISIONAL), which only a plan for a run in another process reads
(`follows_last_run`): such a plan predicts what the last run here did.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from onegpu.cache import cache_root, cached, drop, peek, provisional_reads
from onegpu.perf.allocator import active_allocator, run_allocator

MAX_WAIT_SHARE = 0.25
"""A timing whose threads waited for a CPU longer than this share of the time they ran is
disturbed. Measured on a quiet 2-core EPYC: torch's trials under 4%; XLA's up to 7%, its own
thread pools oversubscribing the cores (a wait this cannot tell from another process's).
Beside one busy process: 40-66%
(benchmarks/results/contention-2026-11-28*.md)."""
MIN_RUN_NS = 50_000_000
"""Below this much run time (all threads) the share is too coarse to judge."""

T = TypeVar("T")


def _sample(tasks: Path = Path("/proc/self/task")) -> dict[str, tuple[int, int]] | None:
    """Each thread's (ns run, ns waited for a CPU) so far; None where the kernel does not say."""
    found: dict[str, tuple[int, int]] = {}
    try:
        threads = list(tasks.iterdir())
    except OSError:
        return None
    for thread in threads:
        try:
            ran, waited, _ = (thread / "schedstat").read_text().split()
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile, or a kernel without schedstat
        found[thread.name] = (int(ran), int(waited))
    return found or None


@dataclass(slots=True)
class RunQueueWatch:
    """This process's threads' run and wait time over the blocks `watching()` covers."""

    ran_ns: int = 0
    waited_ns: int = 0
    readable: bool = True

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        start = _sample()
        try:
            yield
        finally:
            end = _sample()
            if start is None or end is None:
                self.readable = False
            else:
                for tid, (ran, waited) in end.items():
                    ran0, waited0 = start.get(tid, (0, 0))  # a thread started meanwhile: all
                    if ran < ran0 or waited < waited0:  # an id reused by a new thread
                        ran0 = waited0 = 0
                    self.ran_ns += ran - ran0
                    self.waited_ns += waited - waited0

    def wait_share(self) -> float | None:
        """Waited over ran; None where it cannot be judged (no schedstat, too little run, a
        CPU quota)."""
        if not self.readable or self.ran_ns < MIN_RUN_NS or cpu_quota():
            return None
        return self.waited_ns / self.ran_ns

    def disturbed(self) -> bool:
        share = self.wait_share()
        return share is not None and share > MAX_WAIT_SHARE


_MEASURED: set[tuple[str, str]] = set()
"""(cache file's path, key) of every timing this process took, stored or not."""
_UNSTORED: dict[tuple[str, str], Any] = {}
"""Disturbed timings this process took, by (cache file's path, key): a later call in the
process (a plan, then the run) reuses one instead of timing again, so that a run makes one
choice."""


def cpu_quota(
    cgroups: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> bool:
    """Whether this process's cgroup caps its CPU time (v2 `cpu.max`, v1 `cfs_quota_us`)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return False
    files = []
    for line in lines:
        _, controllers, where = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            files.append(cgroups / where.lstrip("/") / "cpu.max")
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own
            files.append(cgroups / controllers / where.lstrip("/") / "cpu.cfs_quota_us")
    for f in files:
        try:
            limit = f.read_text().split()[0]
        except (OSError, IndexError):
            continue
        if limit not in ("max", "-1"):
            return True
    return False


def _memo(name: str, key: str) -> tuple[str, str]:
    return str(cache_root() / name), key


def timed_cached(
    name: str,
    key: str,
    measure: Callable[[], T],
    *,
    what: str,
    refresh: bool = False,
    valid: Callable[[Any], bool] | None = None,
    on_disturbed: Callable[[float], None] | None = None,
    keeps_stored: bool = False,
) -> T:
    """cache.cached() for a measurement that times: stored only where its threads had the CPUs
    (RunQueueWatch). A disturbed one is kept for this process alone and reported: a warning
    naming `what`, or `on_disturbed(wait share)` where given (a caller that times many).
    A disturbed refresh drops the stored figure (known stale: the next run measures), unless
    `keeps_stored` (a measure that already takes the stored figure into account)."""
    memo = _memo(name, key)
    if not refresh and memo in _UNSTORED and peek(name, key, valid) is None:
        provisional_reads.append(name)
        return _UNSTORED[memo]
    watch = RunQueueWatch()

    def watched() -> T:
        _MEASURED.add(memo)
        with watch.watching():
            return measure()

    value = cached(
        name, key, watched, refresh=refresh, valid=valid, keep=lambda _: not watch.disturbed()
    )
    if (share := watch.wait_share()) is not None and watch.disturbed():
        _UNSTORED[memo] = value
        provisional_reads.append(name)  # what this process goes on to plan or run follows it
        if refresh and not keeps_stored:  # the figure it replaces is stale: the next run measures
            drop(name, key)
        if on_disturbed is not None:
            on_disturbed(share)
        else:
            warnings.warn(disturbed_message(what, name, share), stacklevel=2)
    return value


def measured_here(name: str, key: str) -> bool:
    """Whether this process took the timing under `key` (a plan before its run, say): what it
    reads back from the cache is not a cached figure to the user, it was paid for here."""
    return _memo(name, key) in _MEASURED


def follows_last_run() -> bool:
    """Whether a plan here reads provisional timings: where it predicts a run in another
    process (`onegpu plan`, or any process under another allocator than `onegpu train` runs
    with). The memory check `onegpu train` makes before its own run does not: the run times
    again, and the check with it."""
    return run_allocator() != active_allocator()


def disturbed_message(what: str, name: str, share: float) -> str:
    return (
        f"{what} was timed on busy CPUs (its threads waited for one {share:.0%} of the time "
        f"they ran: another process ran, or more threads than cores): this run uses it, "
        f"{name} does not keep it, and the next run times it again"
    )
