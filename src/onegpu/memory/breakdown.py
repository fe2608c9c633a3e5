"""Where a training step's peak memory goes, measured from real allocations.

One step (all micro-batches, clip, optimizer step) runs under `torch.profiler` with memory
profiling; PyTorch's memory profiler replays every allocation and free of the step and labels
each tensor (parameter, gradient, optimizer state, activation, temporary, ...). We take the
moment of the highest total and report its split, in bytes, under the names scripts rely on:
`{params, grads, optimizer, activations, other, peak}`. This works on CPU and CUDA alike and sees
only tensor allocations (not the interpreter or libraries: see measure.py for the process view).
Saved-activation bytes are counted exactly, separately, by SavedTensorCounter.

The labelling uses `torch.profiler._memory_profiler` (the engine behind the public
`export_memory_timeline`); if a torch release changes it, the breakdown is omitted with a note.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch

from onegpu.quiet import native_notes_dropped

_GROUPS = {
    "PARAMETER": "params",
    "GRADIENT": "grads",
    "OPTIMIZER_STATE": "optimizer",
    "ACTIVATION": "activations",
    "AUTOGRAD_DETAIL": "activations",
    "INPUT": "other",
    "TEMPORARY": "other",
    None: "other",
}


GROUPS = ("params", "grads", "optimizer", "activations", "other")


@contextlib.contextmanager
def profiling(device: torch.device) -> Iterator[Any]:
    """torch.profiler with what the memory timeline needs (shapes, memory, stacks), its
    native start/stop notes kept off the terminal (onegpu/quiet.py)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities, record_shapes=True, profile_memory=True, with_stack=True)
    with native_notes_dropped():
        prof.start()
    try:
        yield prof
    finally:
        with native_notes_dropped():
            prof.stop()


def profile_step_memory(step: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """Run `step()` once under the memory profiler; the split of bytes at its peak. With
    several processes on a CPU, only the step's most bytes (`allocated_in_step`): the
    timeline cannot see the frees gloo's threads make, and would hold those buffers alive."""
    with profiling(device) as prof:
        step()
    try:
        if device.type == "cpu" and _communicating():
            raise RuntimeError("gloo frees buffers on threads the profiler does not follow")
        times, groups = memory_timeline(prof, device)
    except Exception as e:  # a private API: degrade to the allocator's own total, never a guess
        return {
            "error": f"no breakdown by kind (torch {torch.__version__}'s memory timeline: {e})",
            "allocated_in_step": allocated_in_step(prof, device),
        }
    finally:  # the profile's events go (the caller hands their pages back to the kernel)
        del prof
        gc.collect()
    totals = [sum(col) for col in zip(*groups.values(), strict=True)]
    at = max(range(len(totals)), key=totals.__getitem__, default=None)
    out = {g: (int(v[at]) if at is not None else 0) for g, v in groups.items()}
    out["peak"] = sum(out.values())
    out["kind"] = "tensor allocations at the step's peak (torch.profiler memory timeline)"
    return out


def _communicating() -> bool:
    """Whether this process talks to others through a process group."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def allocated_in_step(prof, device: torch.device) -> int:
    """The most bytes the step had allocated at once beyond what existed when it began,
    replayed from the allocator's own allocation and free events (what the memory timeline's
    analysis would give, where that analysis cannot follow the step: DTensor's in-place version
    counters trip it in torch 2.13). Called right after the step.

    Not the events' running total: on CPU the profiler subtracts only frees made on a profiled
    thread, so a buffer that a communication thread (gloo's) lets go of stays counted for the
    rest of the process, and that total grows with every collective. Here an allocation lives
    until its free event; one freed unseen (its address handed out again with no free between,
    or no free at all and its storage not held after the step) belonged to a collective, whose
    buffers live as long as the collective, and is left out."""
    events = _allocation_events(prof, "cuda" if device.type == "cuda" else "cpu")
    unseen = _freed_unseen(events, _held_storages())
    live: dict[int, int] = {}
    current = peak = 0
    for i, (_, ptr, size) in enumerate(events):
        if size < 0:  # a free: of the step's own, or of what existed before it (it counts too)
            current -= live.pop(ptr, -size)
        elif i not in unseen:
            current -= live.pop(ptr, 0)  # its address handed out again: freed unseen before
            live[ptr] = size
            current += size
        peak = max(peak, current)
    return peak


def _allocation_events(prof, kind: str) -> list[tuple[int, int, int]]:
    """(time ns, address, bytes: negative for a free) of every allocator event, in order."""
    from torch._C._profiler import _EventType

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    tree = prof.profiler.kineto_results.experimental_event_tree()
    return sorted(
        (node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size)
        for node in walk(tree)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == kind
    )


def _freed_unseen(events: list[tuple[int, int, int]], held: set[int]) -> set[int]:
    """Indices of the allocations freed by a thread the profiler does not follow: no free
    event before their address is handed out again, or none at all and no storage held after
    the step."""
    unseen: set[int] = set()
    open_: dict[int, int] = {}  # address -> the allocation there not yet freed
    for i, (_, ptr, size) in enumerate(events):
        if size > 0:
            if ptr in open_:
                unseen.add(open_[ptr])
            open_[ptr] = i
        else:
            open_.pop(ptr, None)
    return unseen | {i for ptr, i in open_.items() if ptr not in held}


def _held_storages() -> set[int]:
    """Addresses of every tensor storage Python holds now (a DTensor's: its local shard's)."""
    held = set()
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            local = getattr(obj, "_local_tensor", obj)
            with contextlib.suppress(Exception):  # meta, fake and other storage-less tensors
                held.add(local.untyped_storage().data_ptr())
    return held


def memory_timeline(prof, device: torch.device) -> tuple[list[int], dict[str, list[int]]]:
    """Timestamps (us) and bytes alive per group (GROUPS order) from a profile recorded with
    record_shapes, profile_memory and with_stack."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    timeline = MemoryProfileTimeline(prof._memory_profile())
    times, sizes = timeline._coalesce_timeline(str(device) if device.type == "cuda" else "cpu")
    index_to_group = {
        i + 1: _GROUPS.get(getattr(c, "name", None), "other") for c, i in _CATEGORY_TO_INDEX.items()
    }
    groups = {g: [0] * len(sizes) for g in GROUPS}
    for t, row in enumerate(sizes):
        for i, nbytes in enumerate(row):
            if i in index_to_group:
                groups[index_to_group[i]][t] += int(nbytes)
    return list(times), groups


def with_exact_optimizer_bytes(memory: dict[str, Any], exact: int) -> dict[str, Any]:
    """Replace the profiler's optimizer-state figure by the exact count (in place). The
    profiler recognises the states of torch's own optimizers only (not torchao's 8-bit tensors,
    nor Adafactor's factored ones); states live through the whole step, so the exact count holds
    at the peak as everywhere."""
    if "peak" in memory:
        memory["peak"] += exact - memory["optimizer"]
        memory["optimizer"] = exact
    return memory
