"""What was alive at a CUDA run's peak, and where in the code each piece was allocated.

`torch.cuda.memory._record_memory_history` keeps every allocation and free of a window with
the Python stack that made it; `_snapshot()` returns them (the file https://pytorch.org/memory_viz
draws). The breakdown by kind (memory/breakdown.py) says *what* the peak holds (activations,
optimizer states, ...); when a plan and a GPU disagree on the peak, the question is *which
line* allocated the bytes the plan did not follow. Replaying the trace answers it: the total
after each event, the moment of the highest, and the blocks alive then, summed by the line of
onegpu's code nearest to their allocation (and the library line below it, torchao's say).
Blocks alive since before the window are one sum.

The total counts as `torch.cuda.max_memory_allocated` does, in time: a block from its `alloc`
to the `free_requested` of it (the allocator counts it freed there, even while a side stream
that used it holds its memory until `free_completed`). In bytes it is the requested size the
trace records: the allocator's own count rounds each block up (to 512 bytes, a large one to its
segment's split), so it reads a little above this one.

Torch-free: the snapshot is a plain dict (tests build one by hand).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PACKAGE = str(Path(__file__).resolve().parents[1]) + "/"
"""This package's directory: a frame under it is onegpu's code (a checkout's virtual
environment, also under a folder named onegpu, is not)."""
LIBRARIES = ("site-packages/", "dist-packages/")
BEFORE = "before the recorded window (weights, states made at build)"
NO_PYTHON = "no Python frame (backward's autograd thread, or C++ alone)"


@dataclass(slots=True)
class PeakAllocations:
    """The highest allocated total of the recorded window and what made it up."""

    peak_bytes: int
    before_bytes: int  # alive since before the window
    by_site: list[tuple[str, int, int]] = field(default_factory=list)
    """(where allocated, bytes, blocks) at the peak, largest first."""

    def as_dict(self, top: int = 12) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "before_window_bytes": self.before_bytes,
            "by_site": [
                {"site": site, "bytes": size, "blocks": n} for site, size, n in self.by_site[:top]
            ],
        }


def site_of(frames: list[dict[str, Any]]) -> str:
    """Where a block was allocated: the innermost frame of onegpu's code, with the innermost
    Python frame below it where that is another library's. Backward's allocations are made on
    the autograd engine's thread, which has no Python frame."""
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    ours = next((f for f in python if str(f["filename"]).startswith(PACKAGE)), None)
    if ours is None:
        return _frame(python[0]) if python else NO_PYTHON
    inner = python[0]
    below = f" via {_frame(inner)}" if inner is not ours else ""
    return f"{_frame(ours)}{below}"


def _frame(f: dict[str, Any]) -> str:
    path = str(f["filename"])
    if path.startswith(PACKAGE):
        path = "onegpu/" + path[len(PACKAGE) :]
    for marker in LIBRARIES:
        if marker in path:
            path = path[path.rindex(marker) + len(marker) :]
            break
    return f"{path}:{f.get('line', '?')} {f.get('name', '')}".strip()


def peak_allocations(snapshot: dict[str, Any], device: int = 0) -> PeakAllocations:
    """Replay `device`'s trace of `snapshot` to its highest allocated total."""
    traces = snapshot.get("device_traces") or []
    events = traces[device] if device < len(traces) else []
    allocated_at_end = sum(
        block.get("requested_size", block["size"])
        for segment in snapshot.get("segments", [])
        if segment.get("device", device) == device
        for block in segment.get("blocks", [])
        if block.get("state") == "active_allocated"  # a pending free is counted freed
    )
    net = sum(
        e["size"] if e["action"] == "alloc" else -e["size"]
        for e in events
        if e["action"] in ("alloc", "free_requested")
    )
    # what was allocated when the window began: what is at its end, less the window's net
    return _replayed_peak(events, allocated_at_end - net)


def _replayed_peak(events: list[dict[str, Any]], at_start: int) -> PeakAllocations:
    """The total after each event from `at_start` bytes, and the live blocks at its highest;
    a free of a block the window did not see allocated is one of the earlier ones."""
    live: dict[int, tuple[int, str]] = {}
    total = best = before = best_before = at_start
    best_live: dict[int, tuple[int, str]] = {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], site_of(e.get("frames", [])))
            total += e["size"]
        elif e["action"] == "free_requested":
            if live.pop(e["addr"], None) is None:
                before -= e["size"]
            total -= e["size"]
        else:
            continue
        if total > best:
            best, best_live, best_before = total, dict(live), before
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, site in best_live.values():
        sums[site][0] += size
        sums[site][1] += 1
    by_site = sorted(((s, b, n) for s, (b, n) in sums.items()), key=lambda r: -r[1])
    if best_before:
        by_site.insert(0, (BEFORE, best_before, 0))
    return PeakAllocations(best, best_before, by_site)


def format_peak(peak: PeakAllocations, top: int = 12) -> str:
    """summary.txt's lines: the peak and its largest parts by where they were allocated."""
    gib = 2**30
    lines = [
        f"allocated at the recorded window's peak: {peak.peak_bytes / gib:.2f} GiB (requested "
        "bytes, counted as torch.cuda.max_memory_allocated counts), by where it was allocated:"
    ]
    for site, size, n in peak.by_site[:top]:
        blocks = f"  {n} block(s)" if n else ""
        lines.append(f"  {size / gib:8.3f} GiB  {site}{blocks}")
    return "\n".join(lines)
