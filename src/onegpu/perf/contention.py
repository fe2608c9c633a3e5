"""Whether a timing had the CPUs to itself, so that `auto` never caches a choice made on a
machine that had lost a core.

Every `auto` choice that times kernels (attention, the loss chunk and its kernels, the compile
modes, the matmul peak) caches its result for good. A trial taken while another process ran on
the same CPUs measures that process as much as the kernels: on our 2-core EPYC a loss-kernel
trial timed while a compile ran on the other core found eager and compiled equal (1.63 s each;
1.07x apart when quiet) and cached "eager" (docs/cpu-notes.md). Interleaving the contestants
protects their ratio from a machine that is uniformly slower, not from one whose spare core
comes and goes.

The signal is Linux's per-thread scheduler statistics (`/proc/self/task/*/schedstat`): the
time this process's threads ran, and the time they were ready to run but waited for a CPU.
Quiet, torch's trials wait well under 1% of their run time, whatever the kernels' parallelism
(a thread that has nothing to do sleeps; it does not wait), XLA's up to ~16% (its thread pools
hold more threads than cores). With one busy process beside a 2-thread trial it is 37-98%. A cgroup's CPU quota or a hypervisor's steal is not seen (neither is
another process's); where the file is missing (not Linux), nothing is judged.

A disturbed timing is still used by the run that took it, with a warning naming it, but is
not cached as measured: the next run times again. It is kept apart as provisional
(cache.PROVISIONAL), which only a plan reads: a plan predicts what the last run here did.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from onegpu.cache import cached, peek

MAX_WAIT_SHARE = 0.25
"""A timing whose threads waited for a CPU longer than this share of the time they ran is
disturbed. Measured on a quiet 2-core EPYC: torch's trials <1%; XLA's 9-16%, its own thread
pools oversubscribing the cores (a wait this cannot tell from another process's). Beside one
busy process: 37-98% (benchmarks/results/contention-*.md)."""
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
                    self.ran_ns += ran - ran0
                    self.waited_ns += waited - waited0

    def wait_share(self) -> float | None:
        """Waited over ran; None where it cannot be judged (no schedstat, too little run)."""
        if not self.readable or self.ran_ns < MIN_RUN_NS:
            return None
        return self.waited_ns / self.ran_ns

    def disturbed(self) -> bool:
        share = self.wait_share()
        return share is not None and share > MAX_WAIT_SHARE


_MEASURED: set[tuple[str, str]] = set()
"""(cache file, key) of every timing this process took, stored or not."""
_UNSTORED: dict[tuple[str, str], Any] = {}
"""Disturbed timings this process took, by (cache file, key): a later call in the process (a
plan, then the run) reuses one instead of timing again, so that a run makes one choice."""


def timed_cached(
    name: str,
    key: str,
    measure: Callable[[], T],
    *,
    what: str,
    refresh: bool = False,
    valid: Callable[[Any], bool] | None = None,
    on_disturbed: Callable[[float], None] | None = None,
) -> T:
    """cache.cached() for a measurement that times: stored only where its threads had the CPUs
    (RunQueueWatch). A disturbed one is kept for this process alone and reported: a warning
    naming `what`, or `on_disturbed(wait share)` where given (a caller that times many)."""
    if not refresh and (name, key) in _UNSTORED and peek(name, key, valid) is None:
        return _UNSTORED[(name, key)]
    watch = RunQueueWatch()

    def watched() -> T:
        _MEASURED.add((name, key))
        with watch.watching():
            return measure()

    value = cached(
        name, key, watched, refresh=refresh, valid=valid, keep=lambda _: not watch.disturbed()
    )
    if (share := watch.wait_share()) is not None and watch.disturbed():
        _UNSTORED[(name, key)] = value
        if on_disturbed is not None:
            on_disturbed(share)
        else:
            warnings.warn(disturbed_message(what, name, share), stacklevel=2)
    return value


def measured_here(name: str, key: str) -> bool:
    """Whether this process took the timing under `key` (a plan before its run, say): what it
    reads back from the cache is not a cached figure to the user, it was paid for here."""
    return (name, key) in _MEASURED


def disturbed_message(what: str, name: str, share: float) -> str:
    return (
        f"{what} was timed while other processes held this machine's CPUs (its threads "
        f"waited for a CPU {share:.0%} of the time they ran): this run uses it, {name} does "
        "not keep it (plans follow it), and the next run times it again"
    )
