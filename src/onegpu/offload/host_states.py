"""Optimizer states in host memory, stepped on the device (`memory.offload_states`).

The host tier of `memory.offload_optimizer` steps on the CPU, which is fine for fused AdamW
(over a billion parameters a second on two cores) and hopeless for quantized states: torchao's
and bitsandbytes' 8-bit AdamW step about 30 million parameters a second per CPU core
(`python benchmarks/host_step_rates.py`), so an 8B model's host step would take tens of
seconds on a workstation. Here the states live in host memory and the device does the
arithmetic: each parameter's states cross the link just before its step and go back after it,
2 bytes per parameter each way for 8-bit AdamW, and the CPU computes nothing. bitsandbytes'
paged optimizers (torchtune's recipe for an 8B model on a 24 GB card) reach the same place
through unified memory's page faults; here the copies are scheduled, on side streams (one
each way: PCIe moves both directions at once), the next parameter's states sent while the
current one steps, so their cost is predictable and the planner can price it.

Each parameter has an optimizer of its own (optim/in_backward.py's `PerParameterOptimizers`),
stepped in backward (`optim.in_backward`: the device then never holds more than two
parameters' states and, with the gradients freed as they step, two gradients) or one parameter
at a time after backward. The states are whatever the optimizer keeps, plain tensors or tensor
subclasses (torchao's 8-bit and 4-bit states are moved by their inner tensors), so every
optimizer onegpu builds works unchanged and its checkpoints load with or without this tier.

On a CPU the device and the host are the same memory: the copies are plain copies (what the
tests run; the results are bit-identical to keeping the states in place).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

Parked = dict[str, Any]
"""One parameter's optimizer state in host memory (tensors on the host, numbers as they are)."""


def _inner(value: torch.Tensor) -> tuple[list[str], Any]:
    """A tensor subclass's inner tensors (by attribute) and its rebuild context; a plain
    tensor is its own single inner tensor."""
    if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
        return value.__tensor_flatten__()
    return [], None


def copy_to(
    value: Any, device: torch.device, *, pin: bool = False, non_blocking: bool = False
) -> Any:
    """A copy of `value` (a tensor, tensor subclass or number) on `device`: a new allocation
    always, also where `device` is where it already is."""
    if not isinstance(value, torch.Tensor):
        return value
    names, ctx = _inner(value)
    if not names:
        out = torch.empty(value.shape, dtype=value.dtype, device=device, pin_memory=pin)
        return out.copy_(value, non_blocking=non_blocking)
    inner = {
        n: copy_to(getattr(value, n), device, pin=pin, non_blocking=non_blocking) for n in names
    }
    return type(value).__tensor_unflatten__(inner, ctx, value.shape, value.stride())


def _copy_into(host: Any, device_value: Any, *, non_blocking: bool) -> None:
    """Write a device state back into its host copy, inner tensor by inner tensor."""
    if not isinstance(host, torch.Tensor):
        return
    names, _ = _inner(host)
    if not names:
        host.copy_(device_value, non_blocking=non_blocking)
        return
    for n in names:
        _copy_into(getattr(host, n), getattr(device_value, n), non_blocking=non_blocking)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The plain tensors that hold `value`'s bytes."""
    if not isinstance(value, torch.Tensor):
        return []
    names, _ = _inner(value)
    if not names:
        return [value]
    return [t for n in names for t in _tensors(getattr(value, n))]


