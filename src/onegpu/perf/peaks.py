"""A peak rate MFU is measured against (`Peak`, any device's), and, torch-free, the one a JAX
run on a CPU divides by: the peak `onegpu info` (or any torch run) measured on this CPU and
cached (perf/devices.py), so both backends' MFU share a denominator. Read without torch: the cache key's hardware part is computed here, and of the entries for this CPU, thread
count and dtype (any torch version and kernel ISA), the newest is taken. None where none was
measured (MFU then stays empty; `onegpu info` measures it), and on accelerators for now."""

from __future__ import annotations

import os
from dataclasses import dataclass

from onegpu.cache import entries, has
from onegpu.perf.cpu import hardware_key, read_cpuinfo

TORCH_DTYPE = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "bf16-pure": "torch.bfloat16"}


@dataclass(frozen=True, slots=True)
class Peak:
    flops: float
    source: str  # how the figure was obtained, for the run folder


def cached_cpu_peak(precision: str, threads: int | None = None) -> Peak | None:
    threads = threads or os.cpu_count() or 1
    prefix = hardware_key(read_cpuinfo()) + "|"
    dtype = TORCH_DTYPE.get(precision)
    found = [
        (value["measured"], key, value)
        for key, value in entries("cpu-peaks.json").items()
        if key.startswith(prefix)
        and key.endswith(f"|{dtype}")
        and f"|threads={threads}|" in key
        and has("flops", text=("measured",))(value)
    ]
    if not found:
        return None
    measured, key, value = max(found)
    return Peak(float(value["flops"]), f"measured {measured}: {key}")
