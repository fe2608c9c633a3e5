"""The step's measured peak where the profiler cannot see every free (memory/breakdown.py).

On CPU the profiler subtracts only the frees made on a profiled thread: a buffer a
communication thread lets go of (gloo's, under tensor or pipeline parallelism) stays in its
running total, which then grows with every collective. The replay of allocation and free events
must not."""

from __future__ import annotations

import threading

import torch

from onegpu.memory.breakdown import allocated_in_step, profiling

MIB = 2**20
CPU = torch.device("cpu")


def _freed_by_another_thread(tensors: list[torch.Tensor]) -> None:
    thread = threading.Thread(target=tensors.clear)
    thread.start()
    thread.join()


def test_buffers_another_thread_frees_do_not_add_up():
    """Three rounds: a 1 MiB buffer freed by another thread, then 8 MiB of the step's own,
    freed here. At most 8 MiB were ever allocated at once; the profiler's total says 11."""
    with profiling(CPU) as prof:
        for _ in range(3):
            _freed_by_another_thread([torch.ones(MIB // 4)])
            own = torch.ones(2 * MIB)
            del own
    assert allocated_in_step(prof, CPU) == 8 * MIB


def test_what_the_step_keeps_counts_though_never_freed():
    """An allocation with no free that is still held after the step (a gradient, an optimizer
    state) is the step's, not a buffer freed unseen."""
    with profiling(CPU) as prof:
        kept = torch.ones(MIB // 2)  # 2 MiB, held after the step
        temp = torch.ones(MIB)  # 4 MiB while `kept` lives
        del temp
    assert allocated_in_step(prof, CPU) == 6 * MIB
    assert kept.numel() == MIB // 2
