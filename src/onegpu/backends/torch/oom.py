"""An allocator failure during training, turned into an answer: the CLI explains it with the
planner's cheapest fixes (plan/oom.py), and a CUDA memory snapshot is left in the run folder."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from onegpu.runs.folder import RunFolder
from onegpu.runs.meter import Meter


class TrainingOutOfMemory(RuntimeError):
    """The device ran out of memory; the CLI answers with the planner's cheapest fixes."""

    def __init__(self, step: int, device: torch.device, snapshot: Path | None):
        super().__init__(f"out of memory at step {step + 1} on {device}")
        self.step, self.device, self.snapshot = step, device, snapshot


@contextlib.contextmanager
def out_of_memory_report(run: RunFolder, device: torch.device, meter: Meter):
    """Turn an allocator failure into TrainingOutOfMemory, with a CUDA memory snapshot (for
    https://pytorch.org/memory_viz) in the run folder; checkpoints already written stay."""
    try:
        yield
    except torch.OutOfMemoryError:
        snapshot = None
        if device.type == "cuda":
            snapshot = run.path / "oom_memory_snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
        run.close()
        raise TrainingOutOfMemory(meter.steps, device, snapshot) from None
