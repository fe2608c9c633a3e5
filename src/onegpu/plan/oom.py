"""What to change when a run ran out of device memory: the planner's cheapest fixes.

The budget is the device's memory (less the CUDA context), or, where the plan of the failed
configuration fits that budget already (allocator caching and fragmentation are not in the
plan), three quarters of its planned peak: changes that lower the peak by a quarter.
"""

from __future__ import annotations

import torch

from onegpu.backends.torch.oom import TrainingOutOfMemory
from onegpu.config import Config
from onegpu.plan.fixes import fixes_for
from onegpu.plan.memory import plan_memory
from onegpu.plan.targets import CUDA_OVERHEAD_BYTES


def explain(cfg: Config, err: TrainingOutOfMemory) -> str:
    target = "cuda" if err.device.type == "cuda" else "cpu"
    peak = plan_memory(cfg, target).memory["peak"]
    budget = int(0.75 * peak)
    if err.device.type == "cuda":
        capacity = torch.cuda.get_device_properties(err.device).total_memory - CUDA_OVERHEAD_BYTES
        budget = min(capacity, budget) if peak <= capacity else capacity
    found = fixes_for(cfg, budget, target, base_peak=peak)
    steps = [
        f"{f['change']} ({' '.join(f'--{k} {v}' for k, v in f['overrides'].items())})"
        for f in found
    ]
    advice = (
        "the planner's cheapest changes, in order: " + "; then ".join(steps)
        if steps
        else "no single technique fits it: a smaller model, shorter sequences or more devices"
    )
    where = f"; memory snapshot: {err.snapshot}" if err.snapshot else ""
    return (
        f"{err} (planned peak {peak / 2**30:.2f} GiB, target {budget / 2**30:.2f} GiB); "
        f"{advice}; checkpoints written so far are intact{where}"
    )
