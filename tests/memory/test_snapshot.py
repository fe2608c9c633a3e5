"""The peak of a recorded CUDA window, replayed from the allocator's trace, by allocation site."""

from __future__ import annotations

import pytest
import torch

from onegpu.memory.snapshot import BEFORE, format_peak, peak_allocations, site_of

STEP = {"filename": "/x/src/onegpu/backends/torch/step.py", "line": 50, "name": "forward"}
LOSS = {"filename": "/x/src/onegpu/techniques/chunked_loss.py", "line": 190, "name": "forward"}
TORCHAO = {"filename": "/env/site-packages/torchao/optim/adam.py", "line": 80, "name": "step"}
CPP = {"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::malloc"}


def _alloc(addr: int, size: int, *frames) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def _free(addr: int, size: int) -> dict:
    return {"action": "free_completed", "addr": addr, "size": size, "frames": []}


def test_the_peak_holds_what_was_alive_then_by_the_line_that_allocated_it():
    """100 bytes from before the window (40 of them freed in it); the peak comes when the loss's
    two blocks and the optimizer's are alive, not at the window's end."""
    events = [
        _alloc(1, 30, CPP, LOSS, STEP),
        _alloc(2, 50, LOSS, STEP),
        _free(900, 40),  # a block from before the window
        _alloc(3, 70, CPP, TORCHAO, STEP),  # the peak: 60 + 30 + 50 + 70 = 210
        {"action": "free_requested", "addr": 3, "size": 70, "frames": []},
        _free(3, 70),
        _free(2, 50),
        _alloc(4, 10, STEP),
    ]
    # alive at the end: the 60 from before, blocks 1 and 4
    segments = [{"device": 0, "blocks": [
        {"size": 60, "state": "active_allocated"}, {"size": 30, "state": "active_allocated"},
        {"size": 10, "state": "active_pending_free"}, {"size": 500, "state": "inactive"}]}]  # fmt: skip
    peak = peak_allocations({"segments": segments, "device_traces": [events]})
    assert peak.peak_bytes == 210
    assert peak.before_bytes == 60
    assert peak.by_site == [
        (BEFORE, 60, 0),
        ("onegpu/techniques/chunked_loss.py:190 forward", 80, 2),
        ("onegpu/backends/torch/step.py:50 forward via torchao/optim/adam.py:80 step", 70, 1),
    ]
    assert "0.000 GiB  onegpu/techniques/chunked_loss.py:190 forward  2 block(s)" in format_peak(
        peak
    )


def test_a_block_made_outside_onegpu_names_its_innermost_python_line():
    assert site_of([CPP, TORCHAO]) == "torchao/optim/adam.py:80 step"
    assert site_of([CPP]) == "(no Python frame)"


@pytest.mark.gpu
def test_on_a_gpu_the_replayed_peak_is_the_allocators_own():
    """A recorded window on a real device: the replay's peak equals what the allocator says it
    held at most in that window, and the largest block is this test's."""
    torch.cuda.synchronize()
    kept = torch.empty(2**20, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=10_000)
    try:
        a = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        b = torch.empty(16 * 2**20, dtype=torch.uint8, device="cuda")
        del a
        c = torch.empty(8 * 2**20, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak = peak_allocations(snapshot, torch.cuda.current_device())
    assert peak.peak_bytes == torch.cuda.max_memory_allocated()
    assert peak.by_site[0][1] >= 64 * 2**20 and "test_snapshot.py" in peak.by_site[0][0]
    del b, c, kept
