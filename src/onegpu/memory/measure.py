"""Real peak-memory measurements (never estimates).

CUDA: the caching allocator's peak of allocated bytes. CPU: the process's peak resident set size
(ru_maxrss), which includes the Python interpreter, libraries and mapped data pages: an honest
upper bound of what training needed, labelled as such.
"""

from __future__ import annotations

import resource
import sys

import torch


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def peak_kind(device: torch.device) -> str:
    if device.type == "cuda":
        return "cuda_max_memory_allocated"
    return "process_peak_rss"
