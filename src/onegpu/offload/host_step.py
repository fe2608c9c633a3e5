"""How fast this CPU steps an optimizer: the host half of an offloaded step, measured once and
cached like the matmul peak (under the same key: CPU, rate flags, clock, threads, torch).

An offloaded optimizer (memory.offload_optimizer, memory.offload_params) runs its step on the
CPU over every parameter: at a few hundred million parameters a second on a desktop CPU, the
step of an 8B model takes seconds, which the planner's predicted step time must include.
"""

from __future__ import annotations

import datetime
import time

import torch

from onegpu.cache import cached, has
from onegpu.perf.devices import cpu_peak_key

MEASURED = ("adamw", "sgd")
"""Optimizers timed as themselves; the others are planned at AdamW's rate (labelled)."""


def _measure(name: str, numel: int = 1 << 24) -> float:
    """Parameters per second of a CPU step of `name` over one fp32 tensor (best of 5)."""
    p = torch.zeros(numel, requires_grad=True)
    p.grad = torch.randn(numel)
    opt = (
        torch.optim.AdamW([p], lr=1e-3, fused=True)
        if name == "adamw"
        else torch.optim.SGD([p], lr=1e-3, momentum=0.9, foreach=True)
    )
    opt.step()  # states allocated
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - t0)
    return numel / best


def host_step_rate(optimizer: str, *, refresh: bool = False) -> tuple[float, str]:
    """(parameters/s of this CPU's optimizer step, how it was obtained), cached."""
    name = optimizer if optimizer in MEASURED else "adamw"

    def measure() -> dict[str, object]:
        when = datetime.datetime.now().isoformat(timespec="seconds")
        return {"params_per_s": _measure(name), "measured": when}

    entry = cached(
        "host-step.json",
        f"{cpu_peak_key(torch.float32)}|{name}",
        measure,
        refresh=refresh,
        valid=has("params_per_s", text=("measured",)),
    )
    how = f"measured {name} step on this CPU ({entry['measured']})"
    if name != optimizer:
        how += f"; {optimizer} planned at AdamW's rate"
    return float(entry["params_per_s"]), how