class HostStates:
    """Where each parameter's optimizer state waits between its steps: host memory (pinned
    with an accelerator). `visiting(p, optimizer)` brings the state to the device for one step
    and sends it back after; `next_up` names the parameter whose states to send ahead."""

    def __init__(self, device: torch.device, *, across_steps: bool = False):
        """`across_steps`: the last parameter's step sends the next step's first states
        ahead (in backward, where the device holds two parameters' states at the backward's
        start anyway; after backward they would sit through the forward's peak)."""
        self.device = device
        self.across_steps = across_steps
        self.pin = device.type == "cuda"
        cuda = device.type == "cuda"
        # two side streams: states going out and coming back use both directions of the link
        self._h2d = torch.cuda.Stream(device) if cuda else None
        self._d2h = torch.cuda.Stream(device) if cuda else None
        self._back: dict[torch.Tensor, Any] = {}  # p -> event: its copy back is done
        self._parked: dict[torch.Tensor, Parked] = {}
        self._moved_keys: dict[torch.Tensor, set[str]] = {}  # what crosses the link
        self._sent: dict[torch.Tensor, tuple[Parked, Any]] = {}  # prefetched: state, event
        self._order: list[torch.Tensor] = []  # the order parameters stepped in, first step
        self._next: dict[torch.Tensor, torch.Tensor] = {}

    # ------------------------------------------------------------------ one parameter's step

    @contextlib.contextmanager
    def visiting(self, p: torch.Tensor, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """The optimizer's state of `p` on the device for the body (one step), then back on the
        host; the next parameter's state goes out meanwhile (from the second step on)."""
        if p in self._parked or p in self._sent:
            optimizer.state[p] = self._on_device(p)
        self._learn_order(p)
        following = self._next.get(p)
        waiting = following in self._parked and following not in self._sent
        if following is not None and following is not p and waiting:
            self._send_ahead(following)  # on its stream, while p steps on the current one
        yield
        self._park(p, optimizer)

    def _on_device(self, p: torch.Tensor) -> Parked:
        """`p`'s state on the device: sent ahead already, or sent now (and waited for)."""
        if p in self._sent:
            state, event = self._sent.pop(p)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
            return state
        self._send_ahead(p)
        return self._on_device(p)

    def _send_ahead(self, p: torch.Tensor) -> None:
        """Start copying `p`'s parked state to the device (side stream with an accelerator)."""
        parked = self._parked[p]
        side = self._h2d
        if side is not None and p in self._back:  # after its last copy back has landed
            side.wait_event(self._back[p])
        ctx = torch.cuda.stream(side) if side is not None else contextlib.nullcontext()
        with ctx:
            moved = self._moved_keys[p]
            state = {
                k: copy_to(v, self.device, pin=False, non_blocking=side is not None)
                if k in moved
                else v
                for k, v in parked.items()
            }
        event = side.record_event() if side is not None else None
        if side is not None:  # made on the side stream, used by the step on the current one
            for t in (t for k in moved for t in _tensors(state[k])):
                t.record_stream(torch.cuda.current_stream(self.device))
        self._sent[p] = (state, event)

    def _park(self, p: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """The step's state of `p` back into its host copy (made at the first step), and the
        optimizer holds the host copy until the next step. What the optimizer keeps off the
        device (torch's AdamW keeps its step count on the CPU) stays as it is."""
        state = optimizer.state.get(p)
        if not state:
            return
        side = self._d2h
        if side is not None:  # after the step's kernels; the device state lives until then
            side.wait_stream(torch.cuda.current_stream(self.device))
        moved = {k for k, v in state.items() if self._on_this_device(v)}
        parked = self._parked.get(p)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if parked is None:
                cpu = torch.device("cpu")
                parked = {
                    k: copy_to(v, cpu, pin=self.pin, non_blocking=False) if k in moved else v
                    for k, v in state.items()
                }
            else:
                for k, v in state.items():
                    if k in moved:
                        _copy_into(parked[k], v, non_blocking=side is not None)
                    else:
                        parked[k] = v
        if side is not None:
            for t in (t for k in moved for t in _tensors(state[k])):
                t.record_stream(side)
            self._back[p] = side.record_event()
        self._parked[p] = parked
        self._moved_keys[p] = moved
        optimizer.state[p] = parked

    def _on_this_device(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.device.type == self.device.type

    def _learn_order(self, p: torch.Tensor) -> None:
        """Record the order of the first step's parameters: each one's successor is sent
        ahead while it steps (and the last one's is the next step's first, `across_steps`)."""
        if self._next:
            return
        if any(p is q for q in self._order):  # a second step has begun: the order is known
            following = self._order[1:]
            if self.across_steps and len(self._order) > 1:  # one alone: never its own
                following = following + self._order[:1]
            self._next = dict(zip(self._order, following, strict=False))
            self._order = []
            return
        self._order.append(p)

    # ------------------------------------------------------------------ checkpoints

    def park_loaded(self, p: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """After a checkpoint loaded `p`'s state (onto the device, by torch's rules): to the
        host, one parameter at a time."""
        self._parked.pop(p, None)
        self._sent.pop(p, None)
        self._park(p, optimizer)

    def synchronize(self) -> None:
        """Every copy back to the host is done (before the states are read: a checkpoint)."""
        for side in (self._h2d, self._d2h):
            if side is not None:
                side.synchronize()

    def host_bytes(self) -> int:
        """Bytes of the parked states."""
        return sum(
            t.untyped_storage().nbytes()
            for p, parked in self._parked.items()
            for k in self._moved_keys[p]
            for t in _tensors(parked[k])
        )
