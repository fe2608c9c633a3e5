"""The peak of a recorded CUDA window, replayed from the allocator's trace, by allocation site."""

from __future__ import annotations

import pytest
import torch

from onegpu.memory.snapshot import (
    BEFORE,
    NO_PYTHON,
    PACKAGE,
    format_peak,
    peak_allocations,
    site_of,
)

STEP = {"filename": f"{PACKAGE}backends/torch/step.py", "line": 50, "name": "forward"}
LOSS = {"filename": f"{PACKAGE}techniques/chunked_loss.py", "line": 190, "name": "forward"}
TORCHAO = {"filename": "/env/lib/python3.12/site-packages/torchao/optim/adam.py", "line": 80, "name": "step"}  # fmt: skip
CPP = {"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::malloc"}


def _alloc(addr: int, size: int, *frames) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def _free(addr: int, size: int) -> list[dict]:
    """A free as the allocator records it: requested (counted freed), then completed."""
    return [{"action": a, "addr": addr, "size": size, "frames": []}
            for a in ("free_requested", "free_completed")]  # fmt: skip


def test_the_peak_holds_what_was_alive_then_by_the_line_that_allocated_it():
    """100 bytes from before the window (40 of them freed in it); the peak comes when the loss's
    two blocks and the optimizer's are alive, not at the window's end. A block whose free was
    requested counts freed, though a side stream holds it until the free completes."""
    events = [
        _alloc(1, 30, CPP, LOSS, STEP),
        _alloc(2, 50, LOSS, STEP),
        *_free(900, 40),  # a block from before the window
        _alloc(3, 70, CPP, TORCHAO, STEP),  # the peak: 60 + 30 + 50 + 70 = 210
        {"action": "free_requested", "addr": 3, "size": 70, "frames": []},
        _alloc(5, 20, LOSS),  # 140 + 20: block 3's memory is still held, but counted freed
        {"action": "free_completed", "addr": 3, "size": 70, "frames": []},
        *_free(2, 50),
        _alloc(4, 10, STEP),
        {"action": "free_requested", "addr": 5, "size": 20, "frames": []},
    ]
    # at the end: the 60 from before, blocks 1 and 4 allocated, block 5 pending its free
    segments = [{"device": 0, "blocks": [
        {"size": 512, "requested_size": 60, "state": "active_allocated"},
        {"size": 512, "requested_size": 30, "state": "active_allocated"},
        {"size": 512, "requested_size": 10, "state": "active_allocated"},
        {"size": 512, "requested_size": 20, "state": "active_pending_free"},
        {"size": 4096, "state": "inactive"}]}]  # fmt: skip
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
    assert site_of([CPP]) == NO_PYTHON
    venv = {"filename": "/home/u/onegpu/.venv/lib/python3.12/site-packages/torch/nn/functional.py",
            "line": 3, "name": "linear"}  # fmt: skip
    assert site_of([venv]) == "torch/nn/functional.py:3 linear"  # a checkout's venv is not ours


@pytest.mark.gpu
def test_on_a_gpu_the_replayed_peak_is_the_allocators_own():
    """A recorded window on a real device, odd sizes and a tensor a side stream used: the
    replay's peak is the allocator's own count but for its rounding of each block, and the
    largest block is this test's."""
    torch.cuda.synchronize()
    kept = torch.empty(1_000_001, dtype=torch.uint8, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=10_000)
    side = torch.cuda.Stream()
    try:
        a = torch.empty(64 * 2**20 + 1, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(side):
            b = torch.ones(3 * 2**20 + 7, dtype=torch.uint8, device="cuda")
        b.record_stream(torch.cuda.current_stream())
        del a, b  # b's free waits on the side stream's event; the allocator counts it freed
        c = torch.empty(8 * 2**20 + 3, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak = peak_allocations(snapshot, torch.cuda.current_device())
    allocator = torch.cuda.max_memory_allocated()
    assert allocator - 4 * 2**20 <= peak.peak_bytes <= allocator  # blocks rounded up
    site, size, _ = max((r for r in peak.by_site if r[0] != BEFORE), key=lambda r: r[1])
    assert size >= 64 * 2**20 and "test_snapshot.py" in site
    assert peak.before_bytes >= 1_000_001  # and whatever earlier tests left allocated
    del c, kept
